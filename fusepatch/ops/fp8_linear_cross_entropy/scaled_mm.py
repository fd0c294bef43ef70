"""The fused loss's three GEMMs in FP8 (``Gemms`` of ``ops/linear_cross_entropy``), each operand quantized to
float8_e4m3fn along that GEMM's reduction dimension with one power-of-two scale per row, as ``fp8_linear`` quantizes
a projection's: the logits from the hidden states by tokens and the weight by vocabulary rows; the hidden-state
gradient from the logits' gradient by tokens and the weight by hidden features; the weight gradient from both by
vocabulary rows and hidden features, along the chunk's tokens (padded with zeros to a multiple of 16).

The weight's two copies (by rows and by columns, each half of its bf16 bytes) are made once per loss call and freed
at its end; the hidden states' rows once per call too, the rest per chunk. Both of the weight's dimensions must be
multiples of 16 (``aligned``): the vocabulary is the hidden-state gradient's reduction dimension.
"""

from __future__ import annotations

import torch

from fusepatch.kernels.fp8_range import MULTIPLE
from fusepatch.ops.fp8_linear.scaled_mm import fp8_mm, quantizers


class FP8Gemms:
    """``Gemms`` on ``torch._scaled_mm`` (fast accumulation, as every FP8 GEMM of ``fp8_linear``)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, wants_hidden: bool, wants_weight: bool) -> None:
        if weight.shape[0] % MULTIPLE or weight.shape[1] % MULTIPLE:
            raise ValueError(
                f"fp8_linear_cross_entropy: lm_head weight {tuple(weight.shape)}: FP8 GEMMs need both dimensions "
                f"multiples of {MULTIPLE}"
            )
        self.quantize = quantizers(hidden.device)
        self.hidden, self.dtype = hidden, hidden.dtype
        self.hidden_rows = self.quantize.rows(hidden)
        self.weight_rows = self.quantize.rows(weight)
        self.weight_columns = self.quantize.columns(weight) if wants_hidden else None

    def logits(self, start: int, end: int) -> torch.Tensor:
        q, inverse = self.hidden_rows
        return fp8_mm(q[start:end], inverse[start:end], *self.weight_rows, self.dtype)

    def grad_hidden(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(fp8_mm(*self.quantize.rows(grad), *self.weight_columns, self.dtype))

    def grad_weight(self, grad: torch.Tensor, start: int, end: int, total: torch.Tensor | None) -> torch.Tensor:
        g = self.quantize.columns(grad, MULTIPLE)
        h = self.quantize.columns(self.hidden[start:end], MULTIPLE)
        part = fp8_mm(*g, *h, self.dtype)
        return part if total is None else total.add_(part)


def load():
    """The candidate's function: fusepatch's chunk loop and cross-entropy kernels with these GEMMs."""
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    from fusepatch.kernels.cross_entropy import cross_entropy_
    from fusepatch.ops.linear_cross_entropy import loop

    return loop(cross_entropy_, FP8Gemms)
