"""One module per foreign package, each with one table of the names fusepatch uses that the package does
not promise to keep (private functions, module layout, compiled-extension signatures) and the versions they were
checked on.

A name that is missing from the installed version is a WARNING naming the fallback it causes and the fix (never
a DEBUG line), once per process; ``python -m fusepatch doctor`` lists every table against what is installed.
"""

from __future__ import annotations

from fusepatch.backends import accelerate, causal_conv1d, fla, kernels_hub
from fusepatch.base.private_names import PrivateNames, drifted

__all__ = ["PrivateNames", "drifted", "tables"]


def tables() -> list[PrivateNames]:
    """Every package's table (imports only these small modules, never the packages themselves)."""
    return [fla.NAMES, causal_conv1d.NAMES, kernels_hub.NAMES, accelerate.NAMES]
