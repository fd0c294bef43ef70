"""What one ``apply`` call asked for (``Request``), what it found in the model (``Plan``) and the dispatchers it
made (``Resolved``): the values the pipeline's steps hand each other (``engine/patch.py``); and ``checked``, which
makes the request from ``apply``'s arguments."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from fusepatch.base import options
from fusepatch.base.row import Row
from fusepatch.engine.reporting import LayerReport
from fusepatch.engine.resolve import PREFERABLE, Choice, Dispatch, candidate_names, preferred_sources
from fusepatch.ops import OPS


@dataclass(frozen=True)
class Request:
    """``apply``'s arguments, checked (``options``): what may be fused, from where, and what to say."""

    ops: tuple[str, ...] | None
    exclude: tuple[str, ...]
    prefer: tuple[str, ...]
    strict: bool
    compute_dtype: torch.dtype | None
    cuda_graphs: bool
    verbose: bool | None
    mlp_recompute: bool = False  # FUSEPATCH_MLP_RECOMPUTE, read when apply runs
    precision: str | None = None  # one of ``options.PRECISIONS``: its rows too (None: the model's own precision)
    drop_frozen_weights: bool = False  # with a precision: frozen projections keep only that precision's copy
    lm_head_precision: str | None = None  # one of ``options.PRECISIONS``: the causal LM's loss runs its GEMMs in it

    @property
    def row_precisions(self) -> tuple[str, ...]:
        """The ``Row.precision`` values this request selects (``options.row_precisions``)."""
        return options.row_precisions(self.precision, self.lm_head_precision)


@dataclass(frozen=True)
class Plan:
    """What ``apply`` found in the model: its layers by registry row, where and in which dtype they compute, and
    why nothing is patched (``message``) when that is so."""

    model: torch.nn.Module
    model_types: tuple[str, ...]
    found: dict[Row, list[torch.nn.Module]]
    owners: dict[Row, tuple[Choice, ...]]  # rows another library computes (a trainer's fused head) -> their choices
    device: str
    compute: torch.dtype
    cast: bool
    adapters: dict
    message: str = ""
    left: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # reason -> module paths a row leaves

    @property
    def on_meta(self) -> bool:
        return self.device == "meta"


@dataclass
class Resolved:
    """Each row's dispatchers (one per op) and the layer reports with the choices they made."""

    dispatches: dict[Row, dict[str, Dispatch]]
    layers: list[LayerReport]


REPORT_REQUEST = Request(None, (), (), False, None, False, None)  # report(model): a plan that raises nothing


def checked(ops=None, exclude=(), prefer=None, strict=False, compute_dtype=None, cuda_graphs=False, verbose=None,
            precision=None, drop_frozen_weights=False, lm_head_precision=None) -> Request:  # fmt: skip
    """``apply``'s arguments and the ``FUSEPATCH_*`` variables checked: the request, or the error naming the values
    an argument or variable takes. Its parameters are ``apply``'s keyword arguments, defaults included."""
    # every FUSEPATCH_* variable, read or not on this call, all bad ones in one error (before the request reads one)
    options.check_environment(candidate_names(), PREFERABLE)
    request = Request(
        ops=None if ops is None else tuple(options.names(ops, "ops")),
        exclude=tuple(options.names(exclude, "exclude")),
        prefer=(),
        strict=options.boolean(strict, "strict"),
        compute_dtype=options.compute_dtype(compute_dtype),
        cuda_graphs=options.boolean(cuda_graphs, "cuda_graphs"),
        verbose=options.optional_boolean(verbose, "verbose"),
        mlp_recompute=options.switch("FUSEPATCH_MLP_RECOMPUTE"),
        precision=options.precision(precision),
        drop_frozen_weights=options.drop_frozen_weights(drop_frozen_weights, options.precision(precision)),
        lm_head_precision=options.lm_head_precision(lm_head_precision),
    )
    for name in [*(request.ops or ()), *request.exclude]:
        if name not in OPS:
            raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}")
    return dataclasses.replace(request, prefer=preferred_sources(prefer))


def check_apply_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise now what ``apply(model, **kwargs)`` would raise for them, without a model: an unknown name (the
    ``TypeError`` Python gives, with the names ``apply`` takes), or a value outside what its argument or a
    ``FUSEPATCH_*`` variable takes (``apply``'s own error). For the callers that hold ``apply_kwargs`` until a
    model exists (``FusePatchCallback``: the first training step; ``from_pretrained``: after the download)."""
    signature = inspect.signature(checked)
    if "model" in kwargs:
        raise TypeError("apply_kwargs: 'model' is the model itself, not one of apply's keyword arguments")
    try:
        bound = signature.bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"fusepatch.apply() {exc}; it takes {', '.join(signature.parameters)}") from None
    checked(**bound.arguments)
