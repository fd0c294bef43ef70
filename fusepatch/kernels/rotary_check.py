"""Which rotary calls the Triton kernel reproduces exactly; a leaf module (torch only), so that the kernel, the op
and the attention forward all ask the same question without importing each other."""

from __future__ import annotations

import torch


def unsupported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why a call is outside what the fused kernel reproduces exactly (the caller then keeps transformers'
    function), or None."""
    if q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:  # eager would promote; the kernel keeps q's dtype
        return f"dtypes q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}"
    rotary = cos.shape[-1]
    if rotary % 2 or rotary > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        return f"rotary dim {rotary} against head dims {q.shape[-1]}/{k.shape[-1]}"
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or cos.shape[1] != q.shape[2]:
        return f"batch/tokens of q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} disagree"
    if cos.shape[0] not in (1, q.shape[0]) or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "cos/sin layout"
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad"
    return None
