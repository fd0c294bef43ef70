"""Shorthands for the family tables."""

from __future__ import annotations

from fusepatch.base.row import Row
from fusepatch.layers.attention import attention_forward, attn_names, gated_attention_forward
from fusepatch.layers.base_model import base_model_forward
from fusepatch.layers.causal_lm import PACKED_CHECK, causal_lm_forward, conditional_generation_forward
from fusepatch.layers.decoder import decoder_layer_forward, hybrid_decoder_layer_forward
from fusepatch.layers.fp8 import PROJECTIONS, aligned, fp8_linear_forward
from fusepatch.layers.gated_deltanet import gated_deltanet_forward
from fusepatch.layers.rotary_embedding import rotary_embedding_forward
from fusepatch.layers.simple import (
    experts_forward,
    rms_norm_forward,
    rms_norm_zero_centered_forward,
    swiglu_mlp_forward,
)
from fusepatch.layers.support.dispatch_guard import guards

GDN_OPS = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")
ATTENTION_OPS = ("rotary", "varlen_attention")
GATED_ATTENTION_OPS = ("rotary", "attention_gate", "varlen_attention")
ROPE_TABLES = "cos/sin of plain positions computed once and reused across steps; no kernel"
# the base model every head calls: padded rows told apart from packed ones for every head, not the causal LM's alone
PADDING = "the call's attention_mask noted, so padded rows are not taken for packed ones; no kernel"


def fp8_projections(model_types: tuple[str, ...]) -> Row:
    """The decoder's projections of these model types under ``apply(model, precision="fp8")``: plain
    ``nn.Linear`` held as one of ``PROJECTIONS`` (a subclass, such as a layer torchao already converted or a
    peft LoRA wrapper, is left as it is), with both weight dimensions multiples of 16 (the others are named)."""
    return Row(
        model_types,
        "torch.nn.modules.linear",
        "Linear",
        ("fp8_linear",),
        fp8_linear_forward,
        note="decoder projections with FP8 GEMMs: " + ", ".join(PROJECTIONS),
        names=PROJECTIONS,
        precision="fp8",
        fits=aligned,
    )


__all__ = [
    "ATTENTION_OPS",
    "PACKED_CHECK",
    "GATED_ATTENTION_OPS",
    "GDN_OPS",
    "PADDING",
    "ROPE_TABLES",
    "Row",
    "attn_names",
    "attention_forward",
    "base_model_forward",
    "causal_lm_forward",
    "conditional_generation_forward",
    "decoder_layer_forward",
    "experts_forward",
    "fp8_projections",
    "gated_attention_forward",
    "gated_deltanet_forward",
    "guards",
    "hybrid_decoder_layer_forward",
    "rms_norm_forward",
    "rms_norm_zero_centered_forward",
    "rotary_embedding_forward",
    "swiglu_mlp_forward",
]
