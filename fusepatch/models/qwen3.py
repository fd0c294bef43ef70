"""Qwen3 and Qwen3-MoE: full attention, plain RMSNorm (x * w)."""

from fusepatch.models._rows import (
    ATTENTION_OPS,
    PACKED_CHECK,
    PADDING,
    ROPE_TABLES,
    Row,
    attention_forward,
    attn_names,
    base_model_forward,
    causal_lm_forward,
    decoder_layer_forward,
    experts_forward,
    fp8_projections,
    rms_norm_forward,
    rotary_embedding_forward,
    swiglu_mlp_forward,
)

DENSE = ("qwen3",)
DENSE_MODULE = "transformers.models.qwen3.modeling_qwen3"
MOE = ("qwen3_moe",)
MOE_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"

ROWS = [
    Row(DENSE, DENSE_MODULE, "Qwen3RMSNorm", ("rms_norm",), rms_norm_forward),
    Row(DENSE, DENSE_MODULE, "Qwen3MLP", ("swiglu",), swiglu_mlp_forward),
    Row(DENSE, DENSE_MODULE, "Qwen3DecoderLayer", ("add_rms_norm",), decoder_layer_forward),
    Row(DENSE, DENSE_MODULE, "Qwen3RotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(DENSE, DENSE_MODULE, "Qwen3Attention", ATTENTION_OPS, attention_forward, bindings=attn_names(DENSE_MODULE)),
    Row(DENSE, DENSE_MODULE, "Qwen3Model", (), base_model_forward, note=PADDING),
    Row(DENSE, DENSE_MODULE, "Qwen3ForCausalLM", ("linear_cross_entropy",), causal_lm_forward, bindings=PACKED_CHECK),
    Row(MOE, MOE_MODULE, "Qwen3MoeRMSNorm", ("rms_norm",), rms_norm_forward),
    Row(MOE, MOE_MODULE, "Qwen3MoeMLP", ("swiglu",), swiglu_mlp_forward),
    Row(MOE, MOE_MODULE, "Qwen3MoeExperts", ("moe_experts",), experts_forward),
    Row(MOE, MOE_MODULE, "Qwen3MoeDecoderLayer", ("add_rms_norm",), decoder_layer_forward),
    Row(MOE, MOE_MODULE, "Qwen3MoeRotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(MOE, MOE_MODULE, "Qwen3MoeAttention", ATTENTION_OPS, attention_forward, bindings=attn_names(MOE_MODULE)),
    Row(MOE, MOE_MODULE, "Qwen3MoeModel", (), base_model_forward, note=PADDING),
    Row(MOE, MOE_MODULE, "Qwen3MoeForCausalLM", ("linear_cross_entropy",), causal_lm_forward, bindings=PACKED_CHECK),
    fp8_projections(DENSE + MOE),
]
