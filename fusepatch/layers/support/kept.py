"""What a patched forward keeps between calls (``PatchState.cache``: an FP8 projection's frozen weight, quantized),
numbered. Every copy made anew or let go takes a new generation, which ``layers/layer_graphs.py`` compares before a
replay: a CUDA graph reads the memory of the copy it was captured with, and a copy let go frees that memory."""

from __future__ import annotations

import itertools
from typing import Any

_generations = itertools.count(1)  # process-wide: a copy let go and one made after never share a number


def keep(cache: dict[str, Any], key: str, value: Any) -> Any:
    """``cache[key] = value``, a new generation; returns ``value``."""
    cache[key] = value
    cache["generation"] = next(_generations)
    return value


def forget(cache: dict[str, Any], key: str) -> None:
    """Let ``cache[key]`` go (a new generation when there was one)."""
    if cache.pop(key, None) is not None:
        cache["generation"] = next(_generations)


def generation(cache: dict[str, Any]) -> int:
    """The cache's generation: 0 while nothing was kept."""
    return cache.get("generation", 0)
