"""Qwen3 and Qwen3-MoE: full attention, plain RMSNorm (x * w)."""

from fusepatch.models._rows import family, projections

ROWS = [
    *family("qwen3", "Qwen3"),
    *family("qwen3_moe", "Qwen3Moe", moe=True),
    *projections(("qwen3", "qwen3_moe")),
]
