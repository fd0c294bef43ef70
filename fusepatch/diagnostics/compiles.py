"""Count the Triton kernel variants a process builds while it trains.

A kernel that specializes on a size which changes from step to step (a packed row's length; rows = tokens x
heads) is compiled again for each new value, and an autotuned one also benchmarks every configuration again.
A profile shows only the symptom (thousands of extra kernels and ops in one layer, the GPU idle, as in packed
SFT, whose row lengths change every step); this counter names the cause. Triton calls
``knobs.runtime.jit_post_compile_hook`` each time a process builds a kernel variant it does not hold in memory
(compiled, or loaded from the on-disk cache), so counts after the first steps mean sizes that keep changing.
"""

from __future__ import annotations

import collections
from typing import Any


def _runtime_knobs() -> Any | None:
    """``triton.knobs.runtime`` where this Triton has the compile hook (3.4 and later), else None."""
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton, or one too old to have knobs: nothing to count
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


class CompileCounter:
    """Counts Triton kernel builds by kernel name while installed; chains to a hook installed before it."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._runtime: Any | None = None
        self._previous: Any | None = None
        self._hook: Any | None = None

    @property
    def active(self) -> bool:
        return self._hook is not None

    def install(self) -> bool:
        """Start counting; False when this Triton offers no hook (nothing is counted then)."""
        if self._hook is not None:
            return True
        runtime = _runtime_knobs()
        if runtime is None:
            return False
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            self.counts[str(getattr(fn, "name", None) or "?")] += 1
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        self._runtime, self._previous, self._hook = runtime, previous, hook
        return True

    def remove(self) -> None:
        """Stop counting and put back the hook that was there before (unless someone replaced ours since)."""
        if self._hook is None:
            return
        if self._runtime.jit_post_compile_hook is self._hook:
            self._runtime.jit_post_compile_hook = self._previous
        self._runtime = self._previous = self._hook = None

    def since(self, before: collections.Counter[str]) -> collections.Counter[str]:
        """The builds counted after ``before`` (a copy of ``counts`` taken earlier)."""
        return self.counts - before


def describe(builds: collections.Counter[str], top: int = 3) -> str:
    """``"38 Triton kernel builds (layer_norm_fwd_kernel 20, layer_norm_bwd_kernel 18)"``."""
    names = ", ".join(f"{name} {count}" for name, count in builds.most_common(top))
    total = sum(builds.values())
    return f"{total} Triton kernel build{'' if total == 1 else 's'} ({names})"
