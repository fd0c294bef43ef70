"""Forwards for the small layers: RMSNorm (plain and zero-centered) and the SwiGLU MLP."""

from __future__ import annotations

import torch

from fusepatch.base.dtypes import dtype_name
from fusepatch.layers.mlp_recompute import recomputed_down
from fusepatch.layers.support.hooks import may_bypass
from fusepatch.layers.support.projections import apply_linear, linear_plus, project


def _eps(self) -> float:
    return self.eps if hasattr(self, "eps") else self.variance_epsilon


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._fusepatch.ops["rms_norm"](hidden_states, self.weight, _eps(self))


def rms_norm_zero_centered_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._fusepatch.ops["rms_norm_zero_centered"](hidden_states, self.weight, _eps(self))


def swiglu_mlp_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP ``down(swiglu(gate(x), up(x)))``; with ``residual`` (the decoder layer calls it so, see
    ``swiglu_mlp_plus``) ``residual + mlp(x)``, the add done by the down projection's GEMM where it can."""
    if not _silu_act(self):  # the SwiGLU kernels compute SiLU; anything else runs as transformers runs it
        out = self._fusepatch.original(x)
        return out if residual is None else residual + out
    swiglu = self._fusepatch.ops["swiglu"]
    gate, up = project(x, self.gate_proj, self.up_proj)
    out = recomputed_down(swiglu, gate, up, self.down_proj, residual, enabled=self._fusepatch.mlp_recompute)
    if out is not None:
        return out
    act = swiglu(gate, up)
    return apply_linear(self.down_proj, act) if residual is None else linear_plus(self.down_proj, act, residual)


# transformers' SiLU activations (``ACT2FN["silu"]``, ``ACT2FN["swish"]``), which the SwiGLU kernels compute
_SILU = {("transformers.activations", "SiLUActivation"), ("torch.nn.modules.activation", "SiLU")}


def _silu_act(module: torch.nn.Module) -> bool:
    """Whether ``module``'s activation is what the fused SwiGLU computes: SiLU by its config and by its ``act_fn``
    (a SiLU module running its own forward, with no hook to see its call; a module swapped in after the model was
    built, a forward set on it or a hook make the MLP compute as transformers does)."""
    if getattr(getattr(module, "config", None), "hidden_act", "silu") not in ("silu", "swish"):
        return False
    act = getattr(module, "act_fn", None)
    if not isinstance(act, torch.nn.Module):
        return True  # no module to honour: the config decides, as before
    return (type(act).__module__, type(act).__name__) in _SILU and may_bypass(act, gathering=True)


def swiglu_mlp_plus(mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    """``residual + mlp(x)`` through ``swiglu_mlp_forward`` when ``mlp`` runs it (patched, no hooks to honour);
    None otherwise (the caller calls the module)."""
    state = getattr(mlp, "_fusepatch", None)
    if state is None or state.row.forward is not swiglu_mlp_forward or not may_bypass(mlp):
        return None
    return swiglu_mlp_forward(mlp, x, residual)


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
        and _silu_act(self)  # the fused op computes the activation itself
    )
    if standard and dispatch.choice(hidden_states.device.type, dtype_name(hidden_states.dtype)).fused:
        return dispatch(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    return state.original(hidden_states, top_k_index, top_k_weights)
