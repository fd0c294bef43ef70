"""Qwen2 and Qwen2-MoE: full attention, plain RMSNorm (x * w)."""

from fusepatch.models._rows import family, projections

ROWS = [
    *family("qwen2", "Qwen2"),
    *family("qwen2_moe", "Qwen2Moe", moe=True, mlp="experts and shared expert"),
    *projections(("qwen2", "qwen2_moe")),
]
