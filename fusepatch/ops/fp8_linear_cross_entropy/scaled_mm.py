"""The fused loss's three GEMMs in FP8 (``Gemms`` of ``ops/linear_cross_entropy``), each operand quantized to
float8_e4m3fn along that GEMM's reduction dimension with one power-of-two scale per row, as ``fp8_linear`` quantizes
a projection's: the logits from the hidden states by tokens and the weight by vocabulary rows; the hidden-state
gradient from the logits' gradient by tokens and the weight by hidden features; the weight gradient from both by
vocabulary rows and hidden features, along the chunk's tokens (padded with zeros to a multiple of 16).

The weight's two copies (by rows and by columns, each half of its bf16 bytes) are made once per loss call and freed
at its end; the hidden states' rows once per call too, the rest per chunk. Measured on an H100 at Qwen3.5-27B's head
(248,320 x 5120, two chunks of 2,048 tokens), the loss's peak was 5.24 GiB above the bf16 loss's while a later
chunk's weight gradient was a whole second buffer; it is now added in blocks. Both of the weight's dimensions must be
multiples of 16 (``aligned``): the vocabulary is the hidden-state gradient's reduction dimension.
"""

from __future__ import annotations

import torch

from fusepatch.kernels.fp8_range import MULTIPLE, unaligned
from fusepatch.ops.fp8_linear.scaled_mm import fp8_mm, quantizers
from fusepatch.ops.linear_cross_entropy import LOOP_SKIP, LossCall

VOCAB_BLOCK = 16384  # rows of a later chunk's weight gradient made at a time: 160 MiB at hidden 5120 in bf16


class FP8Gemms:
    """``Gemms`` on ``torch._scaled_mm`` (fast accumulation, as every FP8 GEMM of ``fp8_linear``).

    The logits' gradient comes undivided by the loss's denominator (``SCALES_GRADIENT``): ``(softmax - onehot)``,
    whose largest value in a token's row is its target's, about -1 for every token. Divided first, that value is
    about ``-1 / denominator`` in every row, rounded to FP8 the same way in all of them (FP8's 3-bit mantissa: up to
    6% off): the whole gradient would come out scaled by a factor set by the number of labels. The denominator's
    inverse multiplies the rowwise inverse scales instead (exact in fp32); where nothing is labelled (an infinite
    inverse) the gradient is zeros and stays zeros.

    The hidden-state gradient's GEMM leaves each token's target entry out. Scaled to it (``p - 1``, about -1 while
    the target is unlikely), a token's row keeps nothing below about 4e-6 of it (e4m3's smallest step under its
    largest value), and an untrained head at Qwen3.5's vocabulary predicts about 4e-6 for every token: a sixth of
    the probabilities' mass was lost, biasing the gradient along any direction the head's rows share. The rows are
    quantized with their target entries at zero, and each target's weight row, times its entry, added after the
    GEMM in fp32 (exact: a confident target's ``p - 1`` is small, so its row in FP8 would weigh its 3% error by
    ``p / (1 - p)`` against it if ``p`` and ``-1`` were applied apart). The weight gradient's GEMM scales by
    vocabulary rows along the tokens, where a target's entry outweighs what it hides."""

    SCALES_GRADIENT = True
    # this loss's loop as well as the model's own precision's, which the head runs where this op has no kernel
    skip = f"{LOOP_SKIP},fp8_linear_cross_entropy/scaled-mm"

    def __init__(self, call: LossCall) -> None:
        weight = call.weight
        why = unaligned(tuple(weight.shape))
        if why is not None:
            raise ValueError(f"fp8_linear_cross_entropy: lm_head {why}")
        self.quantize = quantizers(call.hidden.device)
        self.hidden, self.weight, self.dtype = call.hidden, weight, call.hidden.dtype
        self.labels, self.ignore_index = call.labels, call.ignore_index
        self.inverse = torch.nan_to_num(call.inverse.float(), posinf=0.0)
        self.hidden_rows = self.quantize.rows(call.hidden)
        self.weight_rows = self.quantize.rows(weight)
        self.weight_columns = self.quantize.columns(weight) if call.wants_hidden else None

    def logits(self, start: int, end: int) -> torch.Tensor:
        q, inverse = self.hidden_rows
        return fp8_mm(q[start:end], inverse[start:end], *self.weight_rows, self.dtype)

    def grad_hidden(self, grad: torch.Tensor, start: int, end: int, out: torch.Tensor) -> None:
        """The rows through FP8 without their targets' entries, each target's weight row times its entry added in
        fp32 (see the class). An ignored row is zeros: its entry at column 0 adds nothing (its label, any
        ``ignore_index``, is read as 0, as the cross-entropy kernel reads it)."""
        labels = self.labels[start:end]
        row = torch.arange(labels.shape[0], device=labels.device)
        column = labels.masked_fill(labels == self.ignore_index, 0)
        target = grad[row, column]
        grad[row, column] = 0
        q, inverse = self.quantize.rows(grad)
        grad[row, column] = target  # the weight gradient's GEMM reads the whole gradient
        found = self.weight[column].float().mul_((target.float() * self.inverse)[:, None])
        out.copy_(found.add_(fp8_mm(q, inverse * self.inverse, *self.weight_columns, self.dtype)))

    def grad_weight(self, grad: torch.Tensor, start: int, end: int, total: torch.Tensor | None) -> torch.Tensor:
        """The first chunk's GEMM writes the weight gradient; a later chunk's is added a block of vocabulary rows at
        a time (``fp8_mm`` cannot add into its output), so no second weight-sized buffer lives beside it. In fp16
        the first chunk's is written in blocks too: ``_scaled_mm`` writes bf16, a whole copy cast after."""
        g, g_inverse = self.quantize.columns(grad, MULTIPLE)
        g_inverse = g_inverse * self.inverse
        h = self.quantize.columns(self.hidden[start:end], MULTIPLE)
        if total is None and self.dtype == torch.bfloat16:
            return fp8_mm(g, g_inverse, *h, self.dtype)
        written = total is None
        if written:
            total = g.new_empty((g.shape[0], h[0].shape[0]), dtype=self.dtype)
        for first in range(0, g.shape[0], VOCAB_BLOCK):
            rows = slice(first, first + VOCAB_BLOCK)
            block = fp8_mm(g[rows], g_inverse[rows], *h, torch.bfloat16)  # cast by the copy or the add
            if written:
                total[rows].copy_(block)
            else:
                total[rows].add_(block)
        return total


def load():
    """The candidate's function: fusepatch's chunk loop and cross-entropy kernels with these GEMMs."""
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    from fusepatch.kernels.cross_entropy import cross_entropy_
    from fusepatch.ops.linear_cross_entropy import loop

    return loop(cross_entropy_, FP8Gemms)
