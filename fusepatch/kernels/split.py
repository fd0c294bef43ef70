"""Split the last dimension of a ``[rows, a + b + c]`` tensor into three contiguous tensors in one kernel.

The Gated DeltaNet's q, k and v come out of the causal conv as column blocks of one ``[tokens, 2 key + value]``
tensor; the delta-rule kernels need each contiguous. torch's ``split_with_sizes_copy`` does it in one kernel,
but (torch 2.11) its host-to-device copy of the launch metadata waits for the GPU once per layer
(``cudaMemcpyAsync`` under ``split_with_sizes_copy``), and the GPU then idles while the CPU catches up. Here the
sizes are kernel arguments:
nothing to copy, nothing to wait for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 8
BLOCK_COLS = 256
WARPS = 4


@triton.jit(do_not_specialize=["rows", "stride"])
def _split3(
    src, a, b, c, rows, stride, WA: tl.constexpr, WB: tl.constexpr, WC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok = (r < rows)[:, None]
    values = tl.load(src + r[:, None] * stride + col[None, :], mask=row_ok & (col < WA + WB + WC)[None, :])
    tl.store(a + r[:, None] * WA + col[None, :], values, mask=row_ok & (col < WA)[None, :])
    in_b = (col >= WA) & (col < WA + WB)
    tl.store(b + r[:, None] * WB + (col - WA)[None, :], values, mask=row_ok & in_b[None, :])
    in_c = (col >= WA + WB) & (col < WA + WB + WC)
    tl.store(c + r[:, None] * WC + (col - WA - WB)[None, :], values, mask=row_ok & in_c[None, :])


def split3(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.split(x, sizes, dim=-1)`` as three contiguous tensors (``x``'s last dimension contiguous; its rows
    any stride apart when they flatten to one)."""
    if len(sizes) != 3 or sum(sizes) != x.shape[-1]:
        raise ValueError(f"split3: expected three sizes summing to {x.shape[-1]}, got {list(sizes)}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[-1] and flat.stride(-1) != 1:
        flat = flat.contiguous()
    parts = tuple(x.new_empty(*lead, size) for size in sizes)
    rows = flat.shape[0]
    if rows and flat.shape[-1]:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(flat.shape[-1], BLOCK_COLS))
        _split3[grid](flat, *parts, rows, flat.stride(0), *sizes, BR=BLOCK_ROWS, BC=BLOCK_COLS, num_warps=WARPS)
    return parts
