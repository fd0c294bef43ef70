"""peft's merges and the FP8 copy a frozen base keeps (``layers/fp8.py``).

peft merges adapters into a base weight through ``weight.data``, which changes neither the weight's storage nor
its version, the copy's key, and does so from wherever the base is called: a fused layer, transformers' own
attention, or no wrapper at all after ``merge_and_unload``; a base does not know the wrapper calling it. So the
``merge`` and ``unmerge`` methods of peft's layer classes are wrapped to let go of the copy after writing, held
like a binding (``bindings.hold_patch``) by the FP8 projections and put back when the last one is reverted or
collected.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from fusepatch.base.log import logger
from fusepatch.base.state import current as process_state
from fusepatch.base.versions import support
from fusepatch.layers.support import bindings
from fusepatch.layers.support.kept import forget

TUNER_LAYERS = "peft.tuners.tuners_utils"  # the module defining ``BaseTunerLayer``, every peft layer's base
WRAPPED = f"{TUNER_LAYERS}.BaseTunerLayer merges"  # the change's name among the bindings


def peft_imported() -> bool:
    """Whether peft's layers exist in this process (a model can hold one only then)."""
    return TUNER_LAYERS in sys.modules


PEFT_MOVED = (
    f"peft's BaseTunerLayer is not in {TUNER_LAYERS}, where fusepatch follows peft's merges: frozen FP8 "
    "projections are quantized at every call instead of kept, so that a merge cannot leave a stale copy (slower); "
    "fix: pip install peft=={checked}, the version fusepatch was checked with"
)


def follow_merges(owner: torch.nn.Module) -> bool:
    """Have peft's layers' ``merge`` and ``unmerge`` let go of the FP8 copy their base keeps (``layers/fp8.py``)
    while ``owner`` (an FP8 projection) is patched; False where peft's layer classes are not where fusepatch knows
    them (said once), and then no copy may be kept.

    A wrapped method does what peft's does, and then lets go of the copy if it merged or unmerged anything. A
    layer class defined while they are wrapped, with merge methods of its own, is not followed."""
    base = getattr(sys.modules.get(TUNER_LAYERS), "BaseTunerLayer", None)
    if not isinstance(base, type):
        if process_state().said.first(PEFT_MOVED):
            logger.warning("fusepatch: %s", PEFT_MOVED.format(checked=support("peft").tested[-1]))
        return False
    bindings.hold_patch(owner, WRAPPED, functools.partial(_wrap_merges, base))
    return True


def _wrap_merges(base: type) -> Callable[[], None]:
    """Wrap the ``merge`` and ``unmerge`` of ``base`` and every subclass that defines its own; returns the undo."""
    wrapped: list[tuple[type, str, object]] = []
    pending = [base]
    while pending:
        layer_type = pending.pop()
        pending.extend(layer_type.__subclasses__())
        for name in ("merge", "unmerge"):
            method = layer_type.__dict__.get(name)
            if callable(method) and not getattr(method, "lets_go_of_fp8_copies", False):
                setattr(layer_type, name, _letting_go(method))
                wrapped.append((layer_type, name, method))

    def undo() -> None:
        for layer_type, name, method in wrapped:
            if getattr(layer_type.__dict__.get(name), "__wrapped__", None) is method:
                setattr(layer_type, name, method)

    return undo


def _letting_go(method):
    @functools.wraps(method)
    def merge_or_unmerge(self, *args, **kwargs):
        before = getattr(self, "merged_adapters", None)
        before = None if before is None else tuple(before)
        wrote = True  # unless it ran through and merged or unmerged nothing ("already merged": peft skips)
        try:
            result = method(self, *args, **kwargs)
            wrote = before is None or tuple(self.merged_adapters) != before
            return result
        finally:
            state = self.get_base_layer().__dict__.get("_fusepatch")
            if wrote and state is not None and not state.cache.get("dropped"):
                forget(state.cache, "fp8")

    merge_or_unmerge.lets_go_of_fp8_copies = True
    return merge_or_unmerge
