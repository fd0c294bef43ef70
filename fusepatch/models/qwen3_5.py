"""Qwen3.5 and Qwen3.5-MoE: hybrid Gated DeltaNet (3 of 4 layers) + gated full attention, zero-centered norms."""

from fusepatch.models._rows import (
    GATED_ATTENTION_OPS,
    GDN_OPS,
    PADDING,
    ROPE_TABLES,
    Row,
    base_model_forward,
    causal_lm_forward,
    conditional_generation_forward,
    experts_forward,
    fp8_projections,
    gated_attention_forward,
    gated_deltanet_forward,
    hybrid_decoder_layer_forward,
    rms_norm_zero_centered_forward,
    rotary_embedding_forward,
    swiglu_mlp_forward,
)

DENSE = ("qwen3_5", "qwen3_5_text")
DENSE_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
MOE = ("qwen3_5_moe", "qwen3_5_moe_text")
MOE_MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"

ROWS = [
    # model types, module, layer class, ops, replacement forward
    Row(DENSE, DENSE_MODULE, "Qwen3_5GatedDeltaNet", GDN_OPS, gated_deltanet_forward, note="linear attention"),
    Row(
        DENSE,
        DENSE_MODULE,
        "Qwen3_5DecoderLayer",
        ("add_rms_norm_zero_centered",),
        hybrid_decoder_layer_forward,
        note="residual add fused into the post-attention norm; packed boundaries to linear attention",
    ),
    Row(DENSE, DENSE_MODULE, "Qwen3_5RMSNorm", ("rms_norm_zero_centered",), rms_norm_zero_centered_forward),
    Row(DENSE, DENSE_MODULE, "Qwen3_5MLP", ("swiglu",), swiglu_mlp_forward),
    Row(DENSE, DENSE_MODULE, "Qwen3_5TextRotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(
        DENSE,
        DENSE_MODULE,
        "Qwen3_5Attention",
        GATED_ATTENTION_OPS,
        gated_attention_forward,
        note="gated full attention",
    ),
    Row(DENSE, DENSE_MODULE, "Qwen3_5TextModel", (), base_model_forward, note=PADDING),
    Row(DENSE, DENSE_MODULE, "Qwen3_5ForCausalLM", ("linear_cross_entropy",), causal_lm_forward),
    Row(
        DENSE,
        DENSE_MODULE,
        "Qwen3_5ForConditionalGeneration",
        ("linear_cross_entropy",),
        conditional_generation_forward,
        note="image-text wrapper: text loss only",
    ),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeGatedDeltaNet", GDN_OPS, gated_deltanet_forward, note="linear attention"),
    Row(
        MOE,
        MOE_MODULE,
        "Qwen3_5MoeDecoderLayer",
        ("add_rms_norm_zero_centered",),
        hybrid_decoder_layer_forward,
        note="residual add fused into the post-attention norm; packed boundaries to linear attention",
    ),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeRMSNorm", ("rms_norm_zero_centered",), rms_norm_zero_centered_forward),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeMLP", ("swiglu",), swiglu_mlp_forward, note="shared expert"),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeExperts", ("moe_experts",), experts_forward),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeTextRotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(
        MOE,
        MOE_MODULE,
        "Qwen3_5MoeAttention",
        GATED_ATTENTION_OPS,
        gated_attention_forward,
        note="gated full attention",
    ),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeTextModel", (), base_model_forward, note=PADDING),
    Row(MOE, MOE_MODULE, "Qwen3_5MoeForCausalLM", ("linear_cross_entropy",), causal_lm_forward),
    Row(
        MOE,
        MOE_MODULE,
        "Qwen3_5MoeForConditionalGeneration",
        ("linear_cross_entropy",),
        conditional_generation_forward,
        note="image-text wrapper: text loss only",
    ),
    fp8_projections(DENSE + MOE),
]
