"""Model shapes the benchmarks use: real layer shapes at reduced depth, built from configs (no Hub)."""

from __future__ import annotations

# What the Qwen3.5 dense family shares at every size: vocabulary, attention head size, linear-attention head
# sizes and conv width (Qwen/Qwen3.5-0.8B, -2B and -27B's text configs).
QWEN3_5 = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)

SHAPES: dict[str, dict] = {
    # Qwen3.5-27B layer shapes: hidden 5120, intermediate 17408, 24 q / 4 kv heads of 256,
    # 16 key / 48 value linear heads of 128, conv 4, vocab 248320, 3 linear : 1 full.
    "27b": dict(
        QWEN3_5,
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        layers=8,
        seq=4096,
        batch=1,
    ),
    # Qwen3.5-2B-like: hidden 2048, intermediate 6144, 8 q / 2 kv heads of 256, 16/16 linear heads of 128.
    "2b": dict(
        QWEN3_5,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        layers=24,
        seq=2048,
        batch=4,
    ),
    # Qwen3.5-0.8B (Qwen/Qwen3.5-0.8B's text config, all 24 layers): hidden 1024, intermediate 3584, 8 q / 2 kv
    # heads of 256, 16/16 linear heads of 128 (its embeddings are tied; every shape here is built untied).
    "0.8b": dict(
        QWEN3_5,
        hidden_size=1024,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        layers=24,
        seq=2048,
        batch=8,
    ),
    # Qwen3-32B layer shapes (plain RMSNorm, full attention): hidden 5120, intermediate 25600, 64 q / 8 kv heads
    # of 128, vocab 151936.
    "32b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        layers=8,
        seq=4096,
        batch=1,
    ),
    # Qwen3.5-MoE-shaped: transformers' own qwen3_5_moe_text defaults (the sizes it documents for the family),
    # at reduced depth.
    "moe": dict(model_type="qwen3_5_moe_text", layers=8, seq=4096, batch=1),
    # For checking the harness itself on a laptop CPU.
    "tiny": dict(
        model_type="qwen3_5_text",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        layers=4,
        seq=256,
        batch=2,
    ),
}


def selftest_dims(shape: str) -> dict[str, dict[str, int]]:
    """The self-test's layer sizes (``SelfTest.dims_from``) for a shape's Gated DeltaNet layers, per op."""
    spec = SHAPES[shape]
    heads = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    return {"gated_delta_rule": dict(zip(("hk", "hv", "dk", "dv"), (spec[name] for name in heads)))}


def build_config(shape: str, layers: int | None = None):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    depth = layers or spec.pop("layers")
    spec.pop("layers", None)
    spec.pop("seq")
    spec.pop("batch")
    extra = {}
    if model_type.startswith("qwen3_5"):  # hybrid: 3 linear-attention layers to 1 full-attention layer
        extra["layer_types"] = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(depth)]
    return AutoConfig.for_model(
        model_type,
        num_hidden_layers=depth,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        use_cache=False,
        **extra,
        **spec,
    )
