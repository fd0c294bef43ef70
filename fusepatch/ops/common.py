"""Requirement bundles and helpers shared by the op modules."""

from __future__ import annotations

import contextlib

import torch

from fusepatch.backends import fla as fla_backend
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import (
    CudaDevice,
    DistributionVersion,
    Importable,
    InputRule,
    MinCapability,
    NoKnownIssue,
)

FLA_FIX = fla_backend.FIX
CAUSAL_CONV1D_FIX = "python -m fusepatch build causal-conv1d   (builds for this GPU only; or: pip install causal-conv1d --no-build-isolation)"
TRITON_FIX = "pip install triton   (a CUDA build of torch on Linux brings it)"


def package_requirements(distribution: str, spec: str, module: str, fix: str) -> tuple:
    """A CUDA kernel from one installed package: a GPU, the distribution in ``spec``, and ``module`` importing."""
    return (CudaDevice(), DistributionVersion(distribution, spec, fix), Importable(module, distribution, fix))


def own_triton_candidate(load, kernel: str, provides: str) -> Candidate:
    """A kernel of fusepatch's own (``fusepatch/kernels/``): a GPU and Triton, one fixed launch configuration."""
    return Candidate(
        name="triton",
        source="pip",
        requirements=package_requirements("triton", ">=3.0", "triton", TRITON_FIX),
        load=load,
        inputs=InputRule(kernel=kernel),
        provides=f"{provides} (fixed launch configuration: no autotuning)",
        distribution="triton",
    )


def fla_requirements(module: str) -> tuple:
    """What every fla (Triton) kernel needs: fla-core >= 0.6 (backends/fla.py), a GPU, Triton."""
    return (
        CudaDevice(),
        MinCapability((8, 0), "fla's Triton kernels"),
        DistributionVersion(
            fla_backend.DISTRIBUTION,
            fla_backend.REQUIRED,
            FLA_FIX,
            why="the version whose private names fusepatch checked",
        ),
        DistributionVersion("triton", ">=3.3", FLA_FIX),
        Importable(module, "fla-core", FLA_FIX),
    )


def fla_backward_requirements(module: str) -> tuple:
    """fla kernels whose backward goes through the gated chunk_bwd_dqkwg kernel (see base/known_issues.py)."""
    return fla_requirements(module) + (NoKnownIssue("fla-core"),)


def fla_candidate(
    name: str, module: str, load, inputs: InputRule | str, provides: str, *, backward: bool = False
) -> Candidate:
    """A kernel of fla's (fla-core from the package index) imported from ``module``. ``inputs``: the input rule, or
    the kernel's name for the default rule; ``backward``: its backward goes through the gated chunk_bwd_dqkwg
    kernel (:func:`fla_backward_requirements`)."""
    return Candidate(
        name=name,
        source="pip",
        requirements=(fla_backward_requirements if backward else fla_requirements)(module),
        load=load,
        inputs=InputRule(kernel=inputs) if isinstance(inputs, str) else inputs,
        provides=provides,
        distribution=fla_backend.DISTRIBUTION,
    )


def on_device(device: torch.device):
    """Kernels (fla's, Triton's) launch on the current CUDA device: a context making it ``device``'s (as fla's own
    input_guard does); nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def rand(shape, device, dtype, generator, *, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    """Fresh random test data, drawn in fp32 on the CPU generator, then moved (so every device sees the same)."""
    t = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype).requires_grad_(grad)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in fp64; inf when actual has NaN/Inf."""
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff
