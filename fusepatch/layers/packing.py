"""Packed rows (several documents in one sequence): find the boundaries the kernels must respect."""

from __future__ import annotations

import threading
import weakref

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Document boundaries of a padding-free batch, over the batch flattened to one row.

    A document starts wherever ``position_ids`` is 0 (and at every row start). Returns ``None`` when no row
    holds more than one document, so ordinary batches keep their fast equal-length path.
    """
    if position_ids is None:
        return None
    if position_ids.ndim == 3:  # mrope: [3 or 4, B, T]; the text positions lead
        position_ids = position_ids[0]
    if position_ids.ndim != 2 or position_ids.shape[1] < 2:
        return None
    restarts = position_ids[:, 1:] == 0
    if not bool(restarts.any()):
        return None
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = restarts
    flat = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    total = torch.tensor([position_ids.numel()], device=flat.device, dtype=flat.dtype)
    return torch.cat([flat, total]).to(torch.int32)


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
    if any(t.is_inference() for t in tensors):  # inference tensors keep no version counter
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


def boundaries_for_call(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens_from_position_ids``, computed once per ``position_ids`` tensor (see ``_once_per_call``)."""
    if position_ids is None:
        return None
    return _once_per_call("boundaries", (position_ids,), lambda: cu_seqlens_from_position_ids(position_ids))


class PackedSequenceError(ValueError):
    """A packed batch would let attention cross a document boundary."""


def attention_crosses_documents(attention_mask, cu_seqlens: torch.Tensor, implementation: str) -> bool:
    """Whether full attention under ``attention_mask`` lets a document's first token see the previous document.

    Flash-attention implementations take the boundaries from ``position_ids`` themselves; a 4D mask is
    probed at every boundary at once (one wait for the GPU, once per forward); no mask at all means plain
    causal attention over the whole row.
    """
    if "flash" in implementation:
        return False
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4:
        return True
    return _once_per_call("crosses", (attention_mask, cu_seqlens), lambda: _mask_crosses(attention_mask, cu_seqlens))


def _mask_crosses(attention_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    starts = cu_seqlens[1:-1].to(device=attention_mask.device, dtype=torch.long)
    if starts.numel() == 0:
        return False
    row_length = attention_mask.shape[-2]
    row = starts // row_length
    same_row = row == (starts - 1) // row_length  # a boundary at a row start has nothing to cross
    batch = row if attention_mask.shape[0] > 1 else torch.zeros_like(row)
    allowed = attention_mask[batch, 0, starts % row_length, (starts - 1) % row_length]
    if attention_mask.dtype != torch.bool:
        allowed = allowed == 0  # additive mask: 0 lets the query see the key
    return bool((allowed & same_row).any())


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
            raise PackedSequenceError(
                "fusepatch: this batch packs several documents in a row (position_ids restart at 0), but the "
                f"{implementation} attention mask transformers built lets them attend across boundaries. "
                "Fix: call the model with use_cache=False and no attention_mask (DataCollatorWithFlattening "
                "does this), or use attn_implementation='flash_attention_2'."
            )
    if linear is None or not derived:
        return kwargs
    # The boundaries travel as transformers' own varlen argument, so that an activation-checkpoint recompute
    # (transformers >= 5.2x checkpoints the layer's original forward, below this wrapper) sees them too.
    # Flash attention reads them only with cu_seq_lens_k and the max lengths; sdpa and eager ignore them.
    return {**kwargs, "cu_seq_lens_q": cu}
