"""Repeat each head of a ``[..., H, D]`` tensor ``G`` times, ``[..., H * G, D]``, in one bandwidth-bound kernel.

``x.repeat_interleave(G, dim=-2)`` gives the same values, but torch copies from the broadcast (stride-0) view with
its generic strided kernel, far below the bandwidth a plain copy reaches. Here each program loads a tile of
rows once and stores it ``G`` times, with no index tensor and no host work. Out row ``h * G + j`` is in row
``h``, the interleaved order of ``repeat_interleave`` (and of fla's and transformers' grouped heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # values a program loads (rows x D)
WARPS = 4


@triton.jit(do_not_specialize=["rows"])
def _repeat_heads(x, out, rows, D: tl.constexpr, G: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, BLOCK_D)
    inside = (r < rows)[:, None] & (c < D)[None, :]
    values = tl.load(x + r[:, None] * D + c[None, :], mask=inside)
    for j in tl.static_range(G):
        tl.store(out + (r * G + j)[:, None] * D + c[None, :], values, mask=inside)


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``x.repeat_interleave(groups, dim=-2)`` as a new contiguous tensor, by a Triton kernel (no autograd: for
    backward passes that hand the copy to kernels)."""
    if groups < 1:
        raise ValueError(f"repeat_heads: groups must be >= 1, got {groups}")
    if x.dim() < 2:
        raise ValueError(f"repeat_heads: expected [..., heads, dim], got shape {tuple(x.shape)}")
    x = x.contiguous()
    heads, dim = x.shape[-2], x.shape[-1]
    out = x.new_empty(*x.shape[:-2], heads * groups, dim)
    rows = x.numel() // dim if dim else 0
    if rows:
        block_d = triton.next_power_of_2(dim)
        block_rows = max(1, TILE // block_d)
        _repeat_heads[(triton.cdiv(rows, block_rows),)](
            x, out, rows, D=dim, G=groups, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=WARPS
        )
    return out
