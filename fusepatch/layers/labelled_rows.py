"""The fused loss over the rows that have a label only.

A fine-tuning batch labels only what the model should learn to write: chat SFT sets the prompt's and the
template's tokens to -100 (the SFT example keeps the assistant's), packed rows add one -100 at every document
boundary. transformers computes the ``lm_head`` GEMMs and the cross-entropy for every row anyway and multiplies
the ignored ones by zero; at Qwen3.5's 248k vocabulary that is three GEMMs of ``rows x 248,320 x hidden`` (13.2-13.7
ms each in the 27B-shaped step on the H200 at 4096 rows, benchmarks/RESULTS.md session 13). Here the loss gets the labelled rows
only (``index_select``; autograd scatters their gradient back, zeros elsewhere): the same loss and gradients,
the ignored rows' work skipped.

Selecting needs the number of labelled rows on the host. ``LabelledRows`` starts counting before the model's
forward: the count is copied to pinned host memory behind a CUDA event queued ahead of the forward's kernels,
so reading it after the forward waits only for that event, which the GPU passed long before, not for the forward
(a ``nonzero`` or ``.item()`` there would empty the GPU's queue). Batches with fewer than ``MIN_DROPPED`` of their
rows ignored (pretraining: only each row's last position) keep every row and pay only the count.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
MIN_DROPPED = 1 / 32  # fraction of ignored rows from which the loss runs on the labelled rows only


class LabelledRows:
    """Built from the shifted labels before the model's forward; ``select(hidden)`` after it returns the labelled
    rows of the flattened hidden state and of the labels (or every row, see ``MIN_DROPPED``)."""

    def __init__(self, shift_labels: torch.Tensor):
        self.labels = shift_labels.reshape(-1)
        self.total = self.labels.numel()
        self._event = None
        self._valid = None
        if torch.compiler.is_compiling() or self.total == 0:
            self._count = None  # a traced graph keeps every row: no data-dependent shapes
            return
        self._valid = self.labels != IGNORE_INDEX
        count = self._valid.sum()
        if count.is_cuda:
            self._count = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._count.copy_(count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._count = count

    def kept(self) -> int | None:
        """How many rows the loss will see (None: all, untouched)."""
        if self._count is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        count = int(self._count)
        if count == 0 or self.total - count < MIN_DROPPED * self.total:
            return None
        return count

    def select(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [rows, H], labels [rows])`` of the labelled rows, in their order; ``hidden`` is the flattened
        last hidden state. No wait for the GPU: the row indices come from a stable sort of the labelled flags."""
        count = self.kept()
        if count is None:
            return hidden, self.labels.to(hidden.device)
        # labelled rows first, each group in its original order
        order = torch.argsort((~self._valid).to(torch.uint8), stable=True)[:count].to(hidden.device)
        return hidden.index_select(0, order), self.labels.to(hidden.device).index_select(0, order)
