"""Keep kernels fusepatch refused out of transformers' own dispatch, where a patched layer still runs transformers'
forward.

transformers' linear-attention layers reach their kernels through module-level names of their modeling module
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``causal_conv1d_update``), each bound at import to an installed package's kernel (fla, causal-conv1d) when it
imports, else to transformers' torch code. A kernel that imports but that fusepatch's self-test refused (NaN, a
wrong gradient) would run there all the same. The linear-attention rows declare these names (:func:`guards`), so
``apply`` binds them (``layers/support/bindings.py``) to guards that, while a patched layer runs transformers'
forward (:func:`refusing`), send the calling thread's call to transformers' torch code for every op whose kernel
fusepatch refused for the call's device and dtype; other threads, other models and the ops fusepatch accepted keep
transformers' choice, which the layer's report names.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusepatch.base.row import Binding
from fusepatch.layers.support import bindings

# transformers' module-level names a linear-attention forward dispatches through, and the op each computes
GUARDED = {
    "torch_chunk_gated_delta_rule": "gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}

GUARDING = "_fusepatch_guarding"  # on a guard: transformers' object it stands in front of
REFUSED = "refused"  # the context's slot (``bindings.inside``): the ops whose kernels the current call must not reach


def _decorated(obj: object) -> Callable | None:
    """transformers' dispatching function behind ``obj``: the function itself, or the one the ``kernels`` package
    wrapped into a module (its class's ``forward`` closes over it); through a guard, the object it guards."""
    obj = getattr(obj, GUARDING, obj)
    if isinstance(obj, torch.nn.Module):
        try:
            return inspect.getclosurevars(type(obj).forward).nonlocals.get("func")
        except (TypeError, ValueError):
            return None
    return obj if callable(obj) else None


def torch_code(obj: object) -> Callable | None:
    """transformers' torch implementation behind a dispatching name (its decorator keeps it as ``__wrapped__``)."""
    decorated = _decorated(obj)
    return getattr(decorated, "__wrapped__", None)


def dispatched_kernel(obj: object) -> str:
    """What transformers' dispatch behind ``obj`` runs: a package's kernel by its qualified name, or "torch"."""
    decorated = _decorated(obj)
    if decorated is None:
        return "unknown"
    try:
        chosen = inspect.getclosurevars(decorated).nonlocals.get("implementation")
    except (TypeError, ValueError):
        chosen = None
    if chosen is None or chosen is getattr(decorated, "__wrapped__", None):
        return "torch"
    return f"{getattr(chosen, '__module__', '?')}.{getattr(chosen, '__qualname__', '?')}"


@dataclass(frozen=True)
class _Guard:
    """The wrap of a guarded name: a value, so that a row holding it pickles (a closure would not)."""

    op: str

    def __call__(self, current: object) -> Callable:
        op, reference = self.op, torch_code(current)

        def guarded(*args, **kwargs):
            if reference is not None and op in (bindings.active(REFUSED) or ()):
                return reference(*args, **kwargs)
            return current(*args, **kwargs)

        setattr(guarded, GUARDING, current)
        return guarded


def guards(module_name: str) -> tuple[Binding, ...]:
    """The bindings a linear-attention row of ``module_name`` declares: a guard in front of each dispatching name."""
    return tuple(Binding(module_name, name, _Guard(op)) for name, op in GUARDED.items())


def unguardable(module_name: str, refused: set[str]) -> list[str]:
    """The names through which a refused op would still reach its kernel: no torch code found behind them."""
    module = sys.modules.get(module_name)
    return [
        name
        for name, op in GUARDED.items()
        if op in refused and module is not None and hasattr(module, name) and torch_code(getattr(module, name)) is None
    ]


def kernels_behind(module_name: str) -> dict[str, str]:
    """Per guarded name of a modeling module, the kernel transformers' dispatch runs (for the report)."""
    module = sys.modules.get(module_name)
    found = {}
    for name in GUARDED:
        current = getattr(module, name, None)
        if current is not None:
            found[name] = dispatched_kernel(current)
    return found


def refusing(refused: set[str]) -> contextlib.AbstractContextManager:
    """Run transformers' forward with the kernels of ``refused`` ops kept out of its dispatch, in this thread."""
    return bindings.inside({REFUSED: frozenset(refused)})
