"""Names in transformers' modules that patched layers replace while they are patched, and put back after.

Some of transformers' behaviour is reached through a module-level name rather than a layer (a modeling module's
``apply_rotary_pos_emb`` and ``ALL_ATTENTION_FUNCTIONS``, ``masking_utils.find_packed_sequence_indices``). A
binding replaces such a name once, with a wrapper that does what transformers' object does unless the calling
thread is inside a patched layer that set it up (thread-locals, so other models in the process, and other threads,
get transformers' own behaviour). Each binding counts the patched modules holding it; ``revert`` releases them and
the last release puts transformers' object back, so a reverted process is the one ``apply`` found. A patched model
dropped without ``revert`` does the same when the garbage collector takes its last holding module (a finalizer).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

_lock = threading.Lock()
_installed: dict[tuple[str, str], tuple[object, object]] = {}  # (module, name) -> (transformers' object, wrapper)
_holders: dict[tuple[str, str], weakref.WeakSet] = {}
_watched: weakref.WeakSet = weakref.WeakSet()  # holders with a finalizer (one each, whatever they hold)
_sweep_due = False  # a holder was collected while the lock was taken: whoever releases the lock sweeps


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The lock of ``_installed`` and ``_holders``; on leaving, the sweep a collected holder left due."""
    with _lock:
        yield
    _sweep_if_due()


def _collected() -> None:
    """Finalizer of a holder. The collector runs in whichever thread allocates, also inside ``hold`` or ``release``
    on the thread holding the lock, so this never waits for the lock: it marks a sweep due and sweeps if it can."""
    global _sweep_due
    _sweep_due = True
    _sweep_if_due()


def _tracing() -> bool:
    """Whether torch.compile is tracing or compiling a frame in this process now. The collector may run inside
    dynamo's own work, which reads and guards the module-level names it saw: a name changed under it fails the
    compile (a guard on the wrapper's closure finds transformers' function), so the sweep waits for the next one."""
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None


def _sweep_if_due() -> None:
    """Put transformers' objects back where no live module holds the binding. A sweep marked due while another
    thread holds the lock is done by that thread when it leaves ``_locked`` (it checks after releasing); one due
    while torch.compile works is done by the next ``hold``, ``release`` or :func:`sweep`."""
    global _sweep_due
    while _sweep_due and not _tracing() and _lock.acquire(blocking=False):
        try:
            _sweep_due = False
            for key in [k for k in _installed if not any(True for _ in _holders.get(k, ()))]:
                _restore(key)
        finally:
            _lock.release()


def sweep() -> None:
    """Do a sweep that a collected holder left due (``apply`` and ``revert`` call this before they start)."""
    _sweep_if_due()


def _restore(key: tuple[str, str]) -> None:
    """Transformers' object back under ``key`` (with the lock taken), unless someone replaced our wrapper since."""
    original, wrapper = _installed.pop(key)
    module = sys.modules.get(key[0])  # imported when bound; gone only while the interpreter shuts down
    if module is not None and getattr(module, key[1], None) is wrapper:
        setattr(module, key[1], original)


def hold(owner: object, module_name: str, name: str, wrap: Callable[[object], object]) -> bool:
    """Make ``module_name.name`` the wrapper ``wrap(transformers' object)`` while ``owner`` holds it; False if the
    module has no such name. Cheap once held: a set lookup, no write to the module. While torch.compile traces
    the call, a binding whose wrapper is in place is taken as held: dynamo would guard on the holders' weak set,
    whose members the collector may take while it builds the guards (a model of an earlier step collected then)."""
    key = (module_name, name)
    if torch.compiler.is_compiling() and _in_place(module_name, name):
        return True
    holders = _holders.get(key)
    if holders is not None and owner in holders and key in _installed:
        return True
    with _locked():
        module = importlib.import_module(module_name)
        current = getattr(module, name, None)
        if key not in _installed or current is not _installed[key][1]:  # new, or replaced by someone since
            if current is None:
                return False
            wrapper = _wrapped(current, wrap)
            setattr(module, name, wrapper)
            _installed[key] = (current, wrapper)
        _watch(owner, key)
    return True


@torch.compiler.assume_constant_result
def _in_place(module_name: str, name: str) -> bool:
    """Whether our wrapper is what ``module_name.name`` holds now. Read once while dynamo traces, as a constant: a
    guard on ``_installed`` failed when the collector released a binding while dynamo built that very guard. A
    graph compiled while the wrapper was in place keeps taking it as held after a ``revert``: the wrapper and
    transformers' function compute the same, so only the wrapper's work outside patched layers is lost."""
    installed = _installed.get((module_name, name))
    return installed is not None and getattr(sys.modules.get(module_name), name, None) is installed[1]


def _watch(owner: object, key: tuple[str, str]) -> None:
    """``owner`` holds ``key`` (with the lock taken); collected without release, what only it held goes back."""
    _holders.setdefault(key, weakref.WeakSet()).add(owner)
    if owner not in _watched:
        weakref.finalize(owner, _collected).atexit = False
        _watched.add(owner)


def _wrapped(current: object, wrap: Callable[[object], object]) -> object:
    """``wrap(current)``; for a function that ``kernels`` (0.19, under transformers 5.25) turned into a module, a
    copy of that module calling the wrapper. Layers keep the original module too (``_kernel_funcs``), and
    ``kernels`` pickles it by the module-level name's type when that name is not the original itself: the name must
    still hold a module of its class, or a pickled model would not load."""
    wrapper = wrap(current)
    if isinstance(current, torch.nn.Module) and callable(wrapper) and not isinstance(wrapper, torch.nn.Module):
        module = copy.copy(current)
        module.forward = wrapper
        return module
    return wrapper


def release(owner: object) -> None:
    """``owner`` holds nothing any more; bindings nobody holds get transformers' objects back."""
    with _locked():
        for key, holders in _holders.items():
            holders.discard(owner)
            if len(holders) == 0 and key in _installed:
                _restore(key)  # someone else's later wrapper stays theirs
