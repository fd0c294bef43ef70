"""fusepatch's log, visible without configuring logging (as transformers' is), and never shown twice.

The ``fusepatch`` logger gets one handler writing to stderr. It stays silent while the process has logging of
its own (a handler on the root logger: ``logging.basicConfig``, a Trainer's or a test's), since the record then
reaches that handler through propagation. The level comes from ``FUSEPATCH_VERBOSITY`` (``error``,
``warning``, ``info``, ``debug``; default ``info``: what was patched, every fallback with its reason and fix).
Each distinct fallback reason is said once per process (:class:`SaidOnce`, kept in ``base/state.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("fusepatch")

LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
DEFAULT = "info"


class _DefaultHandler(logging.StreamHandler):
    """stderr, only while nobody else would show the record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # the root logger shows it (propagation): once is enough
            return
        self.stream = sys.stderr  # the stream of now (pytest's capsys, a redirected stderr)
        super().emit(record)


class SaidOnce:
    """The keys (fallback reasons) this process has already said at WARNING. A training run meets the same reason
    in every model it patches and in each new dtype or packed call of every layer (one SFT run said one reason 22
    times in 45 lines); the first time says it with its fix, later times go to DEBUG. Tests ``reset()`` it."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """Whether ``key`` was not said yet; it counts as said from now on."""
        with self._lock:
            if key in self._said:
                return False
            self._said.add(key)
            return True

    def warn(self, key: str, message: str, *args: object) -> None:
        """Log ``message`` at WARNING the first time ``key`` comes, at DEBUG after."""
        logger.log(logging.WARNING if self.first(key) else logging.DEBUG, message, *args)

    def __contains__(self, key: str) -> bool:
        return key in self._said

    def reset(self) -> None:
        with self._lock:
            self._said.clear()


def verbosity() -> int:
    """The level ``FUSEPATCH_VERBOSITY`` asks for (an unknown value: the default, and a warning naming the choices)."""
    text = os.environ.get("FUSEPATCH_VERBOSITY", DEFAULT).strip().lower() or DEFAULT
    if text not in LEVELS:
        logger.warning("fusepatch: FUSEPATCH_VERBOSITY=%r is not one of %s; using %s", text, ", ".join(LEVELS), DEFAULT)
        return LEVELS[DEFAULT]
    return LEVELS[text]


def configure() -> None:
    """Install the default handler once, at the level of ``FUSEPATCH_VERBOSITY`` (unless the user set one)."""
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    logger.addHandler(_DefaultHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(verbosity())
