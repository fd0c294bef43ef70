"""causal_conv1d: depthwise causal convolution over time (+ SiLU), honouring packed-document boundaries.

Layout is channels-last, ``x: [B, T, D]``, ``weight: [D, W]``; with ``cu_seqlens`` (packed documents) the
batch must be 1 and no output position reads an input of an earlier document.
"""

from __future__ import annotations

import torch

from fusepatch.backends import causal_conv1d as conv_backend
from fusepatch.backends.kernels_hub import HubKernel, hub_candidate
from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import CudaDevice, InputRule
from fusepatch.ops.boundaries import host_built, host_values
from fusepatch.ops.causal_conv1d.reference import causal_conv1d_reference
from fusepatch.ops.common import CAUSAL_CONV1D_FIX, fla_candidate, package_requirements, rand


def _document_numbers(host: tuple[int, ...]) -> torch.Tensor:
    import numpy as np  # boundaries.host_built says why not torch

    lengths = np.diff(np.asarray(host, dtype=np.int64))
    return torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))[None]


def sequence_index(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """causal-conv1d's ``seq_idx``, ``[1, total]`` int32: every position's document number. From the boundaries'
    host values where they are known (``boundaries.host_built``: built on the host, copied without a wait, shared by
    the layers of a forward, its recompute and its backward; else every layer's call ran five small GPU kernels to
    make it, in the packed forward that the CPU holds back). Other boundaries (a caller's ``cu_seq_lens_q``):
    built on the GPU from the tensor, without a wait."""
    host = host_values(cu_seqlens)
    if host is not None and host[-1] == total:
        return host_built(cu_seqlens, "seq_idx", _document_numbers, device)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    ids = torch.arange(len(lengths), device=device, dtype=torch.int32)
    return torch.repeat_interleave(ids, lengths, output_size=total)[None]


def _causal_conv1d_adapter(causal_conv1d_fn):
    """The op's signature over Dao-AILab's ``causal_conv1d_fn`` (pip package and Kernel Hub build alike)."""

    def causal_conv1d_cuda(x, weight, bias=None, activation="silu", cu_seqlens=None):
        seq_idx = None
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"packed inputs (cu_seqlens) need batch size 1, got {x.shape[0]}")
            seq_idx = sequence_index(cu_seqlens, x.shape[1], x.device)
        # [B, T, D] contiguous -> a [B, D, T] view with stride(1) == 1: the channel-last layout seq_idx needs.
        out = causal_conv1d_fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
        return out.transpose(1, 2)

    return causal_conv1d_cuda


def _arity(fn) -> int | None:
    """How many arguments a pybind11 function takes, from the signature line pybind11 writes first in its
    docstring (``name(arg0: ..., arg1: ...) -> None``); None where there is no such line."""
    lines = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    line = lines[0] if lines else ""
    if "(" not in line or ")" not in line:
        return None
    inside = line[line.index("(") + 1 : line.rindex(")")]
    if not inside.strip():
        return 0
    commas, depth = 0, 0
    for char in inside:  # the commas between arguments, not those inside a type such as tuple[int, int]
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            commas += 1
    return commas + 1


def _direct_conv():
    """causal-conv1d's compiled forward and backward called from fusepatch's own autograd function, past the
    package's ``torch.library.custom_op`` wrappers; None where the extension is not the one this call matches.

    The package (1.7 here) routes every call through two custom ops (``DaoAILab::_causal_conv1d_fwd_cpp`` /
    ``_bwd_cpp``), which torch.compile needs but which cost the host a custom op's dispatch each way, a third of
    the conv's host time, in layer 0 of a synced step where the GPU waits for the host (benchmarks/studies/step_start.py
    shows it). The kernels, their arguments and the buffers (channel-last ``out``/``dx``, fp32 ``dweight``/``dbias``
    cast back) are the package's own, so the results are too; under torch.compile the package's function runs."""
    try:
        import causal_conv1d_cuda as ext
    except ImportError:
        return None
    # 1.7's: fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu) -> None and
    # bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias, dinitial_states, silu)
    arities = tuple(_arity(getattr(ext, name, None)) for name in conv_backend.ARITIES)
    if arities != tuple(conv_backend.ARITIES.values()):
        conv_backend.NAMES.drift(
            f"{conv_backend.EXTENSION}'s functions take {arities[0]}/{arities[1]} arguments (1.7's: 8/12)",
            "the package's causal_conv1d_fn is called, through its custom ops (more host time a layer)",
        )
        return None

    class _CausalConv1d(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, seq_idx, silu: bool):
            if x.stride(2) != 1 and x.stride(1) != 1:  # the kernels take channel-first or channel-last rows
                x = x.contiguous()
            bias = bias.contiguous() if bias is not None else None
            seq_idx = seq_idx.contiguous() if seq_idx is not None else None
            out = torch.empty_like(x)  # x's layout (channel-last here)
            ext.causal_conv1d_fwd(x, weight, bias, seq_idx, None, out, None, silu)
            ctx.save_for_backward(x, weight, bias, seq_idx)
            ctx.silu = silu
            return out

        @staticmethod
        def backward(ctx, dout):
            x, weight, bias, seq_idx = ctx.saved_tensors
            if dout.stride(2) != 1 and dout.stride(1) != 1:
                dout = dout.contiguous()
            dx = torch.empty_like(x)
            dweight = torch.zeros_like(weight, dtype=torch.float32)
            dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
            ext.causal_conv1d_bwd(x, weight, bias, dout, seq_idx, None, None, dx, dweight, dbias, None, ctx.silu)
            return dx, dweight.type_as(weight), dbias.type_as(bias) if bias is not None else None, None, None

    def causal_conv1d_direct(x, weight, bias=None, seq_idx=None, activation=None):
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        return _CausalConv1d.apply(x, weight, bias, seq_idx, activation in ("silu", "swish"))

    return causal_conv1d_direct


def _load_causal_conv1d():
    from causal_conv1d import causal_conv1d_fn

    direct = _direct_conv()
    if direct is None:
        return _causal_conv1d_adapter(causal_conv1d_fn)

    def either(x, weight, bias=None, seq_idx=None, activation=None):
        if torch.compiler.is_compiling():  # the package's custom ops are what dynamo can trace
            return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation=activation)
        return direct(x, weight, bias, seq_idx=seq_idx, activation=activation)

    return _causal_conv1d_adapter(either)


def _load_fla_conv():
    from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d

    def causal_conv1d_fla(x, weight, bias=None, activation="silu", cu_seqlens=None):
        out, _ = fla_causal_conv1d(x, weight, bias, activation=activation, backend="triton", cu_seqlens=cu_seqlens)
        return out

    return causal_conv1d_fla


def _selftest_inputs(device, dtype, generator, packed=True, dims=None):
    dims = dims or {}
    batch, length, dim, width = 1, 77, dims.get("dim", 96), dims.get("width", 4)
    x = rand((batch, length, dim), device, dtype, generator)
    weight = rand((dim, width), device, dtype, generator, scale=0.5)
    cu = torch.tensor([0, 30, 31, 77], dtype=torch.int32, device=device) if packed else None
    return (x, weight, None), {"activation": "silu", "cu_seqlens": cu}


def _dims(module) -> dict[str, int]:
    return {"dim": module.conv_dim, "width": module.conv_kernel_size}


CAUSAL_CONV1D = Op(
    name="causal_conv1d",
    summary="depthwise causal conv1d + SiLU over the q/k/v channels, varlen-exact",
    reference=causal_conv1d_reference,
    candidates=(
        Candidate(
            name="causal-conv1d",
            source="pip",
            requirements=package_requirements("causal-conv1d", ">=1.4", "causal_conv1d", CAUSAL_CONV1D_FIX),
            load=_load_causal_conv1d,
            inputs=InputRule(kernel="causal-conv1d", dtypes=("bfloat16", "float16", "float32")),
            provides="causal_conv1d's kernels, called past its custom ops (its causal_conv1d_fn under torch.compile; seq_idx for packed rows)",
            distribution="causal-conv1d",
        ),
        fla_candidate(
            "fla-conv",
            "fla.modules.causal_conv1d.ops",
            _load_fla_conv,
            "fla's Triton conv",
            "fla.modules.causal_conv1d.ops.causal_conv1d (backend='triton')",
        ),
        # The Kernel Hub build of the same kernels (no compiler needed): pinned by version, a lock file or
        # LOCAL_KERNELS (see fusepatch/backends/kernels_hub.py).
        hub_candidate(
            HubKernel("kernels-community/causal-conv1d", "causal_conv1d_fn", version=1, adapter=_causal_conv1d_adapter),
            requirements=(CudaDevice(),),
            inputs=InputRule(kernel="the Kernel Hub causal-conv1d", dtypes=("bfloat16", "float16", "float32")),
        ),
    ),
    selftest=SelfTest(_selftest_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}, _dims),
)
