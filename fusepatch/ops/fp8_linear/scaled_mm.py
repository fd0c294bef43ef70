"""A linear projection whose three GEMMs (output, input gradient, weight gradient) run in FP8 on
``torch._scaled_mm`` with rowwise scales: every operand quantized to float8_e4m3fn along the GEMM's reduction
dimension, one scale per row (per token, per output or input feature), so one large value costs only its own
row's precision. The forward keeps the high-precision input (as a bf16 linear does) and quantizes it again,
transposed, for the weight gradient; the weight stays in its own dtype (the optimizer's master copy).

``_scaled_mm`` takes its first operand row-major and its second column-major, each with a reduction dimension
that is a multiple of 16, and with rowwise scales writes bf16 only: the token dimension of the weight gradient is
padded with zero rows to a multiple of 16, and outputs in another dtype are cast from bf16.

Every GEMM accumulates with ``use_fast_accum`` (Hopper's FP8 tensor cores keep the running sum in their own
precision instead of promoting it to fp32 along the way; torchao's float8 forward does the same): 8% less GEMM
time at the 27B projections' shapes at the same error against fp32, and over 300 steps of training on unrepeated
text a loss curve as far from bf16's as without it (inside bf16's seed-to-seed spread in 5 of 12 windows, 4
without: docs/fp8.md, "Where it pays").

An input whose FP8 rows came with it (``kernels/fp8_rows``: written by the kernel that produced it, or by the first
of several projections of it) is not quantized again: ``fp8_linear`` looks them up by the tensor itself and its
state, and the projections sharing them also share the weight gradient's by-columns quantization of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fusepatch.kernels import fp8_rows
from fusepatch.kernels.fp8_range import FP8_MAX, FP8_TINY, MULTIPLE, padded, unaligned

FP8 = torch.float8_e4m3fn
FAST_ACCUM = True  # every FP8 GEMM (module docstring: measured on the step and on a 300-step loss curve)


def row_scale_reference(peak: torch.Tensor, top: float = FP8_MAX) -> torch.Tensor:
    """``kernels/fp8.row_scale`` in PyTorch: the largest power of two that keeps a row of this peak within ``top``
    (a zero row's peak floored at ``FP8_TINY``; NaN for a NaN peak)."""
    return torch.exp2(torch.floor(torch.log2(top / peak.clamp_min(FP8_TINY))))


def quantize_rows_reference(x: torch.Tensor, factor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels/fp8.quantize_rows`` in PyTorch: the same power-of-two scales and the same bits."""
    values = x.float() if factor is None else x.float() * factor.reshape(1, -1).float()
    if values.shape[1] == 0:  # no values (a step without tokens): the peak of a zero row
        peak = values.new_full((values.shape[0], 1), FP8_TINY)
    else:
        peak = values.abs().amax(dim=1, keepdim=True).clamp_min(FP8_TINY)
    scale = row_scale_reference(peak)
    q = (values * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reciprocal()


def quantize_columns_reference(x: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels/fp8.quantize_columns`` in PyTorch: ``x.t()`` padded with zero columns to a multiple of
    ``multiple``, quantized along its rows."""
    rows, columns = x.shape
    transposed = x.new_zeros((columns, padded(rows, multiple)))
    transposed[:, :rows] = x.t()
    return quantize_rows_reference(transposed)


def transpose_reference(q: torch.Tensor) -> torch.Tensor:
    """``kernels/fp8.transpose`` in PyTorch."""
    return q.t().contiguous()


class Quantizers(NamedTuple):
    rows: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    columns: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    transpose: Callable[[torch.Tensor], torch.Tensor]


def quantizers(device: torch.device) -> Quantizers:
    if device.type == "cuda":
        from fusepatch.kernels.fp8 import quantize_columns, quantize_rows, transpose

        return Quantizers(quantize_rows, quantize_columns, transpose)
    return Quantizers(quantize_rows_reference, quantize_columns_reference, transpose_reference)


def fp8_mm(a, a_inverse, b, b_inverse, dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_inverse) @ (b * b_inverse).t()`` for FP8 ``a [M, K]`` and ``b [N, K]``, both row-major, with
    rowwise inverse scales ``[M, 1]`` and ``[N, 1]``, in ``dtype`` (``_scaled_mm`` writes bf16)."""
    out = torch._scaled_mm(
        a, b.t(), scale_a=a_inverse, scale_b=b_inverse.t(), out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM
    )
    return out if dtype == torch.bfloat16 else out.to(dtype)


def _project(
    x: torch.Tensor, q: torch.Tensor, inverse: torch.Tensor, bias: torch.Tensor | None, carried: fp8_rows.Carried | None
) -> torch.Tensor:
    """The forward GEMM of both functions: ``x`` quantized by rows (or its carried rows) against the FP8 weight,
    plus the bias."""
    rows = carried.rows if carried is not None else quantizers(x.device).rows(x)
    out = fp8_mm(*rows, q, inverse, x.dtype)
    return out if bias is None else out + bias.to(out.dtype)


class QuantizedWeight(NamedTuple):
    """A weight ``[out, in]`` in FP8 along its rows (the forward's layout) and its inverse scales ``[out, 1]``."""

    q: torch.Tensor
    inverse: torch.Tensor


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` as the forward GEMM reads it: what a frozen weight keeps between steps."""
    return QuantizedWeight(*quantizers(weight.device).rows(weight.detach()))


def prepare(weight: torch.Tensor) -> QuantizedWeight:
    """The candidate's ``prepare``: a frozen weight quantized once, kept between calls by the dispatcher."""
    return quantize_weight(weight)


def refresh(weight: torch.Tensor, quantized: QuantizedWeight, stale: torch.Tensor) -> None:
    """The candidate's ``refresh``: ``weight`` quantized again into ``quantized``'s own buffers where ``stale``
    (int32 ``[1]``, the dispatcher's check of the weight's contents) is set. On CUDA the flag is read and the write
    made on the device, without a sync, so a CUDA graph that captured them runs them at every replay. The buffers are
    written in place (as the GPU kernel writes them), not as a new version: a backward still pending reads the
    weight as it is now, as it would read a bf16 weight."""
    if weight.device.type == "cuda":
        from fusepatch.kernels.fp8 import requantize_rows

        requantize_rows(weight.detach(), quantized.q, quantized.inverse, stale)
        return
    if bool(stale.item()):
        fresh = quantize_weight(weight)
        quantized.q.data.copy_(fresh.q)
        quantized.inverse.data.copy_(fresh.inverse)


def restore(quantized: QuantizedWeight) -> torch.Tensor:
    """The candidate's ``restore``: the weight's values as the copy holds them (rounded to FP8), in fp32."""
    return quantized.q.float() * quantized.inverse


class _FP8Linear(torch.autograd.Function):
    """A trained weight: quantized afresh for every GEMM, along each GEMM's reduction dimension."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, carried) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.columns = None
        if carried is not None and ctx.needs_input_grad[1]:  # x's by-columns quantization, shared in the backward
            ctx.columns = carried.columns
            ctx.columns.users += 1
        return _project(x, *quantizers(x.device).rows(weight), bias, carried)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None, None
        x, weight = ctx.saved_tensors
        quantize = quantizers(grad.device)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = grad @ W: reduction over the outputs (W's columns)
            rows = fp8_rows.carried_gradient(grad)  # written by the backward that made grad (SwiGLU's), if any
            dx = fp8_mm(*(rows if rows is not None else quantize.rows(grad)), *quantize.columns(weight), x.dtype)
        if ctx.needs_input_grad[1]:  # dW = grad.t() @ x: reduction over the tokens (both operands' columns)
            g = quantize.columns(grad, MULTIPLE)
            if ctx.columns is None:
                x_t = quantize.columns(x, MULTIPLE)
            else:  # the same x (autograd refuses a saved tensor written since) for every projection sharing it
                x_t = ctx.columns.take(lambda: quantize.columns(x, MULTIPLE))
            dw = fp8_mm(*g, *x_t, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)
        return dx, dw, db, None


class _FP8FrozenLinear(torch.autograd.Function):
    """A frozen weight, already in FP8 (``quantize_weight``): no weight gradient. The input gradient reuses the
    forward's FP8 weight: ``dx = grad @ W = (grad * s) @ q`` for ``W = diag(s) q``, so the rowwise scales ``s``
    move into the gradient before it is quantized (exact: they are powers of two), and ``q`` is only transposed."""

    @staticmethod
    def forward(ctx, x, q, inverse, bias, carried):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, inverse)
        ctx.has_bias = bias is not None
        return _project(x, q, inverse, bias, carried)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None, None, None
        q, inverse = ctx.saved_tensors
        dx = _frozen_input_grad(grad, q, inverse) if ctx.needs_input_grad[0] else None
        db = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, None, None, db, None


class _FP8FrozenPerCall(torch.autograd.Function):
    """A frozen weight of which no copy is kept (an engine gathers it for each call and frees it after: DeepSpeed
    ZeRO-3, FSDP2 where its copy cannot stay sharded; ``torch.compile``; ``inference_mode``): quantized for the
    forward and again for the backward from the weight itself, which the engine gathers again for the backward (as
    it does for a bf16 GEMM's saved weight), so no FP8 copy lives from a forward to its backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, carried):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(weight)
        ctx.has_bias = bias is not None
        return _project(x, *quantize_weight(weight), bias, carried)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None, None
        (weight,) = ctx.saved_tensors
        dx = _frozen_input_grad(grad, *quantize_weight(weight)) if ctx.needs_input_grad[0] else None
        db = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db, None


def _frozen_input_grad(grad: torch.Tensor, q: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``dx = grad @ W`` for ``W = diag(s) q``: the rowwise scales ``s`` move into the gradient before it is quantized
    (exact: powers of two), and ``q`` is only transposed."""
    quantize = quantizers(grad.device)
    g, g_inverse = quantize.rows(grad, inverse)
    ones = inverse.new_ones((q.shape[1], 1))
    return fp8_mm(g, g_inverse, quantize.transpose(q), ones, grad.dtype)


def _aligned(weight: torch.Tensor) -> None:
    why = unaligned(tuple(weight.shape))
    if why is not None:
        raise ValueError(f"fp8_linear: {why}")


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prepared: QuantizedWeight | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs in FP8; output and input gradient in
    ``x``'s dtype, weight and bias gradients in theirs. ``weight``'s two dimensions must be multiples of 16.
    ``prepared``: the weight's ``prepare``, for a weight that takes no gradient, given by the dispatcher (which
    keeps it current); the weight itself is then not read (a dropped weight has no values). A frozen weight without
    it is quantized for the forward and again for the backward, no copy kept between them."""
    _aligned(weight)
    flat = x.reshape(-1, x.shape[-1])  # the functions see 2-D tensors: their outputs are no views of their own
    carried = _carried(x, flat)
    if prepared is not None:
        out = _FP8FrozenLinear.apply(flat, prepared.q, prepared.inverse, bias, carried)
    elif not weight.requires_grad:
        out = _FP8FrozenPerCall.apply(flat, weight, bias, carried)
    else:
        out = _FP8Linear.apply(flat, weight, bias, carried)
    return out.view(*x.shape[:-1], weight.shape[0])


def _carried(x: torch.Tensor, flat: torch.Tensor) -> fp8_rows.Carried | None:
    """``x``'s FP8 rows where they came with it (``kernels/fp8_rows``); where several projections of ``x`` share a
    frame (``projections.project``), quantized here once and recorded for the others; None otherwise (each
    function quantizes its input itself, as before)."""
    found = fp8_rows.carried(x)
    if found is not None or not fp8_rows.sharing():
        return found
    with torch.no_grad():
        rows = quantizers(x.device).rows(flat)
    return fp8_rows.record(x, rows)


def load():
    """The candidate's function (``torch._scaled_mm`` must exist: torch 2.5 or newer)."""
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    return fp8_linear
