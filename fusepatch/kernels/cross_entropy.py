"""Cross-entropy over one chunk's logits: the per-token loss, then the logits gradient written in place.

The fused linear cross-entropy (ops/linear_cross_entropy/) makes a chunk's logits with one GEMM and needs,
per token, the loss and ``(softmax - onehot) / denominator`` in place of the logits for the two gradient GEMMs.
Two kernels: ``_loss``, one program per token streaming its row once (an online log-sum-exp), and
``_gradient``, one program per block of a row. Rows of ignored labels get loss 0 and a zero gradient.

Why two kernels: fla's forward has a program load 64k logits at once and then runs a reduction kernel, where
``_loss`` streams each row once; the gradient's in-place read and write of the logits is the floor of the pair,
and the launch settings below were the fastest tried for it (larger blocks with more warps were slower). Computing
the gradient in the loss kernel's program, streaming the row a second time, was slower still: its loop of loads
and stores to the same addresses ran at a fraction of the bandwidth.

The denominator arrives as its reciprocal in a one-element tensor on the GPU (no host sync). The kernels are
compiled per vocabulary size (a model has one); the token count is the grid, so a new length compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, WARPS = 4096, 4  # the loss kernel: one program per row (0.605 ms at the 27B shape; 8 warps 0.658-0.661)
GRAD_BLOCK, GRAD_WARPS = 8192, 16  # the gradient kernel: one block of one row per program (see above)


@triton.jit(do_not_specialize=["stride"])
def _loss(logits, target, loss, lse_out, stride, ignore_index, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: the log-sum-exp of its row (a running maximum and sum, one exp per logit) and its
    loss, 0 for an ignored label."""
    row = tl.program_id(0).to(tl.int64)
    start = logits + row * stride
    lanes = tl.arange(0, BLOCK)
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
    tl.store(lse_out + row, lse)


@triton.jit(do_not_specialize=["stride"])
def _gradient(logits, target, lse, inverse, stride, ignore_index, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """One program per block of one token's row: ``(softmax - onehot) * inverse`` over the logits, in their
    dtype; zeros for an ignored label."""
    row = tl.program_id(1).to(tl.int64)
    columns = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < VOCAB
    label = tl.load(target + row).to(tl.int64)
    scale = tl.where(label != ignore_index, tl.load(inverse).to(tl.float32), 0.0)
    pointers = logits + row * stride + columns
    x = tl.load(pointers, mask=inside, other=0.0).to(tl.float32)
    grad = tl.exp(x - tl.load(lse + row)) - tl.where(columns == label, 1.0, 0.0)
    tl.store(pointers, (grad * scale).to(logits.dtype.element_ty), mask=inside)


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
    if not rows:
        return loss
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    stride = logits.stride(0)
    _loss[(rows,)](logits, target, loss, lse, stride, ignore_index, VOCAB=vocab, BLOCK=BLOCK, num_warps=WARPS)
    if grad:
        grid = (triton.cdiv(vocab, GRAD_BLOCK), rows)
        _gradient[grid](
            logits, target, lse, inverse.reshape(1), stride, ignore_index,
            VOCAB=vocab, BLOCK=GRAD_BLOCK, num_warps=GRAD_WARPS,
        )  # fmt: skip
    return loss
