"""Python's garbage collector during training: what its pauses cost, and keeping it off the long-lived objects.

A training process holds millions of Python objects that live as long as it does: the model's modules and
parameters, the imported packages (Triton, fla, TileLang and its TVM), compiled kernels and their caches. Every
full (generation 2) collection walks all of them while the host stops enqueueing work. At Qwen3.5-27B's full depth
with LoRA and activation checkpointing on one H100 (docs/benchmarks.md) the step's own allocations set one off
every 8 steps, 376 to 507 ms each, in every configuration measured. ``gc.freeze()`` moves the objects alive at that
moment out of every later collection's walk: later full collections look only at what training created since, and
the frozen ones go back under the collector when training ends (``thaw``).
"""

from __future__ import annotations

import collections
import gc
import time
from typing import NamedTuple

from fusepatch.base.state import current as process_state


class Collected(NamedTuple):
    """Collections over a stretch of time: how many of each generation, and their seconds in all."""

    by_generation: dict[int, int]
    seconds: float

    @property
    def count(self) -> int:
        return sum(self.by_generation.values())

    @property
    def oldest(self) -> int:
        """The oldest generation collected (2: a full collection), -1 for none."""
        return max((g for g, n in self.by_generation.items() if n), default=-1)


class CollectorPauses:
    """Counts Python's garbage collections by generation, and the time they took, while installed."""

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.seconds: collections.Counter[int] = collections.Counter()
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self._callback in gc.callbacks

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def reset(self) -> None:
        """Count from zero (a new training)."""
        self.counts.clear()
        self.seconds.clear()

    def install(self) -> None:
        if not self.active:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self.active:
            gc.callbacks.remove(self._callback)

    def total(self) -> Collected:
        """The collections so far (``since`` takes the difference to a later point)."""
        return Collected(dict(self.counts), sum(self.seconds.values()))

    def since(self, before: Collected) -> Collected:
        """The collections after ``before`` (an earlier ``total()``)."""
        now = self.total()
        grew = {g: n - before.by_generation.get(g, 0) for g, n in now.by_generation.items()}
        return Collected({g: n for g, n in grew.items() if n}, now.seconds - before.seconds)

    def describe(self) -> str:
        """``"3 of generation 2 (1,204 ms), 40 of generation 0 (12 ms)"``: the slowest generation first."""
        order = sorted(self.counts, key=lambda g: -self.seconds[g])
        return ", ".join(f"{self.counts[g]} of generation {g} ({self.seconds[g] * 1000:,.0f} ms)" for g in order)


class LongLivedFreeze:
    """``freeze()`` collects once and freezes what survives (``gc.freeze``); ``thaw()`` unfreezes, unless objects
    were already frozen before ``freeze`` (the program froze them itself: ``gc.unfreeze`` cannot tell them apart, so
    all stay frozen). A training that raised never thaws: ``thaw_abandoned`` unfreezes its objects, which the
    process state marks, when the next one begins."""

    def __init__(self) -> None:
        self.frozen = 0  # objects this freeze moved out of the collector's walks
        self._ours = False

    @property
    def ours(self) -> bool:
        """Whether ``thaw`` will unfreeze (nothing was frozen before ``freeze``)."""
        return self._ours

    def freeze(self) -> int:
        before = gc.get_freeze_count()
        gc.collect()  # garbage is not frozen with the rest: it would stay until the end
        gc.freeze()
        self.frozen = gc.get_freeze_count() - before
        self._ours = before == 0
        if self._ours:
            process_state().gc_frozen = True
        return self.frozen

    def thaw(self) -> None:
        if self._ours:
            gc.unfreeze()
            process_state().gc_frozen = False
        self._ours = False

    @staticmethod
    def thaw_abandoned() -> int:
        """Unfreeze what a training froze and, having raised, never thawed; returns how many objects (0: none)."""
        state = process_state()
        if not state.gc_frozen:
            return 0
        count = gc.get_freeze_count()
        gc.unfreeze()
        state.gc_frozen = False
        return count
