"""causal-conv1d: its compiled extension, called past the package's custom-op wrappers (ops/causal_conv1d/).

The extension's functions are pybind11 bindings with positional arguments only; fusepatch checks their arity
(1.7's: ``causal_conv1d_fwd`` 8, ``causal_conv1d_bwd`` 12) before calling them, and otherwise calls the
package's public ``causal_conv1d_fn``.
"""

from __future__ import annotations

from fusepatch.base.private_names import PrivateNames

DISTRIBUTION = "causal-conv1d"
EXTENSION = "causal_conv1d_cuda"
ARITIES = {"causal_conv1d_fwd": 8, "causal_conv1d_bwd": 12}

NAMES = PrivateNames(
    distribution=DISTRIBUTION,
    checked=("1.7.0",),
    names={EXTENSION: tuple(ARITIES), "causal_conv1d": ("causal_conv1d_fn",)},
    fix="python -m fusepatch build causal-conv1d   (or: pip install 'causal-conv1d>=1.7,<1.8' --no-build-isolation)",
    import_needs_gpu="its CUDA extension loads CUDA's libraries",
)
