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

from fusepatch.base import log
from fusepatch.base.release import __version__  # noqa: F401

# public name -> the module that defines it
_PUBLIC = {
    "Environment": "fusepatch.base.env",
    "capture": "fusepatch.base.env",
    "FusePatchError": "fusepatch.engine.patch",
    "apply": "fusepatch.engine.patch",
    "report": "fusepatch.engine.patch",
    "revert": "fusepatch.engine.patch",
    "Row": "fusepatch.engine.registry",
    "add_candidate": "fusepatch.engine.registry",
    "register": "fusepatch.engine.registry",
    "PatchReport": "fusepatch.engine.reporting",
    "FusePatchCallback": "fusepatch.integrations.trainer",
    "attach": "fusepatch.integrations.trainer",
    "from_pretrained": "fusepatch.integrations.pretrained",
    "HubKernel": "fusepatch.backends.kernels_hub",
    "hub_candidate": "fusepatch.backends.kernels_hub",
}

if TYPE_CHECKING:
    from fusepatch.backends.kernels_hub import HubKernel, hub_candidate  # noqa: F401
    from fusepatch.base.env import Environment, capture  # noqa: F401
    from fusepatch.base.row import Row  # noqa: F401
    from fusepatch.engine.patch import FusePatchError, apply, report, revert  # noqa: F401
    from fusepatch.engine.registry import add_candidate, register  # noqa: F401
    from fusepatch.engine.reporting import PatchReport  # noqa: F401
    from fusepatch.integrations.pretrained import from_pretrained  # noqa: F401
    from fusepatch.integrations.trainer import FusePatchCallback, attach  # noqa: F401


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fusepatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


log.configure()  # visible without configuring logging: fusepatch/base/log.py

__all__ = sorted([*_PUBLIC, "__version__"])
