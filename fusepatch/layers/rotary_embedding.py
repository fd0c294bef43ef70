"""Rotary embedding tables: cos/sin of plain positions computed once and reused across steps.

transformers recomputes cos/sin from ``position_ids`` on every forward (5.17's Qwen3.5: a float ``bmm``, ``cos``,
``sin``, two scalings, the mrope slices and ``cat``s, two casts). Those small kernels run between a step's start
and layer 0's first GEMM, where nothing else is queued and the GPU waits on each launch.

For the plain positions fusepatch's causal-LM forward builds (``0..T-1`` in every row, layers/support/positions.py) the
tables depend only on the positions' shape, ``x``'s dtype and device, and the module's ``inv_freq`` and
``attention_scaling``. So the first call runs transformers' own forward and later calls with the same key get its
result: the same tensors, bit for bit. Anything else runs transformers' forward: positions the caller gave (or a
view that is not the whole ``arange``), a rope type that changes ``inv_freq`` with the length (dynamic,
longrope) or one this module does not know, a replaced or changed ``inv_freq``, inference mode, ``torch.compile``
tracing, extra arguments, and tables changed in place since they were kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusepatch.layers.support.positions import is_whole_plain, remember

STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # inv_freq and scaling fixed after __init__
KEPT = 2  # tables kept per module (a training run has one length; an eval pass may add one)
TABLES = "_fusepatch_rope_tables"  # the module attribute that holds them


@dataclass
class _Tables:
    cos: torch.Tensor
    sin: torch.Tensor
    versions: tuple[int, int]
    inv_freq: torch.Tensor  # the buffer they came from, held so that a replaced buffer cannot reuse its address

    def usable(self, inv_freq: torch.Tensor) -> bool:
        return inv_freq is self.inv_freq and (self.cos._version, self.sin._version) == self.versions


def _key(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple | None:
    """The tables' key, or None when they must be computed (see the module docstring)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return None
    if getattr(self, "rope_type", None) not in STATIC_ROPE_TYPES or not is_whole_plain(position_ids):
        return None
    inv_freq = getattr(self, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.requires_grad:
        return None
    scaling = getattr(self, "attention_scaling", 1.0)
    return (tuple(position_ids.shape), x.dtype, x.device, inv_freq._version, float(scaling))


def rotary_embedding_forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """transformers' rotary embedding ``forward(x, position_ids)`` -> ``(cos, sin)``, kept for plain positions."""
    key = None if args or kwargs else _key(self, x, position_ids)
    if key is None:
        return self._fusepatch.original(x, position_ids, *args, **kwargs)
    tables: dict = self.__dict__.setdefault(TABLES, {})
    kept = tables.get(key)
    if kept is not None and kept.usable(self.inv_freq):
        return kept.cos, kept.sin
    cos, sin = self._fusepatch.original(x, position_ids)
    if cos.requires_grad or sin.requires_grad:  # never the case for a buffer's tables; kept out to be sure
        return cos, sin
    remember(tables, key, _Tables(cos, sin, (cos._version, sin._version), self.inv_freq), KEPT)
    return cos, sin
