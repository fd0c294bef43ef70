"""SwiGLU ``silu(gate) * up`` forward and backward as two elementwise Triton kernels with one fixed launch
configuration.

Why not fla's: fla's SwiGLU kernels autotune 30 configurations each, for every hidden width and dtype, so the
first step of a fresh process (and ``doctor``) spends minutes compiling them (measured on the H200). An
elementwise kernel is memory-bound; a fixed block of 2048 elements and 8 warps is within noise of the best
configuration, and compiles once per dtype. Math in fp32, results in the input dtype, as eager does.

Where a frame asks for them (``kernels/fp8_rows.emitting``: the down projection is FP8), the forward also writes
the FP8 rows of its rounded output (``kernels/fp8.quantize_rows``' bits) for that projection, one program a row:
the product written and its row's peak taken in one pass, then read back (from the cache, by the same program)
scaled and written in FP8, instead of a second kernel reading the whole product again. Where it asks for the
gradients' (``emitting_gradients``: gate_proj and up_proj are FP8 and trained), the backward does the same for
both input gradients, which those projections' input-gradient GEMMs read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels import fp8_rows
from fusepatch.kernels.fp8 import FP8_MAX, FP8_TINY, clamped, row_scale

BLOCK = 2048
WARPS = 8


@triton.jit
def swiglu_grads(g, u, dy):
    """``(d/dgate, d/dup)`` of ``silu(g) * u`` under the upstream gradient ``dy``, all fp32; shared with the MoE
    experts' weighted kernel (``kernels/moe_swiglu.py``), which passes ``dy`` already scaled by the routing weight.
    """
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * silu


@triton.jit
def _swiglu_fwd(gate, up, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = g * tl.sigmoid(g)
    tl.store(out + offsets, (silu * u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd_rows(
    gate,
    up,
    out,
    q,
    inverse,
    columns,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
):
    """``_swiglu_fwd`` over one row a program, with the row's FP8 quantization (``_quantize_rows``' math)."""
    row = tl.program_id(0).to(tl.int64)
    start = row * columns
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    nan = tl.zeros((BLOCK,), dtype=tl.int32)
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < columns
        g = tl.load(gate + start + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up + start + cols, mask=mask, other=0.0).to(tl.float32)
        rounded = (g * tl.sigmoid(g) * u).to(out.dtype.element_ty)
        tl.store(out + start + cols, rounded, mask=mask)
        values = rounded.to(tl.float32)
        amax = tl.maximum(amax, tl.abs(values))
        nan = nan | (values != values).to(tl.int32)
    scale = row_scale(amax, nan, FP8_MAX, TINY)
    tl.debug_barrier()  # the product this program stored, read back below by other threads of it
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < columns
        values = tl.load(out + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q + start + cols, clamped(values * scale, FP8_MAX).to(q.dtype.element_ty), mask=mask)
    tl.store(inverse + row, 1.0 / scale)


@triton.jit
def _swiglu_bwd(gate, up, grad_out, grad_gate, grad_up, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(grad_out + offsets, mask=mask, other=0.0).to(tl.float32)
    dg, du = swiglu_grads(g, u, dy)
    tl.store(grad_gate + offsets, dg.to(grad_gate.dtype.element_ty), mask=mask)
    tl.store(grad_up + offsets, du.to(grad_up.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_rows(
    gate,
    up,
    grad_out,
    grad_gate,
    grad_up,
    q_gate,
    inverse_gate,
    q_up,
    inverse_up,
    columns,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
):
    """``_swiglu_bwd`` over one row a program, with both gradients' FP8 rows (for gate_proj's and up_proj's input
    gradients): written and their peaks taken in one pass, read back scaled in the second."""
    row = tl.program_id(0).to(tl.int64)
    start = row * columns
    amax_g = tl.zeros((BLOCK,), dtype=tl.float32)
    amax_u = tl.zeros((BLOCK,), dtype=tl.float32)
    nan_g = tl.zeros((BLOCK,), dtype=tl.int32)
    nan_u = tl.zeros((BLOCK,), dtype=tl.int32)
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < columns
        g = tl.load(gate + start + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_out + start + cols, mask=mask, other=0.0).to(tl.float32)
        dg, du = swiglu_grads(g, u, dy)
        dg = dg.to(grad_gate.dtype.element_ty)
        du = du.to(grad_up.dtype.element_ty)
        tl.store(grad_gate + start + cols, dg, mask=mask)
        tl.store(grad_up + start + cols, du, mask=mask)
        dg, du = dg.to(tl.float32), du.to(tl.float32)
        amax_g = tl.maximum(amax_g, tl.abs(dg))
        amax_u = tl.maximum(amax_u, tl.abs(du))
        nan_g = nan_g | (dg != dg).to(tl.int32)
        nan_u = nan_u | (du != du).to(tl.int32)
    scale_g = row_scale(amax_g, nan_g, FP8_MAX, TINY)
    scale_u = row_scale(amax_u, nan_u, FP8_MAX, TINY)
    tl.debug_barrier()  # the gradients this program stored, read back below by other threads of it
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < columns
        dg = tl.load(grad_gate + start + cols, mask=mask, other=0.0).to(tl.float32)
        du = tl.load(grad_up + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_gate + start + cols, clamped(dg * scale_g, FP8_MAX).to(q_gate.dtype.element_ty), mask=mask)
        tl.store(q_up + start + cols, clamped(du * scale_u, FP8_MAX).to(q_up.dtype.element_ty), mask=mask)
    tl.store(inverse_gate + row, 1.0 / scale_g)
    tl.store(inverse_up + row, 1.0 / scale_u)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, fp8=None) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
            )
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if fp8 is not None and n:
            rows, columns = fp8.q.shape
            _swiglu_fwd_rows[(rows,)](
                gate, up, out, *fp8, columns, BLOCK=BLOCK, FP8_MAX=FP8_MAX, TINY=FP8_TINY, num_warps=WARPS
            )
        elif n:
            _swiglu_fwd[_grid(n)](gate, up, out, n, BLOCK=BLOCK, num_warps=WARPS)
        ctx.save_for_backward(gate, up)  # two saved tensors where eager keeps three (gate, silu(gate), up)
        ctx.fp8_gradients = fp8_rows.emitting_gradients() and _fits(gate)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if ctx.fp8_gradients and n:  # FP8 rows of both gradients, for the FP8 projections that made gate and up
            rows_gate, rows_up = _fp8_buffers(gate), _fp8_buffers(gate)
            _swiglu_bwd_rows[(rows_gate.q.shape[0],)](
                gate,
                up,
                grad_out,
                grad_gate,
                grad_up,
                *rows_gate,
                *rows_up,
                gate.shape[-1],
                BLOCK=BLOCK,
                FP8_MAX=FP8_MAX,
                TINY=FP8_TINY,
                num_warps=WARPS,
            )
            fp8_rows.record_gradient(grad_gate, rows_gate)
            fp8_rows.record_gradient(grad_up, rows_up)
        elif n:
            _swiglu_bwd[_grid(n)](gate, up, grad_out, grad_gate, grad_up, n, BLOCK=BLOCK, num_warps=WARPS)
        return grad_gate, grad_up, None


@torch.compiler.disable  # a graph break under torch.compile, like fla's ops: dynamo never traces the launch
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with a fused backward; any shape, gate and up alike. Inside a frame that asks for them
    (``kernels/fp8_rows``), with the FP8 rows of the result for the projection it feeds."""
    rows = _fp8_buffers(gate, fp8_rows.emitting())
    out = _SwiGLU.apply(gate, up, rows)
    if rows is not None:
        fp8_rows.record(out, rows)
    return out


def _fp8_buffers(gate: torch.Tensor, wanted: bool = True) -> fp8_rows.Rows | None:
    """FP8 rows' buffers of a tensor of ``gate``'s shape where ``wanted`` (a frame asks for them) and an FP8
    projection could read them; None otherwise."""
    return fp8_rows.buffers(gate) if wanted and _fits(gate) else None


def _fits(gate: torch.Tensor) -> bool:
    return gate.dim() > 0 and fp8_rows.fits(gate.dtype, gate.shape[-1])
