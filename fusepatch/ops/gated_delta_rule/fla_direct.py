"""fla's functions called past its per-call backend dispatch, where no other backend could take the call.

fla-core 0.6 wraps most op functions in ``fla.backends.dispatch``. On every call the wrapper sorts the op's
registered backends, asks each whether it is available and enabled (environment reads), runs its verifier, and
does all of that inside a ``torch.compiler.disable`` frame; two of the functions fusepatch calls are also wrapped
in ``input_guard`` (a contiguity pass over every argument, a device context). fusepatch's delta rule calls
thirteen such functions a layer, forward and backward. At the Qwen3.5-2B-like shape the forward is CPU-bound (the
host takes longer to queue it than the GPU to run it), so that per-call work is the step's time: switching the
dispatch off (fla's ``FLA_DISABLE_BACKEND_DISPATCH=1``, read at import, for every caller) saves host time, and
calling the functions directly (this module) saves it without changing fla for other callers.

Where no backend registered for a function is available and enabled here, every call ends in the decorated
function itself, so fusepatch calls that directly: its inputs are already contiguous and on the current device.
Where one is live (fla's TileLang backend for ``chunk_bwd_dqkwg`` on Hopper, a user's ``FLA_INTRACARD_CP=1``),
or a wrapper is not one this module knows, the function is called as fla exports it. Decided when the candidate
loads: an ``FLA_*`` switch changed afterwards takes effect at the next ``fusepatch.apply``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from fusepatch.backends.fla import NAMES

logger = logging.getLogger("fusepatch")


def _path(*parts: str) -> str:
    return os.sep + os.path.join(*parts)


# The wrappers peeled, by where their code lives: fla's dispatch wrapper, fla's input_guard, torch's
# compiler-disable frame (which fla's dispatch returns). Anything else (a cache, a custom_fwd) stays.
_DISPATCH = (_path("fla", "backends.py"), "wrapper")
_PEELABLE = {
    _DISPATCH,
    (_path("fla", "utils", "decorators.py"), "wrapper"),
    (_path("torch", "_dynamo", "eval_frame.py"), "_fn"),
}


def _layer(fn: Callable) -> tuple[str, str] | None:
    """The known wrapper ``fn`` is, as (path suffix, code name), or None."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__wrapped__", None) is None:
        return None
    return next(
        (known for known in _PEELABLE if code.co_filename.endswith(known[0]) and code.co_name == known[1]), None
    )


def _registry(wrapper: Callable) -> Any:
    """The ``BackendRegistry`` a dispatch wrapper closes over, or None where fla laid it out differently."""
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    cell = cells.get("self")
    registry = cell.cell_contents if cell is not None else None
    return registry if hasattr(registry, "_get_sorted_backends") else None


def live_backends(wrapper: Callable, name: str) -> list[str] | None:
    """The backends fla's dispatch could hand ``name`` to here (available, enabled, implementing it); None when
    the registry cannot be read."""
    registry = _registry(wrapper)
    if registry is None:
        return None
    try:
        return [
            backend.backend_type
            for backend in registry._get_sorted_backends()
            if backend.is_available() and backend.is_enabled() and backend.get_implementation(name) is not None
        ]
    except Exception:  # noqa: BLE001 - a backend that cannot say: keep fla's own call
        return None


def unwrap(fn: Callable, name: str) -> tuple[Callable, str]:
    """``fn`` past fla's dispatch and guard wrappers where that is safe, and why (for the log)."""
    inner, seen_dispatch = fn, False
    while (layer := _layer(inner)) is not None:
        if layer == _DISPATCH:
            live = live_backends(inner, name)
            if live is None:
                NAMES.drift(
                    "fla's backend dispatch wrapper holds no readable BackendRegistry",
                    "fla's functions are called through its per-call dispatch (more host time a layer)",
                )
                return fn, "fla's backend registry unreadable"
            if live:
                return fn, f"backend {', '.join(live)} could take it"
            seen_dispatch = True
        inner = inner.__wrapped__
    if not seen_dispatch:
        return fn, "no backend dispatch"
    return inner, "direct"


def direct(module: Any, names: Iterable[str]) -> SimpleNamespace:
    """``module``'s functions ``names``, each past fla's dispatch where no other backend could take it."""
    chosen: dict[str, Callable] = {}
    kept: list[str] = []
    for name in names:
        fn = getattr(module, name)
        chosen[name], why = unwrap(fn, name)
        if why != "direct":
            kept.append(f"{name} ({why})")
    if kept:
        logger.debug("fusepatch: fla functions called through fla's dispatch: %s", "; ".join(kept))
    return SimpleNamespace(**chosen)


def beta_sigmoid(exported: Callable) -> Callable:
    """fla's ``fused_beta_sigmoid`` forward as its kernel's launcher (``fused_beta_sigmoid_fwd``, fla-core 0.6),
    past the autograd function, input guard and dispatch around it: called inside fusepatch's own autograd
    function, whose backward calls ``fused_beta_sigmoid_bwd``, nothing of the wrapper is used. ``exported``
    where the launcher is missing or dispatched to a live backend."""
    fallback = "beta's sigmoid goes through fla's autograd function (one more wrapper a call)"
    try:
        from fla.ops.common import gate
    except ImportError as exc:
        NAMES.drift(f"fla.ops.common.gate cannot be imported ({exc})", fallback)
        return exported
    launcher = getattr(gate, "fused_beta_sigmoid_fwd", None)
    if launcher is None:
        NAMES.drift("fla.ops.common.gate.fused_beta_sigmoid_fwd is missing", fallback)
        return exported
    found, why = unwrap(launcher, "fused_beta_sigmoid_fwd")
    return found if why == "direct" else exported
