"""The Hugging Face ``kernels`` package: fusepatch uses its public ``get_kernel``, ``get_local_kernel`` and ``load_kernel`` and two
internals, the lock-file parser and the build-variant resolver (for the reason a Hub kernel does not fit)."""

from __future__ import annotations

from fusepatch.backends import PrivateNames

DISTRIBUTION = "kernels"
REQUIRED = ">=0.17"
FIX = 'pip install "fusepatch[hub]"'

NAMES = PrivateNames(
    distribution=DISTRIBUTION,
    checked=("0.17.2",),
    names={
        "kernels": ("get_kernel", "get_local_kernel", "load_kernel"),
        "kernels._rust": ("KernelLocks",),
        "kernels.variants": ("VariantAccepted", "get_variants_local", "resolve_variants"),
    },
    fix=FIX,
)
