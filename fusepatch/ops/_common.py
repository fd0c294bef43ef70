"""Requirement bundles and helpers shared by the op modules."""

from __future__ import annotations

import contextlib

import torch

from fusepatch.ops.base import Candidate
from fusepatch.requirements import (
    CudaDevice,
    DistributionVersion,
    Importable,
    InputRule,
    MinCapability,
    NoKnownIssue,
    NotImplementedYet,
)

FLA_FIX = 'pip install "flash-linear-attention[cuda]"'
CAUSAL_CONV1D_FIX = "python -m fusepatch build causal-conv1d   (builds for this GPU only; or: pip install causal-conv1d --no-build-isolation)"
TRITON_FIX = "pip install triton   (a CUDA build of torch on Linux brings it)"
HUB_FIX = 'pip install "fusepatch[hub]"'


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
    """What every fla (Triton) kernel needs: fla-core >= 0.5 (native GVA, in-kernel gate), a GPU, Triton."""
    return (
        CudaDevice(),
        MinCapability((8, 0), "fla's Triton kernels"),
        DistributionVersion("fla-core", ">=0.5", FLA_FIX, why="older fla needs q/k heads repeated for grouped values"),
        DistributionVersion("triton", ">=3.3", FLA_FIX),
        Importable(module, "fla-core", FLA_FIX),
    )


def fla_backward_requirements(module: str) -> tuple:
    """fla kernels whose backward goes through the gated chunk_bwd_dqkwg kernel (see known_issues.py)."""
    return fla_requirements(module) + (NoKnownIssue("fla-core"),)


def check_fla_signatures(module, needs: dict[str, set[str]], skip: str) -> None:
    """fusepatch calls these fla functions directly, by keyword: an fla-core whose function lost a parameter
    fusepatch passes (or lost the function) fails the candidate's load with the fix, instead of a TypeError
    mid-training. ``skip``: the ``op/candidate`` to name in FUSEPATCH_SKIP."""
    import inspect

    for name, wanted in needs.items():
        function = getattr(module, name, None)
        missing = wanted - set(inspect.signature(function).parameters) if callable(function) else {"itself"}
        if missing:
            raise ImportError(
                f"fla's {name} lacks {sorted(missing)} (fla-core changed it); fusepatch knows fla-core 0.5-0.6's. "
                f"Fix: pip install 'fla-core>=0.5,<0.7', or FUSEPATCH_SKIP={skip}"
            )


def hub_requirements(repo: str, why: str) -> tuple:
    """A Hub kernel not wired up yet, and why (shown by doctor as ``planned``)."""
    return (
        CudaDevice(),
        DistributionVersion("kernels", ">=0.10", HUB_FIX),
        NotImplementedYet(f"Kernel Hub repo {repo}: {why}"),
    )


def planned_hub_candidate(repo: str, why: str, provides: str = "") -> Candidate:
    """A Kernel Hub kernel the registry names but does not wire up yet (``doctor`` shows it as planned, why)."""
    return Candidate(
        name=f"hub:{repo}", source="hub", requirements=hub_requirements(repo, why), load=lambda: None, provides=provides
    )


def planned(what: str) -> tuple:
    return (NotImplementedYet(what),)


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
