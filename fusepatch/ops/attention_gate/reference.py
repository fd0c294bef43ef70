"""The gated attention output in plain PyTorch: attn * sigmoid(gate)."""

from __future__ import annotations

import torch


def attention_gate_reference(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """transformers' gated attention output: the gate flattened to the attention's shape, sigmoid, multiply."""
    return attn * torch.sigmoid(gate.reshape(attn.shape))
