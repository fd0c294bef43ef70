"""The gated attention's output gate, ``attn * sigmoid(gate)``, forward and backward as one Triton kernel each.

Qwen3.5 and Qwen3-Next full attention project the query and a per-head gate together (``q_proj`` gives
``[.., heads, 2 x head_dim]``, query half then gate half per head). transformers copies the gate half out
(``gate.reshape``: a strided copy), then runs ``sigmoid`` and a multiply, and in the backward two multiplies and
the sigmoid's backward: five elementwise passes over ``tokens x heads x head_dim`` plus the copy. Here the
forward reads the attention output and the gate half where they lie (the gate's rows keep their stride) and
writes the gated output; the backward writes both gradients in one pass. Math in fp32, results in the input
dtype, rounded once (eager rounds ``sigmoid(gate)`` to the dtype before the multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels.rows import as_rows

ELEMENTS = 4096  # per program: rows x head_dim (a memory-bound pass; one fixed launch configuration)
WARPS = 4


@triton.jit
def _gate_fwd(attn, gate, out, rows, gate_stride, DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_D)[None, :]
    mask = (row < rows) & (col < DIM)
    a = tl.load(attn + row * DIM + col, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate + row * gate_stride + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * DIM + col, (a * tl.sigmoid(g)).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd(
    attn, gate, grad_out, grad_attn, grad_gate, rows, gate_stride,
    DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_D)[None, :]
    mask = (row < rows) & (col < DIM)
    at = row * DIM + col
    a = tl.load(attn + at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate + row * gate_stride + col, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(grad_out + at, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(grad_attn + at, (dy * s).to(grad_attn.dtype.element_ty), mask=mask)
    tl.store(grad_gate + at, (dy * a * s * (1.0 - s)).to(grad_gate.dtype.element_ty), mask=mask)


def _launch(rows: int, dim: int) -> tuple[tuple[int], int, int]:
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, ELEMENTS // block_d)
    return (triton.cdiv(rows, block_r),), block_r, block_d


class _SigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dim = gate.shape[-1]
        if attn.numel() != gate.numel() or attn.shape[-1] % dim or attn.dtype != gate.dtype:
            raise ValueError(
                f"sigmoid_gate: attention {tuple(attn.shape)} {attn.dtype} and gate {tuple(gate.shape)} {gate.dtype} "
                "do not pair (same dtype; attention [.., heads x head_dim], gate [.., heads, head_dim])"
            )
        attn = attn.contiguous()
        rows_gate = as_rows(gate, dim)
        out = torch.empty_like(attn)
        rows = rows_gate.shape[0]
        if rows:
            grid, block_r, block_d = _launch(rows, dim)
            _gate_fwd[grid](
                attn, rows_gate, out, rows, rows_gate.stride(0),
                DIM=dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=WARPS,
            )  # fmt: skip
        ctx.save_for_backward(attn, rows_gate)  # the gate as a view: no copy kept
        ctx.gate_shape = gate.shape
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        attn, rows_gate = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_attn = torch.empty_like(attn)
        grad_gate = torch.empty(rows_gate.shape, device=attn.device, dtype=rows_gate.dtype)
        rows, dim = rows_gate.shape
        if rows:
            grid, block_r, block_d = _launch(rows, dim)
            _gate_bwd[grid](
                attn, rows_gate, grad_out, grad_attn, grad_gate, rows, rows_gate.stride(0),
                DIM=dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=WARPS,
            )  # fmt: skip
        return grad_attn, grad_gate.view(ctx.gate_shape)


@torch.compiler.disable  # a graph break under torch.compile, like the other kernels: dynamo never traces the launch
def sigmoid_gate(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``attn * sigmoid(gate)`` with a fused backward. ``attn``: ``[.., heads x head_dim]``; ``gate``:
    ``[.., heads, head_dim]``, read in place when its rows are evenly strided (the gate half of ``q_proj``)."""
    return _SigmoidGate.apply(attn, gate)
