"""What ``apply`` does beyond choosing kernels, one module each: the pipeline (``engine/patch.py``) calls every
feature of ``FEATURES`` at each of its steps and never names one.

A feature (``base.Feature``; each hook optional) has:

- ``slots``: the attributes it owns on each patched module's ``PatchState``, with their defaults (set when a
  module is patched, and when a state pickled without them is loaded; a DataParallel replica copies them).
- ``under``: per sharding engine (``"fsdp2"``, ``"deepspeed"``), what the feature does differently under it and
  why (``doctor``'s distributed section).
- ``plan(plan, request) -> Plan``: what it adds to the plan (LoRA's adapters), or does first (bindings' sweep).
- ``owners(found) -> {row: choices}``: rows another library computes in this model, left unpatched, each with
  the choices its ops report (a trainer's own fused head).
- ``bind(plan, request, patched) -> str``: after the engine patched ``patched`` (this call's ``(module, state)``
  pairs, maybe none): its slots set, and the line the report's message gets for a model patched before.
- ``kept(plan, request, states) -> [str]``: what the modules patched before keep of this feature where this call
  asks otherwise (said at WARNING with the fix).
- ``finish(plan, resolved, report, request, newly)``: after the report is made and logged.
- ``report(report, states) -> PatchReport``: ``fusepatch.report``'s value with what this feature counts.
- ``revert(model, patched)``: undo what it did, before the engine puts the forwards back.
- ``setstate(state)``: a copy of a patched module made (``deepcopy``, a pickle loaded; every slot travels with
  it): what the copy needs to run.
- ``runs(module, args, kwargs) -> runner | None``: at each call of a patched forward, in ``FEATURES`` order: a
  feature that runs this call its own way (outside dynamo, from a CUDA graph) returns
  ``runner(function, module, args, kwargs)``.
"""

from __future__ import annotations

import torch

from fusepatch.base.row import Row
from fusepatch.engine.features import (
    bindings,
    cuda_graphs,
    data_parallel,
    fp8,
    lora,
    mlp_recompute,
    traceable,
    trainer_head,
)
from fusepatch.engine.features.base import Feature
from fusepatch.engine.resolve import Choice

FEATURES: tuple[Feature, ...] = (
    bindings.FEATURE,
    lora.FEATURE,
    trainer_head.FEATURE,
    fp8.FEATURE,
    mlp_recompute.FEATURE,
    traceable.FEATURE,  # asked before the CUDA graphs at each call: a call dynamo traces never replays one
    cuda_graphs.FEATURE,
    data_parallel.FEATURE,
)
# the features that may run a patched forward's call their own way, in the order they are asked
RUNNERS = tuple(feature.runs for feature in FEATURES if feature.runs is not None)
# every PatchState attribute a feature owns, with its default
SLOTS = {name: default for feature in FEATURES for name, default in feature.slots.items()}


def owners(found: dict[Row, list[torch.nn.Module]]) -> dict[Row, tuple[Choice, ...]]:
    """The rows another library computes in this model (every feature's ``owners``), each with its ops' choices."""
    return {row: choices for feature in FEATURES for row, choices in feature.owners(found).items()}


__all__ = ["FEATURES", "RUNNERS", "SLOTS", "Feature", "owners"]
