"""fusepatch: patch Qwen layers with fused GPU kernels, and say exactly what fell back and why.

>>> import fusepatch
>>> report = fusepatch.apply(model)   # doctest: +SKIP
>>> print(report)                     # doctest: +SKIP
"""

from __future__ import annotations

import logging

from fusepatch.env import Environment, capture
from fusepatch.patch import FusePatchError, apply, report, revert
from fusepatch.registry import Row, add_candidate, register
from fusepatch.report import PatchReport

__version__ = "0.1.0"


def __getattr__(name: str):
    # The callback imports transformers' Trainer machinery: load it only when asked for.
    if name in ("FusePatchCallback", "attach"):
        from fusepatch import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'fusepatch' has no attribute {name!r}")


logging.getLogger("fusepatch").addHandler(logging.NullHandler())

__all__ = [
    "Environment",
    "FusePatchCallback",
    "attach",
    "FusePatchError",
    "PatchReport",
    "Row",
    "__version__",
    "add_candidate",
    "apply",
    "capture",
    "register",
    "report",
    "revert",
]
