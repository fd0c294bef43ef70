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


def decoder_layer_forward(self, *args, **kwargs):
    """Decoder-layer wrapper: hand packed-document boundaries from ``position_ids`` to the linear-attention
    sub-layer (transformers passes it no positions), then run the layer's own forward unchanged."""
    state = self._fusepatch
    linear = getattr(self, "linear_attn", None)
    cu = None
    if linear is not None and kwargs.get("cu_seq_lens_q") is None and kwargs.get("past_key_values") is None:
        cu = cu_seqlens_from_position_ids(kwargs.get("position_ids"))
    if cu is None:
        return state.original(*args, **kwargs)
    linear._fusepatch_cu_seqlens = cu
    try:
        return state.original(*args, **kwargs)
    finally:
        linear._fusepatch_cu_seqlens = None
