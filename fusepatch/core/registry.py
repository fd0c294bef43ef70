"""The registry: which Hugging Face layer classes fusepatch replaces, with which forward and ops.

Rows name classes by module path and class name, never by importing them, so a transformers without a
family still imports fusepatch. Family tables live in ``fusepatch/models/<family>.py``; users add rows with
:func:`register`.
"""

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

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.layer}"

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


_USER_ROWS: list[Row] = []


def register(row: Row) -> None:
    """Add a row (checked before the built-in ones, so a user row can override a class's patch).

    Example::

        >>> from fusepatch.core.registry import Row, register
        >>> register(Row(("my_qwen",), "my_pkg.modeling", "MyRMSNorm", ("rms_norm",), my_forward))  # doctest: +SKIP
    """
    from fusepatch.ops import OPS

    unknown = [op for op in row.ops if op not in OPS]
    if unknown:
        raise ValueError(f"row {row.layer}: unknown op(s) {unknown}; known ops: {sorted(OPS)}")
    _USER_ROWS.insert(0, row)


def all_rows() -> list[Row]:
    from fusepatch.models import BUILTIN_ROWS

    return [*_USER_ROWS, *BUILTIN_ROWS]


def rows_for(model_types: set[str]) -> list[Row]:
    return [row for row in all_rows() if set(row.model_types) & model_types]


def known_model_types() -> list[str]:
    return sorted({t for row in all_rows() for t in row.model_types})


def add_candidate(op: str, candidate, *, first: bool = True) -> None:
    """Add a kernel candidate to an op (first in its source's priority by default). Applies to models patched
    afterwards.

    Example::

        >>> fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("my-org/swiglu", "swiglu")))  # doctest: +SKIP
    """
    import dataclasses

    from fusepatch.ops import OPS

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(OPS)}")
    current = OPS[op]
    if any(c.name == candidate.name for c in current.candidates):
        raise ValueError(f"op {op!r} already has a candidate named {candidate.name!r}")
    candidates = (candidate, *current.candidates) if first else (*current.candidates, candidate)
    OPS[op] = dataclasses.replace(current, candidates=candidates)
