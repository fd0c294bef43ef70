"""Plain positions: a batch with no ``position_ids``, no ``attention_mask`` and no cache holds one document a row
at positions ``0..T-1``, and fusepatch knows it without asking the GPU.

transformers builds those positions itself and then checks them for packed documents
(``masking_utils.find_packed_sequence_indices``: ``.all()`` read on the host), and fusepatch's decoder layers looked
for document starts (a ``nonzero``). Each read waits for the GPU to finish everything queued before it. In a
training loop that does not wait between steps, the forward's first wait also waits for the previous step's
optimizer, and the GPU then idles while the CPU refills the queue.

So the fused causal-LM forward builds the positions transformers would build, marks the tensor, and both checks
answer "not packed" for it and every view of it, without a read. A tensor changed in place since (its version
counter moved) or any other tensor gets the checks as before.
"""

from __future__ import annotations

import functools

import torch

_MARK = "_fusepatch_plain_positions"


_KEPT = 8  # aranges kept for reuse (one per length and device; a varying length keeps the latest few)
_aranges: dict[tuple, torch.Tensor] = {}


def plain_positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``[batch, length]`` positions ``0..length-1`` in every row (a view of one ``arange``), marked plain.

    The ``arange`` of a length is made once and reused while it is unchanged (its version counter): one launch
    less at the start of every step, where the GPU waits on each one (layers/rotary_embedding.py says why)."""
    if torch.compiler.is_compiling():  # a traced graph makes its own (no cache lookups to guard on)
        return _marked_arange(length, device).unsqueeze(0).expand(batch, length)
    key = (length, torch.device(device))
    base = _aranges.get(key)
    if base is None or getattr(base, _MARK, None) != base._version:
        base = remember(_aranges, key, _marked_arange(length, device), _KEPT)
    return base.unsqueeze(0).expand(batch, length)


def _marked_arange(length: int, device: torch.device) -> torch.Tensor:
    base = torch.arange(length, device=device)
    setattr(base, _MARK, base._version)
    return base


def remember(store: dict, key, value, limit: int):
    """``store[key] = value`` as the newest entry, dropping the oldest beyond ``limit``; returns ``value``."""
    store.pop(key, None)
    while len(store) >= limit:
        store.pop(next(iter(store)))
    store[key] = value
    return value


def _root(positions: torch.Tensor) -> torch.Tensor:
    return positions if positions._base is None else positions._base


def is_plain(positions: torch.Tensor | None) -> bool:
    """Whether ``positions`` is (a view of) a tensor made by :func:`plain_positions`, unchanged since. A view with
    unit stride along the sequence holds consecutive positions, as the tensor does: no document starts inside it,
    which is what both checks would find."""
    if not isinstance(positions, torch.Tensor):
        return False
    if torch.compiler.is_compiling():  # traced graphs keep transformers' own checks (it skips them there too)
        return False
    if positions.is_inference():  # made in inference mode: no version counter to trust (and none of ours)
        return False
    if positions.ndim == 0 or positions.stride(-1) != 1:  # a strided view (every other position) is not 0, 1, 2..
        return False
    root = _root(positions)
    mark = getattr(root, _MARK, None)
    return mark is not None and mark == root._version


def is_whole_plain(positions: torch.Tensor | None) -> bool:
    """Whether ``positions`` holds exactly ``0..T-1`` in every row: plain (:func:`is_plain`), and a view that
    only adds broadcast dimensions to the whole ``arange`` (no tail, no slice), as transformers' ``expand`` and
    Qwen3.5's mrope rows make. Values, not only the absence of document starts, are then known on the host."""
    if not is_plain(positions):
        return False
    root = _root(positions)
    return (
        positions.storage_offset() == root.storage_offset()
        and positions.shape[-1] == root.numel()
        and all(stride == 0 or size == 1 for size, stride in zip(positions.shape[:-1], positions.stride()[:-1]))
    )


def wants_plain_positions(
    position_ids, attention_mask, past_key_values, kwargs: dict, reference: torch.Tensor | None, marked: bool = True
) -> bool:
    """Whether a causal-LM call may get :func:`plain_positions`: nothing that says otherwise was given (positions,
    a mask, a cache or cache positions, precomputed varlen boundaries). ``marked=False``: whether its rows hold
    one document each, for a traced call that marks no tensor (torch.compile cannot ask for inference mode)."""
    return (
        (not marked or not torch.is_inference_mode_enabled())  # inference tensors keep no version counter to mark
        and position_ids is None
        and attention_mask is None
        and past_key_values is None
        and reference is not None
        and reference.ndim >= 2
        and all(kwargs.get(name) is None for name in ("cache", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k"))
    )


MASKING = "transformers.masking_utils"
FIND_PACKED = "find_packed_sequence_indices"


def skip_plain(original):
    """transformers' ``find_packed_sequence_indices`` that answers plain positions without reading the GPU
    (``None``: not packed, what it returns for them); other positions go to transformers'."""

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor):
        if is_plain(position_ids):
            return None
        return original(position_ids)

    return find_packed_sequence_indices
