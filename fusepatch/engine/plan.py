"""What one ``apply`` call asked for (``Request``), what it found in the model (``Plan``) and the dispatchers it
made (``Resolved``): the values the pipeline's steps hand each other (``engine/patch.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusepatch.base.row import Row
from fusepatch.engine.reporting import LayerReport
from fusepatch.engine.resolve import Dispatch


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
    precision: str | None = None  # "fp8": the precision rows too (None: the model's own GEMM precision)
    drop_frozen_weights: bool = False  # with "fp8": frozen projections keep their weight in FP8 only


@dataclass(frozen=True)
class Plan:
    """What ``apply`` found in the model: its layers by registry row, where and in which dtype they compute, and
    why nothing is patched (``message``) when that is so."""

    model: torch.nn.Module
    model_types: tuple[str, ...]
    found: dict[Row, list[torch.nn.Module]]
    owners: dict[Row, str]  # head rows whose loss a trainer's own fused head computes -> who
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
