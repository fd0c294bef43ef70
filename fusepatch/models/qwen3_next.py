"""Qwen3-Next: hybrid Gated DeltaNet + gated attention, MoE, zero-centered norms."""

from fusepatch.models._rows import family, projections

ROWS = [
    *family("qwen3_next", "Qwen3Next", hybrid=True, moe=True, mlp="dense and shared-expert MLP"),
    *projections(("qwen3_next",)),
]
