"""The RMSNorm variants of the Qwen families in plain PyTorch, in transformers' arithmetic."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Qwen3 RMSNorm: normalise in fp32, cast back, then scale by ``weight``."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_zero_centered_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/Qwen3-Next RMSNorm: ``(norm(x) * (1 + w))`` in fp32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: ``weight * norm(x)`` then ``* silu(gate)``, as transformers computes it."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Decoder layer, Qwen2/Qwen3 norm: ``h = residual + x`` in the activation dtype, then RMSNorm(h).
    Returns ``(normed, h)``: ``h`` is the next residual."""
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


def add_rms_norm_zero_centered_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Decoder layer, Qwen3.5/Qwen3-Next norm: ``h = residual + x``, then the zero-centered RMSNorm(h)."""
    h = residual + x
    return rms_norm_zero_centered_reference(h, weight, eps), h
