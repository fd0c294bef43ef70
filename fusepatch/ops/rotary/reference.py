"""Rotary position embedding applied to q and k, as transformers applies it."""

from __future__ import annotations

import torch


def rotary_reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1), partial rotary on the first cos.shape[-1] channels."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]

    def apply(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)

    return apply(q), apply(k)
