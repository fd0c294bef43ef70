"""Every op fusepatch knows, by name. One module per op family holds its reference and its candidates."""

from __future__ import annotations

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.ops.attention_gate import ATTENTION_GATE
from fusepatch.ops.causal_conv1d import CAUSAL_CONV1D
from fusepatch.ops.fp8_linear import FP8_LINEAR
from fusepatch.ops.fp8_linear_cross_entropy import FP8_LINEAR_CROSS_ENTROPY
from fusepatch.ops.gated_delta_rule import GATED_DELTA_RULE
from fusepatch.ops.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from fusepatch.ops.moe_experts import MOE_EXPERTS
from fusepatch.ops.rms_norm import (
    ADD_RMS_NORM,
    ADD_RMS_NORM_ZERO_CENTERED,
    GATED_RMS_NORM,
    RMS_NORM,
    RMS_NORM_ZERO_CENTERED,
)
from fusepatch.ops.rotary import ROTARY
from fusepatch.ops.swiglu import SWIGLU
from fusepatch.ops.varlen_attention import VARLEN_ATTENTION

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        GATED_DELTA_RULE,
        CAUSAL_CONV1D,
        GATED_RMS_NORM,
        RMS_NORM,
        RMS_NORM_ZERO_CENTERED,
        ADD_RMS_NORM,
        ADD_RMS_NORM_ZERO_CENTERED,
        SWIGLU,
        ROTARY,
        ATTENTION_GATE,
        VARLEN_ATTENTION,
        LINEAR_CROSS_ENTROPY,
        MOE_EXPERTS,
        FP8_LINEAR,
        FP8_LINEAR_CROSS_ENTROPY,
    )
}

__all__ = ["OPS", "Candidate", "Op", "SelfTest"]
