"""SwiGLU in plain PyTorch: silu(gate) * up."""

from __future__ import annotations

import torch.nn.functional as F


def swiglu_reference(gate, up):
    return F.silu(gate) * up
