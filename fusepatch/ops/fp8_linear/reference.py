"""The projection FP8 replaces, in plain PyTorch: ``F.linear`` in the input's dtype (what runs when FP8 cannot)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
