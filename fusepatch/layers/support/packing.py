"""Packed rows (several documents in one sequence): find the boundaries the kernels must respect."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from fusepatch.layers.support.positions import _root, is_plain
from fusepatch.layers.support.signature import CACHE_NAMES
from fusepatch.ops.boundaries import _HOST_VALUES, block_causal_rows, document_ids


def cu_seqlens_from_position_ids(
    position_ids: torch.Tensor | None, valid: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Document boundaries of a packed batch, over the batch flattened to one row.

    A document starts wherever ``position_ids`` is 0 (and at every row start). With ``valid`` (the call's 2D
    attention mask) a padded token starts nothing, nor does a row's first real token: generation's left padding
    (``[1, 1, 1, 0, 1, 2]``) and collators that pad positions with 0 (``[0, 1, 2, 3, 0, 0]``) are padded rows,
    not packed ones, as transformers reads them. Returns ``None`` when no row holds more than one document, so
    ordinary batches keep their fast equal-length path.
    """
    if position_ids is None:
        return None
    if position_ids.ndim == 3:  # mrope: [3 or 4, B, T]; the text positions lead
        position_ids = position_ids[0]
    if position_ids.ndim != 2 or position_ids.shape[1] < 2:
        return None
    # One wait for the GPU (nonzero's count), and no host-to-device copy: the end offset is written by a fill
    # kernel, not copied from a host tensor (a pageable copy waits for the stream too, as does an `any()`).
    starts = position_ids == 0
    if valid is not None and valid.shape == position_ids.shape:
        valid = valid.to(device=position_ids.device, dtype=torch.bool)
        starts &= valid & (valid.cumsum(-1) > 1)
    starts[:, 0] = True
    flat = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    if flat.numel() == position_ids.shape[0]:  # one document a row: the ordinary batch
        return None
    total = flat.new_full((1,), position_ids.numel())
    cu_seqlens = torch.cat([flat, total]).to(torch.int32)
    # The values on the host too: nonzero's count has just emptied the GPU's queue, so this copy adds no wait
    # of its own, and kernels that need them on the host (fla's chunk table) need not wait again.
    setattr(cu_seqlens, _HOST_VALUES, (*flat.tolist(), position_ids.numel()))
    return cu_seqlens


_MEMO_ENTRIES = 4  # per slot: the last few calls' tensors (a forward, its recompute, a second replica)
_memo: dict[str, list] = {}
_memo_lock = threading.Lock()


def _once_per_call(slot: str, tensors: tuple[torch.Tensor, ...], compute):
    """``compute()``, remembered for the last few ``tensors`` seen in ``slot`` (same objects, not changed in
    place since). Every decoder layer of one forward gets the same ``position_ids`` and mask tensors, and the
    checks below wait for the GPU; once per layer, those waits kept the GPU idle while the CPU refilled its
    queue after each (24 times a forward in a 24-layer model), once per forward they cost one. Shared by
    threads: an activation-checkpoint recompute runs in the autograd engine's thread with the forward's own
    tensors, and found nothing in a per-thread memo (a trace of the two-GPU SFT run showed the recompute's waits).
    The same ``cu_seqlens`` object for every layer also lets fla reuse the chunk indices it caches per tensor."""
    # inference tensors keep no version counter; a traced graph (torch.compile) computes it in its graph
    if torch.compiler.is_compiling() or any(t.is_inference() for t in tensors):
        return compute()
    versions = tuple(t._version for t in tensors)
    with _memo_lock:
        for refs, seen, result in _memo.get(slot, ()):
            if seen == versions and len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors)):
                return result
    result = compute()
    entry = (tuple(weakref.ref(t) for t in tensors), versions, result)
    with _memo_lock:
        entries = _memo.setdefault(slot, [])
        entries.insert(0, entry)
        del entries[_MEMO_ENTRIES:]
    return result


_traced_plain = False  # see traced_plain_call


def traced_plain_call(value: bool) -> bool:
    """Say (``True``) that the causal-LM call being traced by torch.compile has one document a row (it was given
    no positions, mask, cache or varlen boundaries), or clear it; returns what was said before. A traced graph
    cannot read the positions' marks (:func:`is_plain`), and finding document starts in the data (``nonzero``)
    splits the graph at every layer; dynamo traces this flag as the Python value it is."""
    global _traced_plain
    previous, _traced_plain = _traced_plain, value
    return previous


def boundaries_for_call(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens_from_position_ids``, computed once per ``position_ids`` tensor (see ``_once_per_call``) and the
    padding mask noted on it (:func:`note_padding`); no read of the GPU at all for the positions the fused forward
    made (layers/support/positions.py), nor in a traced call known to hold one document a row."""
    if position_ids is None or is_plain(position_ids) or (_traced_plain and torch.compiler.is_compiling()):
        return None
    valid = getattr(_root(position_ids), _PADDING, None)
    tensors = (position_ids,) if valid is None else (position_ids, valid)
    return _once_per_call("boundaries", tensors, lambda: cu_seqlens_from_position_ids(position_ids, valid))


_PADDING = "_fusepatch_padding"


def note_padding(position_ids, attention_mask) -> None:
    """Keep a call's 2D attention mask on its ``position_ids``, where the decoder layers look for document starts:
    the layers see only their own masks (4D for full attention), but padding is told apart from packing by the mask
    the caller gave. The base model's forward notes it for every head (layers/base_model.py). A call without one
    clears what an earlier call left."""
    if not isinstance(position_ids, torch.Tensor):
        return
    root = _root(position_ids)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
    # (an attribute set to None, not removed: torch.compile traces setattr on a tensor, not its __dict__)
    setattr(root, _PADDING, None if mask is None or mask.shape != position_ids.shape[-2:] else mask)


class PackedSequenceError(ValueError):
    """A packed batch would let attention cross a document boundary."""


_LEAKS = (
    "fusepatch: this batch packs several documents in a row (position_ids restart at 0), but {what} lets them "
    "attend across boundaries. Fix: call the model with use_cache=False and no attention_mask "
    "(DataCollatorWithFlattening does this), or use attn_implementation='flash_attention_2'."
)


@dataclass(frozen=True)
class MaskPlan:
    """What a packed batch's 4D attention mask allows, read from the GPU once per forward.

    ``crosses``: a document's first token may see the previous document (the mask is wrong for packing).
    ``block_causal``: the mask is exactly causal within each document and nothing else (no padding, no
    window), which is what a varlen kernel over the boundaries computes. ``longest``: the longest document
    (a varlen kernel's ``max_seqlen``).
    """

    crosses: bool
    block_causal: bool
    longest: int


_QUERY_ROWS = 1 << 26  # mask elements compared at once (64 Mi bools), so a 32k-token row never holds S x S twice


def mask_plan(attention_mask, cu_seqlens: torch.Tensor) -> MaskPlan | None:
    """The :class:`MaskPlan` of a 4D mask (bool, or additive with 0 = may attend) for packed ``cu_seqlens``;
    ``None`` for no mask or another layout. One wait for the GPU, once per mask tensor (``_once_per_call``)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4:
        return None
    return _once_per_call("mask_plan", (attention_mask, cu_seqlens), lambda: _plan(attention_mask, cu_seqlens))


def _plan(attention_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> MaskPlan:
    device = attention_mask.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    batch, _, queries, keys = attention_mask.shape
    total = queries * max(batch, 1)
    starts = cu[1:-1]
    crosses = torch.zeros((), dtype=torch.bool, device=device)
    if starts.numel():
        row = starts // queries
        same_row = row == (starts - 1) // queries  # a boundary at a row start has nothing to cross
        b = row if batch > 1 else torch.zeros_like(row)
        allowed = _allowed(attention_mask[b, 0, starts % queries, (starts - 1) % queries])
        crosses = (allowed & same_row).any()
    mismatch = torch.zeros((), dtype=torch.bool, device=device)
    if keys == queries:  # (a cache's longer key axis is never plain packing)
        docs = document_ids(cu, total).view(max(batch, 1), queries)
        step = max(1, _QUERY_ROWS // keys)
        for r in range(batch):
            for first in range(0, queries, step):
                last = min(first + step, queries)
                expected = block_causal_rows(docs[r], first, last)
                mismatch |= (_allowed(attention_mask[r, 0, first:last]) != expected).any()
    longest = (cu[1:] - cu[:-1]).max() if cu.numel() > 1 else torch.zeros((), dtype=torch.long, device=device)
    crossed, mismatched, length, tokens = torch.stack([crosses.long(), mismatch.long(), longest, cu[-1]]).tolist()
    exact = keys == queries and tokens == total and not mismatched and not crossed
    return MaskPlan(bool(crossed), exact, int(length))


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0  # additive mask: 0 lets the query see the key


def attention_crosses_documents(attention_mask, cu_seqlens: torch.Tensor, implementation: str) -> bool:
    """Whether full attention under ``attention_mask`` lets a document's first token see the previous document.

    Flash-attention implementations take the boundaries from ``position_ids`` themselves; a 4D mask is
    probed at every boundary at once (one wait for the GPU, once per forward, shared with the attention
    layer's varlen routing); no mask at all means plain causal attention over the whole row.
    """
    if "flash" in implementation:
        return False
    plan = mask_plan(attention_mask, cu_seqlens)
    return True if plan is None else plan.crosses


def packed_kwargs(self, args: tuple, kwargs: dict) -> dict:
    """For a hybrid decoder layer's call: hand packed-document boundaries from ``position_ids`` to the
    linear-attention sub-layer (transformers passes it no positions), and refuse a packed batch whose full
    attention mask would cross documents. Returns the keyword arguments the layer's forward should get."""
    linear = getattr(self, "linear_attn", None)
    cu = kwargs.get("cu_seq_lens_q")
    derived = cu is None
    if derived:
        cu = boundaries_for_call(kwargs.get("position_ids"))
    if cu is None:
        return kwargs
    if getattr(self, "self_attn", None) is not None:
        implementation = str(getattr(self.self_attn.config, "_attn_implementation", "eager"))
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if attention_crosses_documents(mask, cu, implementation):
            raise PackedSequenceError(_LEAKS.format(what=f"the {implementation} attention mask transformers built"))
    elif derived and any(kwargs.get(name) is not None for name in CACHE_NAMES):
        # a linear-attention layer given a cache runs transformers' cached path, whose state crosses documents
        raise PackedSequenceError(_LEAKS.format(what="the cache (use_cache=True) that the linear attention fills"))
    if linear is None or not derived:
        return kwargs
    # The boundaries travel as transformers' own varlen argument, so that an activation-checkpoint recompute
    # (transformers >= 5.2x checkpoints the layer's original forward, below this wrapper) sees them too.
    # Flash attention reads them only with cu_seq_lens_k and the max lengths; sdpa and eager ignore them.
    return {**kwargs, "cu_seq_lens_q": cu}
