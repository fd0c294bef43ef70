"""Forwards for the small layers: RMSNorm (plain and zero-centered) and the SwiGLU MLP."""

from __future__ import annotations

import torch

from fusepatch.resolve import dtype_name


def _eps(self) -> float:
    return self.eps if hasattr(self, "eps") else self.variance_epsilon


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._fusepatch.ops["rms_norm"](hidden_states, self.weight, _eps(self))


def rms_norm_zero_centered_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._fusepatch.ops["rms_norm_zero_centered"](hidden_states, self.weight, _eps(self))


def swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if getattr(getattr(self, "config", None), "hidden_act", "silu") not in ("silu", "swish"):
        return self._fusepatch.original(x)  # SwiGLU kernels assume SiLU
    return self.down_proj(self._fusepatch.ops["swiglu"](self.gate_proj(x), self.up_proj(x)))


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """MoE experts through the moe_experts op when it has a fused candidate for this call; otherwise the
    experts implementation transformers chose (``config._experts_implementation``) runs unchanged."""
    state = self._fusepatch
    dispatch = state.ops["moe_experts"]
    standard = (
        getattr(self, "gate_up_proj", None) is not None
        and getattr(self, "down_proj", None) is not None
        and self.gate_up_proj.ndim == 3
        and not getattr(self, "is_transposed", False)
        and not getattr(self, "has_bias", False)
        and getattr(getattr(self, "config", None), "hidden_act", "silu") in ("silu", "swish")
    )
    if standard and dispatch.choice(hidden_states.device.type, dtype_name(hidden_states.dtype)).fused:
        return dispatch(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    return state.original(hidden_states, top_k_index, top_k_weights)
