"""Packed rows (several documents in one sequence): find the boundaries the kernels must respect."""

from __future__ import annotations

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


class PackedSequenceError(ValueError):
    """A packed batch would let attention cross a document boundary."""


def attention_crosses_documents(attention_mask, cu_seqlens: torch.Tensor, implementation: str) -> bool:
    """Whether full attention under ``attention_mask`` lets a document's first token see the previous document.

    Flash-attention implementations take the boundaries from ``position_ids`` themselves; a 4D mask is
    probed at each boundary; no mask at all means plain causal attention over the whole row.
    """
    if "flash" in implementation:
        return False
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4:
        return True
    row_length = attention_mask.shape[-2]
    for start in cu_seqlens[1:-1].tolist():
        row, col = start % row_length, (start - 1) % row_length
        if start // row_length != (start - 1) // row_length:
            continue  # the boundary is a row start: nothing to cross
        allowed = attention_mask[start // row_length if attention_mask.shape[0] > 1 else 0, 0, row, col]
        if bool(allowed) if attention_mask.dtype == torch.bool else bool(allowed == 0):
            return True
    return False


def decoder_layer_forward(self, *args, **kwargs):
    """Decoder-layer wrapper for hybrid models: hand packed-document boundaries from ``position_ids`` to the
    linear-attention sub-layer (transformers passes it no positions), refuse a packed batch whose full
    attention mask would cross documents, then run the layer's own forward unchanged."""
    state = self._fusepatch
    linear = getattr(self, "linear_attn", None)
    cu = kwargs.get("cu_seq_lens_q")
    derived = cu is None
    if derived:
        cu = cu_seqlens_from_position_ids(kwargs.get("position_ids"))
    if cu is None:
        return state.original(*args, **kwargs)
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
        return state.original(*args, **kwargs)
    # The boundaries travel as transformers' own varlen argument, so that an activation-checkpoint recompute
    # (transformers >= 5.2x checkpoints the layer's original forward, below this wrapper) sees them too.
    # Flash attention reads them only with cu_seq_lens_k and the max lengths; sdpa and eager ignore them.
    return state.original(*args, cu_seq_lens_q=cu, **kwargs)
