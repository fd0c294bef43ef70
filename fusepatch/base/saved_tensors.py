"""Autograd graphs that keep their own saved tensors, whatever saved-tensor hooks are active around them."""

from __future__ import annotations

import torch


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Saved-tensor hook that saves the tensor itself (shadows any checkpointing/offloading hooks around)."""
    return tensor


def own_saved_tensors():
    """Autograd graphs made inside keep their saved tensors as they are, whatever saved-tensor hooks are around:
    a kernel check run inside an activation-checkpointed forward must not have its backward ask the checkpoint to
    re-run the layer from inside that layer's forward (a deadlock on the H200 under FSDP2 + checkpointing)."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)
