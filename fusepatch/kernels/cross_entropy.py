"""Cross-entropy over one chunk's logits, loss and logits gradient in one kernel, the gradient written in place.

The fused linear cross-entropy (ops/linear_cross_entropy.py) makes a chunk's logits with one GEMM and needs,
per token, the loss and ``(softmax - onehot) / denominator`` in place of the logits for the two gradient GEMMs.
fla's kernels take three launches (a forward that loads 64k logits at once per program, a reduction over a
row's blocks, the backward): on the H200 at the 27B shape (4096 x 248,320 bf16 logits, 2 GB) the forward took
1.05 ms (1.9 TB/s) and the backward 0.83 ms (session 10's profile). Here one program per token streams its row twice: an online
log-sum-exp (a running maximum and sum, block by block), then the gradient, stored over the logits. Rows
of ignored labels get loss 0 and a zero gradient.

The denominator arrives as its reciprocal in a one-element tensor on the GPU (no host sync). The kernel is
compiled per vocabulary size (a model has one); the token count is the grid, so a new length compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
WARPS = 8


@triton.jit(do_not_specialize=["stride"])
def _cross_entropy(
    logits, target, inverse, loss, stride, ignore_index, VOCAB: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    start = logits + row * stride
    lanes = tl.arange(0, BLOCK)
    # pass 1: the running maximum and the sum of exp(x - maximum), one block at a time (one exp per logit)
    top = float("-inf")
    total = 0.0
    for first in range(0, VOCAB, BLOCK):
        columns = first + lanes
        x = tl.load(start + columns, mask=columns < VOCAB, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, 0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
        top = new_top
    lse = top + tl.log(total)

    label = tl.load(target + row).to(tl.int64)
    valid = label != ignore_index
    picked = tl.load(start + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss + row, tl.where(valid, lse - picked, 0.0))
    if GRAD:
        # pass 2: (softmax - onehot) / denominator over the logits, in their dtype; zeros for an ignored label
        scale = tl.where(valid, tl.load(inverse).to(tl.float32), 0.0)
        for first in range(0, VOCAB, BLOCK):
            columns = first + lanes
            inside = columns < VOCAB
            x = tl.load(start + columns, mask=inside, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(columns == label, 1.0, 0.0)
            tl.store(start + columns, (grad * scale).to(logits.dtype.element_ty), mask=inside)


def cross_entropy_(
    logits: torch.Tensor, target: torch.Tensor, inverse: torch.Tensor, ignore_index: int, grad: bool
) -> torch.Tensor:
    """Per-token loss (fp32; 0 where ``target == ignore_index``) of ``logits [N, V]`` (rows contiguous);
    with ``grad``, ``logits`` is overwritten by ``(softmax - onehot) * inverse`` (``inverse``: a one-element
    tensor, 1 / the loss's denominator), zeros in ignored rows."""
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_: the logits' rows must be contiguous (the gradient is written over them)")
    rows, vocab = logits.shape
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        _cross_entropy[(rows,)](
            logits,
            target,
            inverse.reshape(1),
            loss,
            logits.stride(0),
            ignore_index,
            VOCAB=vocab,
            GRAD=grad,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    return loss
