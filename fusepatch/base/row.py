"""The registry's row: one Hugging Face layer class and how fusepatch patches it (a value; the table itself is
``fusepatch/models/``, the registry that reads it ``fusepatch/engine/registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Binding:
    """A module-level name of a foreign package that a row's replacement forward needs replaced while the layer is
    patched (``transformers.masking_utils.find_packed_sequence_indices``). ``apply`` puts ``wrap(the object
    found)`` in its place once and ``revert`` puts the object back (``layers/support/bindings.py``); the wrapper
    must do what the object does unless the calling thread is inside a patched layer that asked it for more.
    Compared by place alone: ``wrap`` is how, and one name holds one wrapper whichever rows declare it."""

    module: str
    name: str
    wrap: Callable[[object], object] = field(compare=False)


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
        names: when set, only modules of exactly this class held under one of these attribute names
            (``q_proj``): a row for a generic class such as ``torch.nn.Linear``, whose subclasses (a quantized
            or already converted layer) are left as they are.
        precision: when set, the row applies only to the ``apply`` calls that select it (``Request.row_precisions``):
            its ``precision``, and ``options.head_rows(lm_head_precision)``. Such a row comes before the row it
            stands in for (the first row that matches a module patches it).
        fits: when set, a module the row matches is patched only if ``fits(module)`` is None; otherwise it gives
            why it is left as it is (``apply`` says it, naming the modules).
        bindings: the foreign module-level names the replacement forward needs replaced while a module of the row
            is patched (a modeling module's ``apply_rotary_pos_emb``): installed by ``apply``, released by
            ``revert``.
        role: what the layer is in the model, for the engine's features (``engine/features/``), which act on
            layers by role, never by their forward: ``"head"`` (a causal-LM head computing the loss: a trainer's
            own fused head may take it over), ``"decoder"`` (a decoder layer: CUDA graphs capture stacks of them),
            ``"mlp"`` (a SwiGLU MLP: ``FUSEPATCH_MLP_RECOMPUTE``), ``"projection"`` (a linear projection),
            ``"norm"``, ``"attention"``, ``"linear_attention"``, ``"experts"``, ``"rotary"``, ``"base_model"``;
            ``""`` for a row no feature acts on.
    """

    model_types: tuple[str, ...]
    module: str
    layer: str
    ops: tuple[str, ...]
    forward: Callable | None
    note: str = ""
    names: tuple[str, ...] = ()
    precision: str | None = None
    fits: Callable[[object], str | None] | None = None
    bindings: tuple[Binding, ...] = ()
    role: str = ""

    def matches(self, module: object, name: str = "") -> bool:
        """Whether this row patches ``module``, held by its parent as ``name`` (the last part of its path)."""
        cls = type(module)
        if self.names:
            return name in self.names and cls.__name__ == self.layer and cls.__module__ == self.module
        return any(k.__name__ == self.layer and k.__module__ == self.module for k in cls.__mro__)

    def to_dict(self) -> dict:
        return {
            "model_types": list(self.model_types),
            "layer": self.layer,
            "module": self.module,
            "ops": list(self.ops),
            "patched_forward": None if self.forward is None else f"{self.forward.__module__}.{self.forward.__name__}",
            "note": self.note,
            **({"names": list(self.names)} if self.names else {}),
            **({"precision": self.precision} if self.precision else {}),
            **({"bindings": [f"{b.module}.{b.name}" for b in self.bindings]} if self.bindings else {}),
            **({"role": self.role} if self.role else {}),
        }
