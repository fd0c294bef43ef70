"""Qwen3.5 and Qwen3.5-MoE: hybrid Gated DeltaNet (3 of 4 layers) + gated full attention, zero-centered norms; each
with a text-only model type and an image-text wrapper whose text loss is fused."""

from fusepatch.models._rows import family, projections

ROWS = [
    *family("qwen3_5", "Qwen3_5", hybrid=True, image_text=True),
    *family("qwen3_5_moe", "Qwen3_5Moe", hybrid=True, moe=True, image_text=True, mlp="shared expert"),
    *projections(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")),
]
