"""Packed-row boundaries (``cu_seqlens``) as the kernels need them: their host values, tensors derived from them
once per forward, and each token's document. A leaf: the ops and the layers' packing helpers both use it."""

from __future__ import annotations

from collections.abc import Callable

import torch

_HOST_VALUES = "_fusepatch_host_values"


def host_values(cu_seqlens: torch.Tensor) -> tuple[int, ...] | None:
    """The values of boundaries that :func:`cu_seqlens_from_position_ids` made, as host integers read in its one
    wait; ``None`` for boundaries from elsewhere (a caller's ``cu_seq_lens_q``, a copy to another device)."""
    return getattr(cu_seqlens, _HOST_VALUES, None)


_HOST_BUILT = "_fusepatch_host_built"


def host_built(
    cu_seqlens: torch.Tensor, key: str, build: Callable[[tuple[int, ...]], torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """A tensor a kernel needs, derived from the boundaries: ``build(host_values)`` on the host, copied to
    ``device`` without a wait (from pinned memory), and kept on the boundaries tensor under ``key``, so the
    layers of a forward, its recompute and its backward share one. ``None`` where the host values are not known
    (the caller then derives it from the GPU tensor).

    The builders use NumPy, not torch: torch's CPU ``repeat_interleave`` opens an OpenMP parallel region even for
    eight documents, and in a packed step the GPU sits idle inside those host calls; NumPy's ``repeat`` is
    single-threaded."""
    host = host_values(cu_seqlens)
    if host is None:
        return None
    kept = cu_seqlens.__dict__.setdefault(_HOST_BUILT, {})
    tensor = kept.get((key, device))
    if tensor is None:
        tensor = build(host)
        tensor = tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)
        kept[(key, device)] = tensor
    return tensor


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The document index of each of ``total`` flattened tokens (0 for the first document)."""
    marks = torch.zeros(total, dtype=torch.int32, device=cu_seqlens.device)
    starts = cu_seqlens[1:-1].long().clamp_max(total - 1)  # boundaries past ``total``: the caller checks cu[-1]
    marks.index_add_(0, starts, torch.ones_like(starts, dtype=torch.int32))
    return marks.cumsum(0)


def block_causal_rows(docs: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Rows ``first:last`` of the mask a varlen kernel computes over tokens of documents ``docs``: a query sees
    the keys of its own document up to itself."""
    position = torch.arange(docs.numel(), device=docs.device)
    return (docs[first:last, None] == docs[None, :]) & (position[None, :] <= position[first:last, None])
