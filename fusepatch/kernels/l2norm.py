"""The q/k L2-norm backward of the Gated DeltaNet, with the sum over grouped value heads folded in.

With grouped value heads (Qwen3.5-27B: 16 key heads, 48 value heads) fla's backward kernels produce the q and k
gradients per value head, ``[B, T, Hv, K]``, and sum every group of ``Hv / Hk`` heads in torch before the L2-norm
backward reads them (``dq.view(B, T, Hk, G, K).sum(3)``, three such sums a layer, each a kernel that reads the
gradients once more). Here the sum happens in the L2-norm backward's registers: one kernel reads the per-value-head
gradients (and a second gradient to add, fla's WY-backward ``dk``), sums each group in fp32 and applies

    dx = rstd * (dy - (dy . y) y),    y = x * rstd,    rstd = 1 / sqrt(x . x + eps)

per row of ``K``. Row ``r`` of ``y`` (token ``t``, key head ``h``, ``r = t * Hk + h``) takes the gradient rows
``r * G + j``: value head ``h * G + j`` belongs to key head ``h``, fla's grouping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
WARPS = 4


@triton.jit(do_not_specialize=["rows"])
def _l2norm_bwd_grouped(
    y,
    rstd,
    grad,
    extra,
    dx,
    rows,
    D: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, BLOCK_D)
    inside = (r < rows)[:, None] & (c < D)[None, :]
    dy = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    for j in tl.static_range(GROUPS):
        offsets = (r * GROUPS + j)[:, None] * D + c[None, :]
        dy += tl.load(grad + offsets, mask=inside, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            dy += tl.load(extra + offsets, mask=inside, other=0.0).to(tl.float32)
    here = r[:, None] * D + c[None, :]
    yv = tl.load(y + here, mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(rstd + r, mask=r < rows, other=0.0).to(tl.float32)
    out = (dy - tl.sum(dy * yv, 1)[:, None] * yv) * scale[:, None]
    tl.store(dx + here, out.to(dx.dtype.element_ty), mask=inside)


def l2norm_bwd_grouped(
    y: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """The input gradient of ``y = l2norm(x)`` (``y: [..., Hk, K]``, ``rstd: [..., Hk]``) from gradients per
    value head (``grad``, ``extra``: ``[..., Hv, K]``, ``Hv`` a multiple of ``Hk``), summed over each group of
    ``Hv / Hk`` heads (and over the two). Contiguous inputs; the result in ``y``'s dtype."""
    heads, dim = y.shape[-2], y.shape[-1]
    groups = grad.shape[-2] // heads
    if grad.shape[-2] != groups * heads or grad.shape[-1] != dim or grad.shape[:-2] != y.shape[:-2]:
        raise ValueError(f"l2norm_bwd_grouped: gradient {tuple(grad.shape)} does not group onto {tuple(y.shape)}")
    if extra is not None and extra.shape != grad.shape:
        raise ValueError(f"l2norm_bwd_grouped: extra {tuple(extra.shape)} is not shaped as {tuple(grad.shape)}")
    y, rstd, grad = y.contiguous(), rstd.contiguous(), grad.contiguous()
    extra = extra.contiguous() if extra is not None else None
    dx = torch.empty_like(y)
    rows = y.numel() // dim
    if rows:
        _l2norm_bwd_grouped[(triton.cdiv(rows, BLOCK_ROWS),)](
            y, rstd, grad, grad if extra is None else extra, dx, rows,
            D=dim, GROUPS=groups, HAS_EXTRA=extra is not None,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(dim), num_warps=WARPS,
        )  # fmt: skip
    return dx
