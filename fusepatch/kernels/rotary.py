"""Rotary position embedding of q and k, forward and backward, one Triton kernel launch per tensor.

transformers applies it as ``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` channels of each
head (all of them for Qwen2/Qwen3, a quarter for Qwen3.5's partial rotary), passing the rest through: about six
elementwise passes over q and k, each way. Here one program handles one (batch, head, token) row: it reads the
row and that token's cos/sin once and writes the rotated row. cos/sin come per token, as the model computed them
(mrope text positions, packed rows restarting at 0: whatever ``position_ids`` said), so nothing about positions
is assumed. Math in fp32, results in the input dtype. One fixed launch configuration: no autotuning.

Layouts: q/k ``[batch, heads, tokens, head_dim]`` with any strides but a contiguous last dimension (the
attention's ``view(...).transpose(1, 2)``); cos/sin ``[batch or 1, tokens, rotary_dim]``. Outputs are contiguous,
as eager's ``torch.cat`` makes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels.rotary_check import unsupported

WARPS = 4


@triton.jit
def _rotary_rows(
    x,
    cos,
    sin,
    out,
    heads,
    tokens,
    sx_b,
    sx_h,
    sx_t,
    sc_b,
    sc_t,
    HALF: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = row % tokens
    h = (row // tokens) % heads
    b = row // (tokens * heads)
    src = x + b * sx_b + h * sx_h + t * sx_t
    dst = out + row * DIM  # contiguous [batch, heads, tokens, DIM]
    angle = b * sc_b + t * sc_t
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos + angle + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos + angle + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin + angle + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin + angle + HALF + i, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(dst + i, y1.to(out.dtype.element_ty), mask=m)
    tl.store(dst + HALF + i, y2.to(out.dtype.element_ty), mask=m)
    if BLOCK_PASS > 0:  # channels past the rotary ones pass through (partial rotary)
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)
        mp = j < DIM
        tl.store(dst + j, tl.load(src + j, mask=mp, other=0.0), mask=mp)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, heads, tokens, dim = x.shape
    out = torch.empty((batch, heads, tokens, dim), device=x.device, dtype=x.dtype)
    rows = batch * heads * tokens
    if rows == 0:
        return out
    half = cos.shape[-1] // 2
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    _rotary_rows[(rows,)](
        x,
        cos,
        sin,
        out,
        heads,
        tokens,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        sc_b,
        cos.stride(1),
        HALF=half,
        DIM=dim,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(dim - 2 * half) if dim > 2 * half else 0,
        BACKWARD=backward,
        num_warps=WARPS,
    )
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _apply(q, cos, sin, False), _apply(k, cos, sin, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq = None if grad_q is None else _apply(grad_q, cos, sin, True)
        dk = None if grad_k is None else _apply(grad_k, cos, sin, True)
        return dq, dk, None, None


@torch.compiler.disable  # a graph break under torch.compile, like fla's ops: dynamo never traces the launch
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``), partial rotary included."""
    problem = unsupported(q, k, cos, sin)
    if problem is not None:
        raise ValueError(f"rotary kernel: {problem}")
    return _Rotary.apply(q, k, cos, sin)
