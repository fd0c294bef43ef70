"""What fusepatch remembers across calls in one process, in one object.

Self-test verdicts (a kernel is tested once per process and shape), the drift lines of foreign packages, the
reasons and notes already said (each once), the rows and candidates users added, and the environment snapshot.
Nothing else in the package keeps state between models; tests run each case in a :func:`fresh` state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fusepatch.base.log import SaidOnce


@dataclass
class ProcessState:
    said: SaidOnce = field(default_factory=SaidOnce)  # fallback reasons and one-time notes said at WARNING/INFO
    selftests: dict[tuple, Any] = field(default_factory=dict)  # (op, candidate, device, dtype, ...) -> Verdict
    drift: list[str] = field(default_factory=list)  # every drift line reported, for the patch report
    user_rows: list[Any] = field(default_factory=list)  # fusepatch.register(...), checked before the built-in rows
    user_candidates: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)  # op -> (first, last) added
    environment: Any = None  # the captured Environment, once taken


_current = ProcessState()


def current() -> ProcessState:
    """The process's state."""
    return _current


@contextlib.contextmanager
def fresh(state: ProcessState | None = None) -> Iterator[ProcessState]:
    """Run with ``state`` (default: an empty one) as the process's state, and put the previous one back after."""
    global _current
    previous, _current = _current, state if state is not None else ProcessState()
    try:
        yield _current
    finally:
        _current = previous
