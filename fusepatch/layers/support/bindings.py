"""Names in transformers' modules that patched layers replace while they are patched, and put back after.

Some of transformers' behaviour is reached through a module-level name rather than a layer (a modeling module's
``apply_rotary_pos_emb`` and ``ALL_ATTENTION_FUNCTIONS``, ``masking_utils.find_packed_sequence_indices``). A
binding replaces such a name once, with a wrapper that does what transformers' object does unless the calling
thread is inside a patched layer that set it up (thread-locals, so other models in the process, and other threads,
get transformers' own behaviour). Each binding counts the patched modules holding it; ``revert`` releases them and
the last release puts transformers' object back, so a reverted process is the one ``apply`` found.
"""

from __future__ import annotations

import copy
import importlib
import threading
import weakref
from collections.abc import Callable

import torch

_lock = threading.Lock()
_installed: dict[tuple[str, str], tuple[object, object]] = {}  # (module, name) -> (transformers' object, wrapper)
_holders: dict[tuple[str, str], weakref.WeakSet] = {}


def hold(owner: object, module_name: str, name: str, wrap: Callable[[object], object]) -> bool:
    """Make ``module_name.name`` the wrapper ``wrap(transformers' object)`` while ``owner`` holds it; False if the
    module has no such name. Cheap once held: a set lookup, no write to the module."""
    key = (module_name, name)
    holders = _holders.get(key)
    if holders is not None and owner in holders and key in _installed:
        return True
    with _lock:
        module = importlib.import_module(module_name)
        current = getattr(module, name, None)
        if key not in _installed or current is not _installed[key][1]:  # new, or replaced by someone since
            if current is None:
                return False
            wrapper = _wrapped(current, wrap)
            setattr(module, name, wrapper)
            _installed[key] = (current, wrapper)
        _holders.setdefault(key, weakref.WeakSet()).add(owner)
    return True


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
    with _lock:
        for key, holders in _holders.items():
            holders.discard(owner)
            if len(holders) == 0 and key in _installed:
                original, wrapper = _installed.pop(key)
                module = importlib.import_module(key[0])
                if getattr(module, key[1], None) is wrapper:  # someone else's later wrapper stays theirs
                    setattr(module, key[1], original)
