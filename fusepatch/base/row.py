"""The registry's row: one Hugging Face layer class and how fusepatch patches it (a value; the table itself is
``fusepatch/models/``, the registry that reads it ``fusepatch/engine/registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One layer class and how it is patched.

    Args:
        model_types: the ``config.model_type`` values whose models hold this class.
        module: the module that defines the class (``transformers.models.qwen3_5.modeling_qwen3_5``).
        layer: the class name (``Qwen3_5GatedDeltaNet``).
        ops: ops the replacement forward calls, in the order they run.
        forward: the replacement forward, or ``None`` when this release replaces nothing in the layer.
        note: one line for ``fusepatch list``.
    """

    model_types: tuple[str, ...]
    module: str
    layer: str
    ops: tuple[str, ...]
    forward: Callable | None
    note: str = ""

    def matches(self, module: object) -> bool:
        cls = type(module)
        return any(k.__name__ == self.layer and k.__module__ == self.module for k in cls.__mro__)

    def to_dict(self) -> dict:
        return {
            "model_types": list(self.model_types),
            "layer": self.layer,
            "module": self.module,
            "ops": list(self.ops),
            "patched_forward": None if self.forward is None else f"{self.forward.__module__}.{self.forward.__name__}",
            "note": self.note,
        }
