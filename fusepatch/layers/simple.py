"""Forwards for the small layers: RMSNorm (plain and zero-centered) and the SwiGLU MLP."""

from __future__ import annotations

import torch


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
