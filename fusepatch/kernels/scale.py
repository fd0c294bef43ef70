"""Scale a gradient in place by the loss's incoming gradient, skipping the pass when that is 1.

A fused linear cross-entropy computes its input and weight gradients during the forward pass; the backward
only multiplies them by the gradient reaching the loss, which is 1 in plain training (and 1/steps or a loss
scale otherwise). The value lives on the GPU, so the kernel reads it there and returns at once when it is 1:
no host sync, and no 2.5 GB read and write of Qwen3.5's lm_head gradient per step. fla does the same, but its
kernel takes the element count as a compile-time constant, so each new packed length compiles it again (the
SFT run built it once a step: benchmarks/RESULTS.md, session 7); here the count is a runtime argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
WARPS = 8


@triton.jit(do_not_specialize=["n"])
def _scale_unless_one(x, g, n, BLOCK: tl.constexpr):
    factor = tl.load(g).to(tl.float32)
    if factor == 1.0:
        return
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(x + offsets, (values * factor).to(x.dtype.element_ty), mask=mask)


def scale_unless_one_(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``tensor *= factor`` in place (``factor``: a one-element tensor on the same device), nothing when it is 1."""
    if not tensor.is_contiguous():
        raise ValueError("scale_unless_one_: the tensor must be contiguous (it is scaled in place)")
    n = tensor.numel()
    if n:
        _scale_unless_one[(triton.cdiv(n, BLOCK),)](tensor, factor.reshape(1), n, BLOCK=BLOCK, num_warps=WARPS)
    return tensor
