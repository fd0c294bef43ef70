"""Scale a gradient in place by the loss's incoming gradient, skipping the pass when that is 1.

A fused linear cross-entropy computes its input and weight gradients during the forward pass; the backward
only multiplies them by the gradient reaching the loss, which is 1 in plain training (and 1/steps or a loss
scale otherwise). The value lives on the GPU, so the kernel reads it there and returns at once when it is 1:
no host sync, and no 2.5 GB read and write of Qwen3.5's lm_head gradient per step. fla does the same, but its
kernel takes the element count as a compile-time constant, so each new packed length compiles it again (in
packed SFT, about once a step); here the count is a runtime argument.

The grid is a few programs per SM, each striding over the blocks, rather than one program per 4096 elements
(310 k programs for the 27B shape's 1.27 G-element weight gradient). Measured on the H200 at that shape, where
the pass did run (the loss divided after the kernel, so its gradient was 1/count): 4.4 ms against 4.8 ms. fla's
"mean" now makes that gradient 1 where the Trainer passes no count (ops/linear_cross_entropy/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
WARPS = 8
PROGRAMS_PER_SM = 4
_SMS: dict[int, int] = {}


@triton.jit(do_not_specialize=["n", "blocks"])
def _scale_unless_one(x, g, n, blocks, BLOCK: tl.constexpr):
    factor = tl.load(g).to(tl.float32)
    if factor == 1.0:
        return
    block = tl.program_id(0)
    while block < blocks:  # program p scales blocks p, p + programs, ...
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(x + offsets, (values * factor).to(x.dtype.element_ty), mask=mask)
        block += tl.num_programs(0)


def _programs(device: torch.device, blocks: int) -> int:
    """At most PROGRAMS_PER_SM programs per SM (a CPU tensor, in the interpreter: one wave of 4)."""
    if device.type != "cuda":
        return min(blocks, PROGRAMS_PER_SM)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return min(blocks, _SMS[index] * PROGRAMS_PER_SM)


def scale_unless_one_(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``tensor *= factor`` in place (``factor``: a one-element tensor on the same device), nothing when it is 1."""
    if not tensor.is_contiguous():
        raise ValueError("scale_unless_one_: the tensor must be contiguous (it is scaled in place)")
    n = tensor.numel()
    if n:
        blocks = triton.cdiv(n, BLOCK)
        grid = (_programs(tensor.device, blocks),)
        _scale_unless_one[grid](tensor, factor.reshape(1), n, blocks, BLOCK=BLOCK, num_warps=WARPS)
    return tensor
