"""transformers' causal-LM loss in plain PyTorch: the logits, then the cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _denominator(labels: torch.Tensor, ignore_index: int, num_items_in_batch) -> torch.Tensor:
    """The Trainer's ``num_items_in_batch``, else the labels not ignored. None of those: 0, and the loss 0 / 0 =
    NaN, as transformers' mean over no tokens gives (a batch with nothing to predict, e.g. one token)."""
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, device=labels.device, dtype=torch.float32)
    return (labels != ignore_index).sum().float()


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in fp32 at least (transformers upcasts bf16 logits; fp64 stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index: int = -100, num_items_in_batch=None):
    """Eager: the full logits in the model dtype, upcast, cross-entropy summed, divided as transformers does."""
    logits = _upcast(hidden @ weight.t())
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss / _denominator(labels, ignore_index, num_items_in_batch)
