"""flash-linear-attention (``fla-core``): what fusepatch uses beyond fla's public ops, on which versions.

fusepatch calls fla's chunked delta-rule stages one by one (to keep the chunk states for the backward), its
cross-entropy kernels inside its own chunk loop, its per-call backend dispatch's inner functions, and the
builder of its TileLang ``chunk_bwd_dqkwg`` kernel. None of these is a promised API: each name and each
parameter fusepatch passes is listed here, checked on the versions in ``NAMES.checked``.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from fusepatch.base.private_names import PrivateNames

DISTRIBUTION = "fla-core"
REQUIRED = ">=0.6"  # the candidates' requirement; the [cuda] extra adds <0.7 (only 0.6's names are checked)
FIX = "pip install 'flash-linear-attention[cuda]>=0.6,<0.7'"

CHUNK = "fla.ops.gated_delta_rule.chunk"

# fla function -> the parameters fusepatch passes it by keyword, per module.
DELTA_RULE_STAGES: dict[str, set[str]] = {
    "gdn_gate_chunk_cumsum": {"g", "A_log", "dt_bias", "scale", "chunk_size", "cu_seqlens", "chunk_indices"},
    "chunk_gated_delta_rule_fwd_intra": {"k", "v", "g", "beta", "cu_seqlens", "chunk_indices", "chunk_size"},
    "chunk_gated_delta_rule_fwd_h": {
        *("k", "w", "u", "g", "initial_state", "output_final_state", "chunk_size", "cu_seqlens", "chunk_indices")
    },
    "chunk_fwd_o": {"q", "k", "v", "h", "g", "scale", "cu_seqlens", "chunk_indices", "chunk_size"},
    "chunk_bwd_dv_local": {"q", "k", "g", "do", "scale", "cu_seqlens", "chunk_indices", "chunk_size"},
    "chunk_gated_delta_rule_bwd_dhu": {
        *("q", "k", "w", "g", "h0", "dht", "do", "dv", "scale", "chunk_size", "cu_seqlens", "chunk_indices")
    },
    "chunk_bwd_dqkwg": {
        *("q", "k", "v", "w", "g", "h", "dv", "do", "dh", "scale", "chunk_size", "cu_seqlens", "chunk_indices")
    },
    "prepare_wy_repr_bwd": {"k", "v", "beta", "g", "A", "dw", "du", "cu_seqlens", "chunk_indices"},
    "chunk_local_cumsum": {"g", "chunk_size", "reverse", "cu_seqlens", "chunk_indices"},
    "gdn_gate_bwd": {"g", "A_log", "dt_bias", "dyg"},
    "l2norm_fwd": set(),
    "l2norm_bwd": set(),
    "fused_beta_sigmoid": {"scale"},
    "fused_beta_sigmoid_bwd": {"scale"},
}
CROSS_ENTROPY: dict[str, set[str]] = {
    "cross_entropy_fwd": {"logits", "target", "ignore_index"},
    "cross_entropy_bwd": {
        *("logits", "target", "lse", "dloss", "ignore_index", "total_classes", "class_start_idx", "inplace_backward")
    },
}
# The builder fusepatch calls with one 128-wide K block (ops/gated_delta_rule/dqkwg.py), and the keywords it passes.
DQKWG_BUILDER = "_build_chunk_bwd_dqkwg_kernel"
DQKWG_BUILDER_ARGS: set[str] = {
    *("B", "H", "HV", "K", "V", "BT", "BK", "BV", "NK", "hD1", "hD2", "dtype_str"),
    *("USE_G", "USE_DW", "STATE_V_FIRST", "IS_VARLEN", "num_warps"),
}

NAMES = PrivateNames(
    distribution=DISTRIBUTION,
    checked=("0.6.0",),
    names={
        CHUNK: tuple(sorted(DELTA_RULE_STAGES)),
        "fla.ops.utils.constant": ("RCP_LN2",),
        "fla.ops.utils.index": ("prepare_chunk_indices",),
        "fla.ops.common.gate": ("fused_beta_sigmoid_fwd",),
        "fla.ops.common.backends": ("CommonTileLangBackend",),
        "fla.ops.common.backends.tilelang.chunk_bwd": (DQKWG_BUILDER,),
        "fla.modules.fused_cross_entropy.ops": tuple(CROSS_ENTROPY),
        "fla.backends": (
            "BackendRegistry",
        ),  # the per-call dispatch fusepatch looks past (ops/gated_delta_rule/fla_direct.py)
    },
    fix=FIX,
    optional={"fla.ops.common.backends.tilelang.chunk_bwd": "tilelang"},  # fla's TileLang backward, used if installed
    import_needs_gpu="importing fla asks Triton for the GPU's driver",
)


def check_signatures(module: ModuleType, needs: dict[str, set[str]], skip: str) -> None:
    """fusepatch calls these fla functions by keyword: an fla-core whose function lost a parameter fusepatch
    passes (or lost the function) fails the candidate's load with the fix (a fallback reported at WARNING),
    instead of a TypeError mid-training. ``skip``: the ``op/candidate`` to name in FUSEPATCH_SKIP."""
    for name, wanted in needs.items():
        function = getattr(module, name, None)
        missing = wanted - set(inspect.signature(function).parameters) if callable(function) else {"itself"}
        if missing:
            raise ImportError(
                f"fla's {name} lacks {sorted(missing)} (fla-core changed it; fusepatch checked "
                f"{', '.join(NAMES.checked)}). Fix: {FIX}, or FUSEPATCH_SKIP={skip}"
            )
