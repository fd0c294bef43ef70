"""Qwen3-Next: hybrid Gated DeltaNet + gated attention, MoE, zero-centered norms."""

from fusepatch.models._rows import (
    GATED_ATTENTION_OPS,
    GDN_OPS,
    PACKED_CHECK,
    PADDING,
    ROPE_TABLES,
    Row,
    attn_names,
    base_model_forward,
    causal_lm_forward,
    experts_forward,
    fp8_projections,
    gated_attention_forward,
    gated_deltanet_forward,
    guards,
    hybrid_decoder_layer_forward,
    rms_norm_zero_centered_forward,
    rotary_embedding_forward,
    swiglu_mlp_forward,
)

TYPES = ("qwen3_next",)
MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"

ROWS = [
    Row(
        TYPES,
        MODULE,
        "Qwen3NextGatedDeltaNet",
        GDN_OPS,
        gated_deltanet_forward,
        note="linear attention",
        bindings=guards(MODULE),
    ),
    Row(
        TYPES,
        MODULE,
        "Qwen3NextDecoderLayer",
        ("add_rms_norm_zero_centered",),
        hybrid_decoder_layer_forward,
        note="residual add fused into the post-attention norm; packed boundaries to linear attention",
    ),
    Row(TYPES, MODULE, "Qwen3NextRMSNorm", ("rms_norm_zero_centered",), rms_norm_zero_centered_forward),
    Row(TYPES, MODULE, "Qwen3NextMLP", ("swiglu",), swiglu_mlp_forward, note="dense and shared-expert MLP"),
    Row(TYPES, MODULE, "Qwen3NextExperts", ("moe_experts",), experts_forward),
    Row(TYPES, MODULE, "Qwen3NextRotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(
        TYPES,
        MODULE,
        "Qwen3NextAttention",
        GATED_ATTENTION_OPS,
        gated_attention_forward,
        note="gated full attention",
        bindings=attn_names(MODULE),
    ),
    Row(TYPES, MODULE, "Qwen3NextModel", (), base_model_forward, note=PADDING),
    Row(TYPES, MODULE, "Qwen3NextForCausalLM", ("linear_cross_entropy",), causal_lm_forward, bindings=PACKED_CHECK),
    fp8_projections(TYPES),
]
