"""Foreign module-level names that patched layers need replaced, and the calling thread's context their wrappers read.

Some of transformers' behaviour is reached through a module-level name rather than a layer (a modeling module's
``apply_rotary_pos_emb`` and ``ALL_ATTENTION_FUNCTIONS``, ``masking_utils.find_packed_sequence_indices``). A row
declares the names its forward needs (``Row.bindings``, ``base/row.py``); ``apply`` installs each once, a wrapper
around the object found (:func:`install`), and ``revert`` releases them (:func:`release`): a name no patched module
holds any more gets its object back. The ledger is the process state's (``ProcessState.bindings``), its holders
held weakly: a model dropped without ``revert`` leaves them by itself, and the next ``apply`` or ``revert`` puts
back what nobody holds (:func:`sweep`). Until then the wrapper is inert, as every wrapper is outside a patched
layer: it does its own work only while the calling thread is inside a patched layer that entered it
(:func:`inside`, read by :func:`active`), so other models, other threads and reverted models get transformers' own
behaviour. A forward only enters and reads the thread's context (which torch.compile traces as it traces any
attribute write), never the ledger, and no name changes while a model runs.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fusepatch.base.row import Binding
from fusepatch.base.state import Installed
from fusepatch.base.state import current as process_state

_lock = threading.Lock()  # the ledger, for models applied or reverted in several threads at once
_local = threading.local()  # the calling thread's context: one attribute per slot a patched layer entered


def install(declared: Iterable[Binding], owner: object) -> None:
    """Each binding of ``declared`` in place, held by ``owner`` (a patched module). A name its module lacks
    (another release of the package) is skipped: the forward finds the package's own object there, if any."""
    if not declared:
        return
    with _lock:
        ledger = process_state().bindings
        for binding in declared:
            key = (binding.module, binding.name)
            module = importlib.import_module(binding.module)
            found = getattr(module, binding.name, None)
            installed = ledger.get(key)
            if installed is None or found is not installed.wrapper:  # new, or replaced by someone since
                if found is None:
                    continue
                held = installed.holders if installed is not None else None
                installed = ledger[key] = Installed(found, _wrapped(found, binding.wrap))
                if held is not None:
                    installed.holders.update(held)
                setattr(module, binding.name, installed.wrapper)
            installed.holders.add(owner)


def release(owner: object) -> None:
    """``owner`` holds nothing any more; the names nobody holds get their objects back."""
    with _lock:
        ledger = process_state().bindings
        for installed in ledger.values():
            installed.holders.discard(owner)
        _sweep(ledger)


def sweep() -> None:
    """Put back the names whose holders were all collected without ``revert`` (``apply`` starts with this)."""
    with _lock:
        _sweep(process_state().bindings)


def _sweep(ledger: dict[tuple[str, str], Installed]) -> None:
    for key in [key for key, installed in ledger.items() if len(installed.holders) == 0]:
        ledger.pop(key).put_back(*key)  # someone else's later wrapper stays theirs


def _wrapped(found: object, wrap: Callable[[object], object]) -> object:
    """``wrap(found)``; for a function that ``kernels`` (0.19, under transformers 5.25) turned into a module, a
    copy of that module calling the wrapper. Layers keep the original module too (``_kernel_funcs``), and
    ``kernels`` pickles it by the module-level name's type when that name is not the original itself: the name must
    still hold a module of its class, or a pickled model would not load."""
    wrapper = wrap(found)
    if isinstance(found, torch.nn.Module) and callable(wrapper) and not isinstance(wrapper, torch.nn.Module):
        module = copy.copy(found)
        module.forward = wrapper
        return module
    return wrapper


@contextlib.contextmanager
def inside(slots: dict[str, object]) -> Iterator[None]:
    """The calling thread inside a patched layer: each slot's value is what :func:`active` gives the wrappers until
    the block ends (raising or not), then the value of the layer around it, if any."""
    outer = tuple((name, getattr(_local, name, None)) for name in slots)
    for name, value in slots.items():
        setattr(_local, name, value)
    try:
        yield
    finally:
        for name, value in outer:
            setattr(_local, name, value)


def active(slot: str) -> Any:
    """The value the patched layer the calling thread is inside gave ``slot``; None outside any."""
    return getattr(_local, slot, None)
