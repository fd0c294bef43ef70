"""transformers' causal-LM loss in plain PyTorch: the logits, then the cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_rows(hidden: torch.Tensor, labels: torch.Tensor) -> None:
    """One label per row of ``hidden`` (``[N, H]`` and ``[N]``), else the ValueError ``cross_entropy`` gives the
    reference: a kernel reading ``labels`` by the rows' index would read past them or leave rows unread. Shapes
    only: no read of the GPU."""
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"linear_cross_entropy: labels of shape {tuple(labels.shape)} for hidden states of shape "
            f"{tuple(hidden.shape)}; it takes one label per row (hidden [N, H], labels [N]); fix: flatten both "
            "alike, hidden.reshape(-1, hidden.shape[-1]) and labels.reshape(-1)"
        )


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
    check_rows(hidden, labels)
    logits = _upcast(hidden @ weight.t())
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss / _denominator(labels, ignore_index, num_items_in_batch)
