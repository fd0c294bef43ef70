"""The MoE experts as transformers computes them: a loop over the experts a batch routes to."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """A loop over experts: the shape of transformers' eager path."""
    out = torch.zeros_like(hidden)
    for expert in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(hidden[token], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def weighted_swiglu_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The experts' activation scaled by each slot's routing weight: ``silu(gate) * up * weight`` per row of
    ``gate_up`` (``[slots, 2 x inter]``, gate half first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up * weight[:, None]
