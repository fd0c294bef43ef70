"""Attention forward with the rotary embedding from a fused kernel.

transformers' attention forwards (Qwen2/3 and their MoE variants, Qwen3-Next, Qwen3.5) apply the rotary
embedding inline, through their modeling module's ``apply_rotary_pos_emb``. Re-implementing each forward per
family and per transformers release is what this avoids: the layer's own forward runs unchanged, with that
name bound, for the duration of the call, to a function that sends the call to the chosen kernel, or back to
transformers' function for anything the kernel does not reproduce exactly (another ``unsqueeze_dim``, mixed
dtypes, cos/sin that need gradients, a fallback). The binding is undone when the last call using it returns or
raises. Threads (``nn.DataParallel`` runs one replica per thread) share one binding, counted, and each finds its
own layer's kernel choice in a thread-local, so every replica gets the fused rotary and none undoes another's.
"""

from __future__ import annotations

import sys
import threading

from fusepatch.ops.rotary import unsupported
from fusepatch.resolve import dtype_name

NAME = "apply_rotary_pos_emb"


_lock = threading.Lock()
_bound: dict[str, list] = {}  # modeling module name -> [calls inside, transformers' function]
_local = threading.local()  # .dispatch: the rotary choice of the attention call running in this thread


def _bind(module) -> bool:
    """Bind ``module.apply_rotary_pos_emb`` to the dispatching function (once, counted); False if the modeling
    module has no such function."""
    with _lock:
        entry = _bound.get(module.__name__)
        if entry is None:
            original = getattr(module, NAME, None)
            if original is None:
                return False
            entry = _bound[module.__name__] = [0, original]
            setattr(module, NAME, _dispatching(original))
        entry[0] += 1
        return True


def _unbind(module) -> None:
    with _lock:
        entry = _bound[module.__name__]
        entry[0] -= 1
        if entry[0] == 0:
            setattr(module, NAME, entry[1])
            del _bound[module.__name__]


def _dispatching(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *rest, **extra):
        dispatch = getattr(_local, "dispatch", None)
        unsqueeze_dim = extra.get("unsqueeze_dim", rest[0] if rest else 1)
        plain = unsqueeze_dim == 1 and len(rest) <= 1 and set(extra) <= {"unsqueeze_dim"}
        if dispatch is not None and plain and unsupported(q, k, cos, sin) is None:
            if dispatch.choice(q.device.type, dtype_name(q.dtype)).fused:
                return dispatch(q, k, cos, sin)
        return original(q, k, cos, sin, *rest, **extra)

    return apply_rotary_pos_emb


def rotary_attention_forward(self, *args, **kwargs):
    state = self._fusepatch
    module = sys.modules[type(self).__module__]
    if not _bind(module):
        return state.original(*args, **kwargs)
    outer = getattr(_local, "dispatch", None)
    _local.dispatch = state.ops["rotary"]
    try:
        return state.original(*args, **kwargs)
    finally:
        _local.dispatch = outer
        _unbind(module)
