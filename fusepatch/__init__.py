"""fusepatch: patch Qwen layers with fused GPU kernels, and say exactly what fell back and why.

>>> import fusepatch
>>> report = fusepatch.apply(model)   # doctest: +SKIP
>>> print(report)                     # doctest: +SKIP

The public names load on first use, so that ``python -m fusepatch --help`` and ``import fusepatch`` do not import
torch and transformers before they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fusepatch import log

__version__ = "0.2.0"

# public name -> the module that defines it
_PUBLIC = {
    "Environment": "fusepatch.env",
    "capture": "fusepatch.env",
    "FusePatchError": "fusepatch.patch",
    "apply": "fusepatch.patch",
    "report": "fusepatch.patch",
    "revert": "fusepatch.patch",
    "Row": "fusepatch.registry",
    "add_candidate": "fusepatch.registry",
    "register": "fusepatch.registry",
    "PatchReport": "fusepatch.reporting",
    "FusePatchCallback": "fusepatch.callback",
    "attach": "fusepatch.callback",
    "from_pretrained": "fusepatch.integrations.pretrained",
}

if TYPE_CHECKING:
    from fusepatch.callback import FusePatchCallback, attach  # noqa: F401
    from fusepatch.env import Environment, capture  # noqa: F401
    from fusepatch.integrations.pretrained import from_pretrained  # noqa: F401
    from fusepatch.patch import FusePatchError, apply, report, revert  # noqa: F401
    from fusepatch.registry import Row, add_candidate, register  # noqa: F401
    from fusepatch.reporting import PatchReport  # noqa: F401


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fusepatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


log.configure()  # visible without configuring logging: fusepatch/log.py

__all__ = sorted([*_PUBLIC, "__version__"])
