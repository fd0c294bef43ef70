"""The fused loss over the rows that have a label only.

A fine-tuning batch labels only what the model should learn to write: chat SFT sets the prompt's and the
template's tokens to -100 (the SFT example keeps the assistant's), packed rows add one -100 at every document
boundary. transformers computes the ``lm_head`` GEMMs and the cross-entropy for every row anyway and multiplies
the ignored ones by zero; at Qwen3.5's 248k vocabulary that is three GEMMs of ``rows x 248,320 x hidden``, among
the largest of the step. Here the loss gets the labelled rows
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
import torch.nn.functional as F

IGNORE_INDEX = -100
MIN_DROPPED = 1 / 32  # fraction of ignored rows from which the loss runs on the labelled rows only


def check_fit(labels: torch.Tensor, inputs: torch.Tensor, *, name: str = "labels") -> None:
    """Raise transformers' ValueError where ``labels`` are not one per position of ``inputs`` (the call's
    ``input_ids``, or its ``inputs_embeds``: floating, their hidden size last). transformers' loss flattens both and
    ``cross_entropy`` refuses another count; the labelled-rows loss selects rows by the labels' positions, so
    without this check fewer labels trained on the wrong rows and more indexed past the hidden state. Shapes only:
    no read of the GPU."""
    embeds = inputs.is_floating_point()
    count = inputs.shape[:-1].numel() if embeds else inputs.numel()
    if labels.numel() != count:
        what = f"{'inputs_embeds' if embeds else 'input_ids'} of shape {tuple(inputs.shape)}"
        raise ValueError(mismatch(name, labels, count, what))


def mismatch(name: str, labels: torch.Tensor, count: int, what: str) -> str:
    """The message of labels that are not one per position: both shapes, transformers' words, the fix."""
    return (
        f"{name} of shape {tuple(labels.shape)} do not fit {what}: the causal-LM loss takes one label per position, "
        f"{count} positions and {labels.numel()} labels (transformers: Expected input batch_size ({count}) to match "
        f"target batch_size ({labels.numel()})); fix: {name} of the batch's shape, -100 where no token is predicted"
    )


_pinned: list[torch.Tensor] = []  # host scalars for the count, reused once read (allocating pinned memory queries
# the caching host allocator's events, host time at the step's start, where the GPU waits for the host)


class LabelledRows:
    """Built from the labels before the model's forward; ``select(hidden)`` after it returns the labelled rows of
    the flattened hidden state and of the labels (or every row, see ``MIN_DROPPED``).

    With ``shift=True`` ``labels`` are the unshifted ones (the model's ``labels`` argument): position t predicts
    token t+1 and the last position nothing. Only the count is queued ahead (three small launches): at once, or
    with ``start=False`` when the caller calls ``start`` (``causal_lm``: after the first decoder layer, where the
    GPU has work queued and no longer waits on each launch); the shifted labels and the row order are made in
    ``select``, when the forward's kernels are queued and the GPU is busy."""

    def __init__(self, labels: torch.Tensor, *, shift: bool = False, start: bool = True):
        self._given = labels
        self._shift = shift
        self._shifted: torch.Tensor | None = None if shift else labels.reshape(-1)
        self.total = labels.numel()
        self._event = None
        self._count = None
        self._kept: int | None = None
        self._read = False
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Queue the count (once; ``kept`` queues it itself if nothing did). ``start=False`` and a later call let
        the caller queue it where the GPU has work ahead of it (``causal_lm``: after the first decoder layer)."""
        if self._started:
            return
        self._started = True
        if torch.compiler.is_compiling() or self.total == 0:
            return  # no count: a traced graph keeps every row (no data-dependent shapes)
        labels = self._given
        count = ((labels[..., 1:] if self._shift else labels) != IGNORE_INDEX).sum()
        if count.is_cuda:
            try:
                self._count = _pinned.pop()
            except IndexError:  # none free (the first step, or another thread took the last)
                self._count = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._count.copy_(count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._count = count

    @property
    def labels(self) -> torch.Tensor:
        """The shifted labels, flattened: what each row of the flattened hidden state predicts."""
        if self._shifted is None:
            self._shifted = F.pad(self._given, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
        return self._shifted

    def kept(self) -> int | None:
        """How many rows the loss will see (None: all, untouched)."""
        if self._read:
            return self._kept
        self.start()
        self._read = True
        if self._count is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        count = int(self._count)
        if self._event is not None:
            _pinned.append(self._count)  # read: the next step's count may reuse it
            self._count = None
        if count == 0 or self.total - count < MIN_DROPPED * self.total:
            return None
        self._kept = count
        return count

    def select(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [rows, H], labels [rows])`` of the labelled rows, in their order; ``hidden`` is the flattened
        last hidden state. No wait for the GPU: the row indices come from a stable sort of the labelled flags."""
        if self.total != hidden.shape[0]:
            name = "labels" if self._shift else "shift_labels"
            raise ValueError(mismatch(name, self._given, hidden.shape[0], f"{hidden.shape[0]} hidden states"))
        count = self.kept()
        labels = self.labels.to(hidden.device)
        if count is None:
            return hidden, labels
        # labelled rows first, each group in its original order
        order = torch.argsort((labels == IGNORE_INDEX).to(torch.uint8), stable=True)[:count]
        return hidden.index_select(0, order), labels.index_select(0, order)
