"""Attention forward with the rotary embedding from a fused kernel.

transformers' attention forwards (Qwen2/3 and their MoE variants, Qwen3-Next, Qwen3.5) apply the rotary
embedding inline, through their modeling module's ``apply_rotary_pos_emb``. Re-implementing each forward per
family and per transformers release is what this avoids: the layer's own forward runs unchanged, with that
name bound, for the duration of the call, to a function that sends the call to the chosen kernel, or back to
transformers' function for anything the kernel does not reproduce exactly (another ``unsqueeze_dim``, mixed
dtypes, cos/sin that need gradients, a fallback). The binding is undone when the call returns or raises. Two
threads running attention of the same family at the same moment could see each other's binding; both compute
the same rotary.
"""

from __future__ import annotations

import sys

from fusepatch.ops.rotary import unsupported
from fusepatch.resolve import dtype_name

NAME = "apply_rotary_pos_emb"


def rotary_attention_forward(self, *args, **kwargs):
    state = self._fusepatch
    module = sys.modules[type(self).__module__]
    original = getattr(module, NAME, None)
    if original is None or getattr(original, "_fusepatch", False):  # no such function, or bound already
        return state.original(*args, **kwargs)
    dispatch = state.ops["rotary"]

    def apply_rotary_pos_emb(q, k, cos, sin, *rest, **extra):
        unsqueeze_dim = extra.get("unsqueeze_dim", rest[0] if rest else 1)
        plain = unsqueeze_dim == 1 and len(rest) <= 1 and set(extra) <= {"unsqueeze_dim"}
        if plain and unsupported(q, k, cos, sin) is None:
            if dispatch.choice(q.device.type, dtype_name(q.dtype)).fused:
                return dispatch(q, k, cos, sin)
        return original(q, k, cos, sin, *rest, **extra)

    apply_rotary_pos_emb._fusepatch = True
    setattr(module, NAME, apply_rotary_pos_emb)
    try:
        return state.original(*args, **kwargs)
    finally:
        setattr(module, NAME, original)
