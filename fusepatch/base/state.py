"""What fusepatch remembers across calls in one process, in one object.

Self-test verdicts (a kernel is tested once per process and shape), the drift lines of foreign packages, the
reasons and notes already said (each once), the rows and candidates users added, the environment snapshot, and the
foreign module-level names ``apply`` replaced (``bindings``), and whether a training's ``gc.freeze`` is still in
effect. Nothing else in the package keeps state between models; tests run each case in a :func:`fresh` state.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fusepatch.base.log import SaidOnce


@dataclass
class Installed:
    """A foreign module-level name ``apply`` replaced: the object found there, the wrapper put in its place, and
    the patched modules whose rows declared it, held weakly (a model dropped without ``revert`` leaves the set by
    itself, and the next ``apply`` or ``revert`` puts the object back: ``layers/support/bindings.py``)."""

    original: object
    wrapper: object
    holders: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def put_back(self, module: str, name: str) -> None:
        """The object found back in ``module.name``, unless someone replaced the wrapper since (theirs stays)."""
        found = sys.modules.get(module)  # imported when installed; gone only while the interpreter shuts down
        if found is not None and getattr(found, name, None) is self.wrapper:
            setattr(found, name, self.original)


@dataclass
class ProcessState:
    said: SaidOnce = field(default_factory=SaidOnce)  # fallback reasons and one-time notes said at WARNING/INFO
    selftests: dict[tuple, Any] = field(default_factory=dict)  # (op, candidate, device, dtype, ...) -> Verdict
    drift: list[str] = field(default_factory=list)  # every drift line reported, for the patch report
    user_rows: list[Any] = field(default_factory=list)  # fusepatch.register(...), checked before the built-in rows
    user_candidates: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)  # op -> (first, last) added
    environment: Any = None  # the captured Environment, once taken
    bindings: dict[tuple[str, str], Installed] = field(default_factory=dict)  # (module, name) -> what is there now
    gc_frozen: bool = False  # the objects now frozen (gc.freeze) are a training's, not yet unfrozen: it raised


_current = ProcessState()


def current() -> ProcessState:
    """The process's state."""
    return _current


@contextlib.contextmanager
def fresh(state: ProcessState | None = None) -> Iterator[ProcessState]:
    """Run with ``state`` (default: an empty one) as the process's state, and put the previous one back after.

    transformers' modules belong to the process, not to a state: the names replaced while ``state`` was current
    get their objects back on leaving (newest first), so the process's modules are as the previous state left
    them. A model patched inside and used after runs with transformers' objects there, as a reverted one does."""
    global _current
    previous, _current = _current, state if state is not None else ProcessState()
    entered = dict(_current.bindings)
    try:
        yield _current
    finally:
        for key, installed in reversed(list(_current.bindings.items())):
            if entered.get(key) is not installed:
                installed.put_back(*key)
                del _current.bindings[key]
        _current = previous
