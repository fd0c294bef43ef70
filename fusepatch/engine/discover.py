"""What ``apply`` finds in a model before planning: its model types, the model inside a training wrapper, where and
in which dtype its layers compute, and the modules each registry row matches."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable

import torch

from fusepatch.base.dtypes import autocast_dtype, fsdp_compute_dtype
from fusepatch.base.row import Row
from fusepatch.engine import instance_forward
from fusepatch.engine.registry import known_model_types
from fusepatch.layers.support.lora import held_as


def model_types(model: torch.nn.Module) -> tuple[str, ...]:
    config = getattr(model, "config", None)
    found: list[str] = []
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "get_text_config", lambda: None)()):
        model_type = getattr(cfg, "model_type", None)
        if isinstance(model_type, str) and model_type not in found:
            found.append(model_type)
    return tuple(found)


def _inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model a training wrapper runs, or None. DDP and DataParallel (``.module``) and torch.compile's
    OptimizedModule (``._orig_mod``) call the model they hold and keep no copy of its forwards, so patching the
    model inside is patching it before wrapping: DataParallel's replicas are made per call from it, and DDP's
    hooks are on the parameters, which patching leaves as they are."""
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        return model.module
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # never imported: no OptimizedModule exists
    if compiled is not None and isinstance(model, compiled.OptimizedModule):
        return model._orig_mod
    return None


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without the training wrappers around it (``_inner``), e.g. ``DDP(torch.compile(model))``."""
    while (inner := _inner(model)) is not None:
        model = inner
    return model


def held_model(model: torch.nn.Module) -> str:
    """For a module without a model type: where in it a model fusepatch knows sits, and how to patch that one
    (a container fusepatch does not know may copy or shard what it holds, so it is not patched through)."""
    known = set(known_model_types())
    for path, module in model.named_modules():
        if path and known & set(model_types(module)):
            outer, inner = type(model).__name__, type(module).__name__
            return (
                f"{outer} holds a {inner} at .{path}: apply to that model, before wrapping it "
                f"(fusepatch.apply(model.{path}))"
            )
    return ""


def no_rows(model: torch.nn.Module, types: tuple[str, ...]) -> str:
    """Why no row patches anything in ``model``: its model types are not in the registry, or it holds a model that
    is (``held_model``)."""
    label = ", ".join(repr(t) for t in types) or "(no config.model_type)"
    held = "" if types else held_model(model)
    if held:
        return f"{held}; {type(model).__name__} is left untouched"
    return (
        f"no fusepatch rows for model_type {label}; the model is left untouched "
        f"(supported: {', '.join(known_model_types())})"
    )


def patched(model: torch.nn.Module) -> dict[Row, list[torch.nn.Module]]:
    """The modules of ``model`` that are patched, by the row that patched them."""
    groups: dict[Row, list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        if state is not None:
            groups[state.row].append(module)
    return groups


def compute(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> tuple[str, torch.dtype, bool]:
    """Where and in which dtype the layers compute, and whether that dtype is cast to (not the parameters' own):
    ``compute_dtype`` if given (mixed precision: the Trainer's ``bf16=True`` on fp32 weights), else FSDP2's
    compute dtype, else an active autocast's, else the parameters'."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            device = parameter.device.type
            running = None if device == "meta" else autocast_dtype(device)  # autocast has no meta device
            cast = compute_dtype or fsdp_compute_dtype(model) or running
            return device, cast or parameter.dtype, cast is not None
    return "cpu", torch.float32, False


def matches(
    model: torch.nn.Module, rows: list[Row], owned: Callable[[dict], dict] = lambda found: {}
) -> tuple[dict[Row, list[torch.nn.Module]], dict[str, list[str]]]:
    """The modules each row patches; and, by reason, the paths of those a row matched but leaves (``Row.fits``, a
    forward set on the instance: ``instance_forward.refusal``, unless ``owned`` says another library computes the
    row there: a trainer's fused head, reported as such). A module peft holds in a LoRA wrapper stands for the
    wrapper's name in its layer (``held_as``)."""
    found: dict[Row, list[torch.nn.Module]] = defaultdict(list)
    left: dict[str, list[str]] = defaultdict(list)
    for path, module in model.named_modules():
        name = held_as(path)
        for row in rows:
            if row.matches(module, name):
                why = row.fits(module) if row.fits is not None else None
                if why is None and (refused := instance_forward.refusal(module)) and not owned({row: [module]}):
                    why = refused
                if why is None:
                    found[row].append(module)
                else:
                    left[why].append(path)
                break
    return found, dict(left)
