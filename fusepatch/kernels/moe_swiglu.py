"""The MoE experts' activation with the routing weight: ``silu(gate) * up * weight`` for every slot's row of the
gate/up grouped GEMM's output (``[slots, 2 x inter]``, gate half first, as transformers concatenates them), forward
and backward each one Triton kernel.

Why: eager, the activation reads the two halves as strided views (non-vectorised kernels), the backward's
``chunk`` joins the halves' gradients with a copy, and the routing weight scaled the down projection's output
(``[slots, hidden]``, four times the activation's width at Qwen3.5-MoE's sizes) forward and backward, each an
elementwise kernel of its own. The weight
scales the activation instead (the down projection is linear in it); the backward writes the gate/up gradient as
one contiguous ``[slots, 2 x inter]`` tensor, the grouped GEMM's own layout, and the weight's gradient as each
row's sum, in one program per rows (no atomics: the same bits every run). Math in fp32, results in the input
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels.swiglu import swiglu_grads

TILE = 4096  # elements of a row block per loop step: rows x columns
WARPS = 4


@triton.jit
def _rows(weight, rows, BLOCK_R: tl.constexpr):
    """This program's block of rows: their indices (int64 for the offsets), which exist, their routing weights."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    return r, r.to(tl.int64), live, tl.load(weight + r, mask=live, other=0.0).to(tl.float32)


@triton.jit
def _halves(gate_up, r64, live, start, inter, BLOCK_I: tl.constexpr):
    """One column block of the rows' gate and up halves (fp32), where they lie in the ``[rows, 2 x inter]`` GEMM
    output, with the block's columns, mask and gate offsets."""
    c = start + tl.arange(0, BLOCK_I)
    mask = live[:, None] & (c < inter)[None, :]
    at = r64[:, None] * (2 * inter) + c[None, :]
    g = tl.load(gate_up + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + at + inter, mask=mask, other=0.0).to(tl.float32)
    return g, u, c, mask, at


@triton.jit
def _weighted_swiglu_fwd(gate_up, weight, out, rows, inter, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    r, r64, live, w = _rows(weight, rows, BLOCK_R)
    for start in range(0, inter, BLOCK_I):
        g, u, c, mask, at = _halves(gate_up, r64, live, start, inter, BLOCK_I)
        y = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(out + r64[:, None] * inter + c[None, :], y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_swiglu_bwd(
    gate_up, weight, grad_out, grad_gate_up, grad_weight, rows, inter, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr
):
    r, r64, live, w = _rows(weight, rows, BLOCK_R)
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, inter, BLOCK_I):
        g, u, c, mask, at = _halves(gate_up, r64, live, start, inter, BLOCK_I)
        dy = tl.load(grad_out + r64[:, None] * inter + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dg, du = swiglu_grads(g, u, dy * w[:, None])
        # the weight's gradient is the row's sum of dy * silu(g) * u (not du * u / w: a weight may be zero), in
        # a fixed order (the same bits every run); the compiler shares the sigmoid with swiglu_grads'
        dw += tl.sum(dy * (g * tl.sigmoid(g)) * u, axis=1)
        tl.store(grad_gate_up + at, dg.to(grad_gate_up.dtype.element_ty), mask=mask)
        tl.store(grad_gate_up + at + inter, du.to(grad_gate_up.dtype.element_ty), mask=mask)
    tl.store(grad_weight + r, dw, mask=live)


def _blocks(inter: int) -> tuple[int, int]:
    block_i = min(triton.next_power_of_2(max(inter, 1)), TILE)
    return TILE // block_i, block_i


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        if width % 2 or weight.shape != (rows,):
            raise ValueError(
                f"weighted_swiglu: gate_up {tuple(gate_up.shape)} must be [rows, 2 x inter] and weight "
                f"{tuple(weight.shape)} [rows]"
            )
        gate_up, weight = gate_up.contiguous(), weight.contiguous()
        inter = width // 2
        out = gate_up.new_empty(rows, inter)
        block_r, block_i = _blocks(inter)
        if out.numel():
            grid = (triton.cdiv(rows, block_r),)
            _weighted_swiglu_fwd[grid](
                gate_up, weight, out, rows, inter, BLOCK_R=block_r, BLOCK_I=block_i, num_warps=WARPS
            )
        ctx.save_for_backward(gate_up, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, weight = ctx.saved_tensors
        rows, width = gate_up.shape
        inter = width // 2
        grad_out = grad_out.contiguous()
        grad_gate_up = torch.empty_like(gate_up)
        grad_weight = torch.zeros(rows, device=weight.device, dtype=torch.float32)
        block_r, block_i = _blocks(inter)
        if grad_gate_up.numel():
            grid = (triton.cdiv(rows, block_r),)
            _weighted_swiglu_bwd[grid](
                gate_up, weight, grad_out, grad_gate_up, grad_weight, rows, inter,
                BLOCK_R=block_r, BLOCK_I=block_i, num_warps=WARPS,
            )  # fmt: skip
        return grad_gate_up, grad_weight.to(weight.dtype)


@torch.compiler.disable  # a graph break under torch.compile, like the other kernels: dynamo never traces the launch
def weighted_swiglu(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * weight[:, None]`` with ``gate, up = gate_up.chunk(2, -1)``; ``[rows, inter]`` out."""
    return _WeightedSwiGLU.apply(gate_up, weight)
