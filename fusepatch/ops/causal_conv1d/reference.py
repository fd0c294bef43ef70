"""The causal depthwise conv in plain PyTorch, exact per document for packed rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """For every position of a packed row, the index where its document starts."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager causal depthwise conv, the same arithmetic as transformers' torch path when not packed."""
    batch, length, dim = x.shape
    width = weight.shape[-1]
    if cu_seqlens is None:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
        out = out[..., :length].transpose(1, 2)
    else:
        if batch != 1:
            raise ValueError(f"packed inputs (cu_seqlens) need batch size 1, got {batch}")
        # out[t] = sum_s w[W-1-s] * x[t-s], keeping only taps inside t's document.
        starts = document_starts(cu_seqlens.to(x.device), length)
        positions = torch.arange(length, device=x.device)
        xw = x.to(weight.dtype)
        out = torch.zeros_like(xw)
        for shift in range(width):
            shifted = F.pad(xw, (0, 0, shift, 0))[:, :length]
            keep = (positions - shift >= starts).to(xw.dtype)[None, :, None]
            out = out + shifted * keep * weight[:, width - 1 - shift]
        if bias is not None:
            out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    return out.to(x.dtype)
