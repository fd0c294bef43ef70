"""A linear-attention layer's states in transformers' cache, read and written through the cache's own methods.

transformers 5.17 through 5.25 keep a Gated DeltaNet layer's conv window and recurrent state in
``cache.layers[layer_idx]`` (``conv_states[0]``, ``recurrent_states[0]``, ``has_previous_state``, ``record_past``)
and fill them with ``cache.update_conv_state(x, layer_idx, conv_kernel_size=...)`` (the last ``kernel_size``
inputs, counted into the cache's length) and ``cache.update_recurrent_state(state, layer_idx)``. The fused forward
uses exactly those, so a cache it filled is one transformers' own forward would have filled. A cache this module
does not know (another class, a speculative-decoding cache that records past states) is :func:`unsupported`, and
the layer runs transformers' forward for it.
"""

from __future__ import annotations

import torch


def unsupported(cache, layer_idx: int) -> str | None:
    """Why the fused forward cannot fill this cache itself, or None when it can."""
    layers = getattr(cache, "layers", None)
    if not all(hasattr(cache, name) for name in ("update_conv_state", "update_recurrent_state", "has_previous_state")):
        return f"a cache without linear-attention states ({type(cache).__name__})"
    if layers is None or layer_idx >= len(layers) or not hasattr(layers[layer_idx], "recurrent_states"):
        return f"a cache whose layer {layer_idx} keeps no linear-attention states ({type(cache).__name__})"
    if getattr(layers[layer_idx], "record_past", False):
        return "a cache that records past states (speculative decoding)"
    return None


def previous_recurrent_state(cache, layer_idx: int) -> torch.Tensor | None:
    """The recurrent state a continuation starts from, or None when the cache holds none for this layer yet."""
    if not cache.has_previous_state(layer_idx, state_idx=0):
        return None
    return cache.layers[layer_idx].recurrent_states[0]


def store_conv_window(cache, layer_idx: int, inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Keep the last ``kernel_size`` conv inputs (``inputs``: ``[B, T, D]``) in the cache, as transformers does;
    returns the window the conv must run over: the previous window followed by ``inputs`` for a continuation,
    ``inputs`` itself for a first call (a causal conv over zero-padding gives the same outputs)."""
    full = cache.update_conv_state(inputs.transpose(1, 2), layer_idx, conv_kernel_size=kernel_size)
    return full.transpose(1, 2)


def conv_window(cache, layer_idx: int) -> torch.Tensor:
    """The conv inputs the cache keeps for this layer, ``[B, D, kernel_size]`` (written in place)."""
    return cache.layers[layer_idx].conv_states[0]


def store_recurrent_state(cache, layer_idx: int, state: torch.Tensor) -> None:
    cache.update_recurrent_state(state, layer_idx)
