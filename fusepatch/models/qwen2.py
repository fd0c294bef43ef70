"""Qwen2 and Qwen2-MoE: full attention, plain RMSNorm (x * w)."""

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

DENSE = ("qwen2",)
DENSE_MODULE = "transformers.models.qwen2.modeling_qwen2"
MOE = ("qwen2_moe",)
MOE_MODULE = "transformers.models.qwen2_moe.modeling_qwen2_moe"

ROWS = [
    Row(DENSE, DENSE_MODULE, "Qwen2RMSNorm", ("rms_norm",), rms_norm_forward),
    Row(DENSE, DENSE_MODULE, "Qwen2MLP", ("swiglu",), swiglu_mlp_forward),
    Row(DENSE, DENSE_MODULE, "Qwen2DecoderLayer", ("add_rms_norm",), decoder_layer_forward),
    Row(DENSE, DENSE_MODULE, "Qwen2RotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(DENSE, DENSE_MODULE, "Qwen2Attention", ATTENTION_OPS, attention_forward, bindings=attn_names(DENSE_MODULE)),
    Row(DENSE, DENSE_MODULE, "Qwen2Model", (), base_model_forward, note=PADDING),
    Row(DENSE, DENSE_MODULE, "Qwen2ForCausalLM", ("linear_cross_entropy",), causal_lm_forward, bindings=PACKED_CHECK),
    Row(MOE, MOE_MODULE, "Qwen2MoeRMSNorm", ("rms_norm",), rms_norm_forward),
    Row(MOE, MOE_MODULE, "Qwen2MoeMLP", ("swiglu",), swiglu_mlp_forward, note="experts and shared expert"),
    Row(MOE, MOE_MODULE, "Qwen2MoeExperts", ("moe_experts",), experts_forward),
    Row(MOE, MOE_MODULE, "Qwen2MoeDecoderLayer", ("add_rms_norm",), decoder_layer_forward),
    Row(MOE, MOE_MODULE, "Qwen2MoeRotaryEmbedding", (), rotary_embedding_forward, note=ROPE_TABLES),
    Row(MOE, MOE_MODULE, "Qwen2MoeAttention", ATTENTION_OPS, attention_forward, bindings=attn_names(MOE_MODULE)),
    Row(MOE, MOE_MODULE, "Qwen2MoeModel", (), base_model_forward, note=PADDING),
    Row(MOE, MOE_MODULE, "Qwen2MoeForCausalLM", ("linear_cross_entropy",), causal_lm_forward, bindings=PACKED_CHECK),
    fp8_projections(DENSE + MOE),
]
