"""``apply(cuda_graphs=True)``: the patched decoder stacks (``Row.role`` "decoder") replay from CUDA graphs
(``layers/layer_graphs.py``); graphs captured before a layer is patched anew or reverted are dropped."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import torch

from fusepatch.base.log import logger
from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.reporting import PatchReport
from fusepatch.layers import layer_graphs


def decoder_stacks(model: torch.nn.Module, new: Collection[int] = ()) -> tuple[list[list[torch.nn.Module]], bool]:
    """The decoder stacks ``cuda_graphs`` can capture (``ModuleList``s of patched dense decoder layers), and whether
    a patched stack was left out for its mixture-of-experts layers (their routing decides work on the host).
    ``new``: the ids of modules to count as not patched yet (those this call patched)."""
    stacks, moe = [], False
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        layers = list(module)
        states = [None if id(layer) in new else layer.__dict__.get("_fusepatch") for layer in layers]
        if not all(state is not None and state.row.role == "decoder" for state in states):
            continue
        if any(hasattr(getattr(layer, "mlp", None), "experts") for layer in layers):
            moe = True
            continue
        stacks.append(layers)
    return stacks, moe


def graphed(model: torch.nn.Module) -> bool:
    return any(layer_graphs.ATTRIBUTE in module.__dict__ for module in model.modules())


def install(model: torch.nn.Module) -> None:
    """One :class:`~fusepatch.layers.layer_graphs.LayerGraphs` per decoder stack."""
    stacks, moe = decoder_stacks(model)
    if moe:
        logger.warning(
            "fusepatch: CUDA graphs: %s's layers are mixture-of-experts layers, whose routing decides work on "
            "the host each step; they run without graphs. Fix: none needed; leave cuda_graphs off",
            type(model).__name__,
        )
    for layers in stacks:
        if layers[0].__dict__.get(layer_graphs.ATTRIBUTE) is None:
            layer_graphs.install(layers)
    if not stacks:
        logger.warning(
            "fusepatch: CUDA graphs: no patched decoder stack in %s to capture; it runs without graphs",
            type(model).__name__,
        )


class CudaGraphs(Feature):
    name = "cuda_graphs"
    under = {
        "fsdp2": ("cuda_graphs=True steps aside: " + layer_graphs.FIXES["sharded"],),
        "deepspeed": (
            "cuda_graphs=True steps aside: ZeRO-3 gathers parameters in hooks on every module, and a layer whose "
            "modules have hooks is not captured (a graph would run them once, at capture)",
        ),
    }

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        """For a model patched before: that this call graphs the layers patched before (none are yet)."""
        if not request.cuda_graphs or graphed(plan.model):
            return ""
        stacks, _ = decoder_stacks(plan.model, new={id(module) for module, _ in patched})
        return "cuda_graphs=True: the decoder layers are graphed from now on" if stacks else ""

    def kept(self, plan: Plan, request: Request, states: list) -> list[str]:
        if request.cuda_graphs or not graphed(plan.model):
            return []
        return ["the decoder layers keep their CUDA graphs (this call's cuda_graphs=False)"]

    def finish(self, plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
        if newly:  # graphs captured before replay the layers as they were: captured again once steady
            layer_graphs.drop(plan.model)
        if request.cuda_graphs:
            install(plan.model)

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        layer_graphs.drop(model)  # a revert in part leaves graphs on the layers beside it: they replayed this part
        for module in model.modules():
            module.__dict__.pop(layer_graphs.ATTRIBUTE, None)

    def runs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Callable | None:
        graphs = module.__dict__.get(layer_graphs.ATTRIBUTE)  # a decoder layer under apply(cuda_graphs=True)
        return None if graphs is None else functools.partial(graphs[0].call, graphs[1])


FEATURE = CudaGraphs()
