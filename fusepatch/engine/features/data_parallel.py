"""``nn.DataParallel`` (what the Trainer uses when it sees several GPUs without torchrun) copies each module's
``__dict__`` into its replicas, so the patched forward and the saved original, both bound to the module, would make
replica 1 run replica 0's weights on another GPU's inputs: each replica of a patched module gets its own binding,
and leaves the per-device attributes (a rotary embedding's tables) to be made anew on its device."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.plan import Plan, Request
from fusepatch.layers import rotary_embedding

REPLICATE = "_replicate_for_data_parallel"  # what nn.DataParallel calls to make a module's replica


def _rebind(fn: Any, old: torch.nn.Module, new: torch.nn.Module) -> Any:
    """``fn`` bound to ``new`` where it was a method bound to ``old``; anything else as it is."""
    if isinstance(fn, types.MethodType) and fn.__self__ is old:
        return types.MethodType(fn.__func__, new)
    return fn


def _replicate_patched(self: torch.nn.Module) -> torch.nn.Module:
    replica = type(self)._replicate_for_data_parallel(self)
    state, bound = self._fusepatch, type(self.__dict__["forward"])  # the engine's binding, as it bound the module
    moved = dataclasses.replace(state, owner=replica, instance_forward=_rebind(state.instance_forward, self, replica))
    fields = {field.name for field in dataclasses.fields(state)}
    moved.__dict__.update({k: v for k, v in vars(state).items() if k not in fields})  # the features' slots
    replica._fusepatch = moved
    replica.forward = bound(state.row.forward, replica)
    replica.__dict__.pop(rotary_embedding.TABLES, None)  # the tables are per device: the replica keeps its own
    setattr(replica, REPLICATE, bound(_replicate_patched, replica))
    return replica


class DataParallel(Feature):
    name = "data_parallel"

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        for module, _ in patched:
            setattr(module, REPLICATE, type(module.__dict__["forward"])(_replicate_patched, module))
        return ""

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        for module, _ in patched:
            module.__dict__.pop(REPLICATE, None)
            module.__dict__.pop(rotary_embedding.TABLES, None)  # derived per device: made anew if patched again


FEATURE = DataParallel()
