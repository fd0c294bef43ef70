"""Model shapes the benchmarks use: real layer shapes at reduced depth, built from configs (no Hub)."""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    # Qwen3.5-27B layer shapes: hidden 5120, intermediate 17408, 24 q / 4 kv heads of 256,
    # 16 key / 48 value linear heads of 128, conv 4, vocab 248320, 3 linear : 1 full.
    "27b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layers=8,
        seq=4096,
        batch=1,
    ),
    # Qwen3.5-2B-like: hidden 2048, intermediate 6144, 8 q / 2 kv heads of 256, 16/16 linear heads of 128.
    "2b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layers=24,
        seq=2048,
        batch=4,
    ),
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


def build_config(shape: str, layers: int | None = None):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    depth = layers or spec.pop("layers")
    spec.pop("layers", None)
    spec.pop("seq")
    spec.pop("batch")
    layer_types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(depth)]
    return AutoConfig.for_model(
        model_type,
        num_hidden_layers=depth,
        layer_types=layer_types,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        use_cache=False,
        **spec,
    )


def flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (projections, MLP, lm_head; the embedding lookup is
    no matmul) + full attention 6 * seq * Hq * Dh (causal half of 4 * seq * Hq * Dh fwd, times 3 for fwd+bwd)
    + the gated delta rule per value head: 3 x [4 * Dk * Dv (state read and update) + 2 * 64 * (Dk + Dv)
    (within-chunk attention at chunk 64)]."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hq, hkv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    n_full = sum(t == "full_attention" for t in config.layer_types)
    n_lin = len(config.layer_types) - n_full
    mlp = 3 * h * inter
    full = h * (2 * hq * dh) + h * (2 * hkv * dh) + hq * dh * h
    lin = h * (2 * hk * dk + hv * dv) + h * hv * dv + 2 * h * hv + hv * dv * h
    params = n_full * (full + mlp) + n_lin * (lin + mlp) + h * v
    attention = n_full * 6 * seq * hq * dh
    delta = n_lin * hv * 3 * (4 * dk * dv + 2 * 64 * (dk + dv))
    return 6 * params + attention + delta
