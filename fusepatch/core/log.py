"""fusepatch's log, visible without configuring logging (as transformers' is), and never shown twice.

The ``fusepatch`` logger gets one handler writing to stderr. It stays silent while the process has logging of
its own (a handler on the root logger: ``logging.basicConfig``, a Trainer's or a test's), since the record then
reaches that handler through propagation. The level comes from ``FUSEPATCH_VERBOSITY`` (``error``,
``warning``, ``info``, ``debug``; default ``info``: what was patched, every fallback with its reason and fix).
"""

from __future__ import annotations

import logging
import os
import sys

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
