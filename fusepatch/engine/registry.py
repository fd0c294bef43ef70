"""The registry: which Hugging Face layer classes fusepatch replaces, with which forward and ops.

Rows name classes by module path and class name, never by importing them, so a transformers without a
family still imports fusepatch. Family tables live in ``fusepatch/models/<family>.py``; users add rows with
:func:`register`.
"""

from __future__ import annotations

import dataclasses

from fusepatch.base.op import Op
from fusepatch.base.row import Row
from fusepatch.base.state import current as process_state
from fusepatch.models import BUILTIN_ROWS
from fusepatch.models._rows import completed
from fusepatch.ops import OPS


def register(row: Row) -> None:
    """Add a row (checked before the built-in ones, so a user row can override a class's patch).

    Example::

        >>> from fusepatch import Row, register
        >>> register(Row(("my_qwen",), "my_pkg.modeling", "MyRMSNorm", ("rms_norm",), my_forward))  # doctest: +SKIP
    """
    unknown = [op for op in row.ops if op not in OPS]
    if unknown:
        raise ValueError(f"row {row.layer}: unknown op(s) {unknown}; known ops: {sorted(OPS)}")
    process_state().user_rows.insert(0, completed(row))  # fusepatch's own forward: its role and names too


def all_rows() -> list[Row]:
    return [*process_state().user_rows, *BUILTIN_ROWS]


def rows_for(model_types: set[str], precisions: tuple[str, ...] = ()) -> list[Row]:
    """The rows of these model types; rows of a precision only when that precision is asked for
    (``Request.row_precisions``)."""
    return [
        row
        for row in all_rows()
        if set(row.model_types) & model_types and (row.precision is None or row.precision in precisions)
    ]


def known_model_types() -> list[str]:
    return sorted({t for row in all_rows() for t in row.model_types})


def add_candidate(op: str, candidate, *, first: bool = True) -> None:
    """Add a kernel candidate to an op (first in its source's priority by default). Applies to models patched
    afterwards; the op table itself is left as ``fusepatch.ops`` defines it.

    Example::

        >>> fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("my-org/swiglu", "swiglu")))  # doctest: +SKIP
    """

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(OPS)}")
    if any(c.name == candidate.name for c in op_with_user_candidates(op).candidates):
        raise ValueError(f"op {op!r} already has a candidate named {candidate.name!r}")
    added = process_state().user_candidates
    before, after = added.get(op, ((), ()))
    added[op] = ((candidate, *before), after) if first else (before, (*after, candidate))


def op_with_user_candidates(name: str) -> Op:
    """The op as ``fusepatch.ops`` defines it, with the candidates users added (``add_candidate``) around its own."""
    op = OPS[name]
    before, after = process_state().user_candidates.get(name, ((), ()))
    return dataclasses.replace(op, candidates=(*before, *op.candidates, *after)) if before or after else op


def all_ops() -> dict[str, Op]:
    """Every op, each with the candidates users added."""
    return {name: op_with_user_candidates(name) for name in OPS}
