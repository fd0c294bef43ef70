"""Tiny models of every registered family, built from configs (no Hub): for the demo, tests and warm-up."""

from __future__ import annotations

from typing import Any

from fusepatch.base.env import require_transformers

COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
HYBRID: dict[str, Any] = dict(
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {**COMMON, **HYBRID},
    "qwen3_5_moe_text": {**COMMON, **HYBRID, **MOE, "shared_expert_intermediate_size": 32},
    "qwen3_next": {**COMMON, **HYBRID, **MOE, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1},
    "qwen3": dict(COMMON),
    "qwen3_moe": {**COMMON, **MOE},
    "qwen2": {k: v for k, v in COMMON.items() if k != "head_dim"},
    "qwen2_moe": {**{k: v for k, v in COMMON.items() if k != "head_dim"}, **MOE, "shared_expert_intermediate_size": 32},
}


def tiny_config(model_type: str, **overrides: Any):
    """A small config of ``model_type`` (4 layers; hybrid families: 3 linear + 1 full attention)."""
    AutoConfig = require_transformers().AutoConfig

    if model_type not in FAMILIES:
        raise ValueError(f"no tiny config for {model_type!r}; choose from {sorted(FAMILIES)}")
    return AutoConfig.for_model(model_type, **{**FAMILIES[model_type], **overrides})


def tiny_model(
    model_type: str = "qwen3_5_text", *, seed: int = 0, dtype=None, attn_implementation: str = "eager", **overrides: Any
):
    """A freshly initialised tiny ``AutoModelForCausalLM`` of ``model_type`` (eager attention unless asked, fp32)."""
    import torch

    AutoModelForCausalLM = require_transformers().AutoModelForCausalLM
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype or torch.float32
    )
    return model


def tiny_image_text_model(model_type: str = "qwen3_5", *, seed: int = 0, **text_overrides: Any):
    """The image-text wrapper (``Qwen3_5ForConditionalGeneration``: the class Qwen3.5 checkpoints name) around a
    tiny text stack of ``{model_type}_text`` and a one-block vision tower (eager attention, fp32)."""
    import torch

    transformers = require_transformers()
    AutoConfig, AutoModelForImageTextToText = transformers.AutoConfig, transformers.AutoModelForImageTextToText

    torch.manual_seed(seed)
    text = {k: v for k, v in FAMILIES[f"{model_type}_text"].items() if k != "tie_word_embeddings"}
    text.update(text_overrides)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    vision.update(patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=False)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
