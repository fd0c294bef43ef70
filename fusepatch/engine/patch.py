"""apply / revert / report: replace ``forward`` on matching module instances, and undo it exactly.

Only the instance's ``forward`` attribute changes, so parameter names, ``state_dict()``, checkpoints and the
module tree stay as they were, and ``revert`` restores the previous forward object itself. What ``apply`` does
beyond choosing kernels is its features' (``engine/features/``): each step asks every one of them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fusepatch import backends
from fusepatch.backends import deepspeed
from fusepatch.base import options
from fusepatch.base.dtypes import dtype_name
from fusepatch.base.env import capture
from fusepatch.base.log import logger
from fusepatch.base.row import Row
from fusepatch.engine import discover, features, instance_forward
from fusepatch.engine import outcome as messages
from fusepatch.engine.features import FEATURES, RUNNERS, SLOTS
from fusepatch.engine.plan import REPORT_REQUEST, Plan, Request, Resolved, checked
from fusepatch.engine.registry import rows_for
from fusepatch.engine.reporting import LayerReport, PatchReport
from fusepatch.engine.resolve import make_dispatch


class _ClassForward:
    """Marks a module that had no forward of its own before ``apply`` (its class's ran); one object, also after a
    copy or a pickle round trip."""

    def __reduce__(self) -> str:
        return "_NO_INSTANCE_FORWARD"

    def __repr__(self) -> str:
        return "<the class's forward>"


_NO_INSTANCE_FORWARD = _ClassForward()


class _Bound:
    """A replacement forward bound to its module as a method is (``__func__``, ``__self__``), that copies and
    pickles with the module: a bound method pickles as the module's attribute of its function's name, which a
    patched module does not have. Its signature is the original forward's, which the Trainer reads to keep a
    dataset's columns. A call runs the forward, unless a feature runs it its own way (``RUNNERS``)."""

    def __init__(self, function: Callable[..., Any], module: torch.nn.Module) -> None:
        self.__func__ = function
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        for runs in RUNNERS:
            runner = runs(self.__self__, args, kwargs)
            if runner is not None:
                return runner(self.__func__, self.__self__, args, kwargs)
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        held = self.__self__.__dict__.get("_fusepatch")
        return inspect.signature(held.original if held is not None else types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<fusepatch {self.__func__.__name__} of {type(self.__self__).__name__}>"


class FusePatchError(RuntimeError):
    """Raised by ``apply(..., strict=True)`` when any op would fall back; nothing was patched."""


@dataclass
class PatchState:
    """Kept on each patched module as ``module._fusepatch``, with an attribute for each of the features' slots
    (``SLOTS``: ``drop_frozen``, ``mlp_recompute``, ``traceable_on``, ...).

    It copies and pickles with the module (``copy.deepcopy``: EMA copies, TRL's reference model; ``torch.save``):
    the copy is patched too, its dispatchers shared with the source (a copy) or made anew (a pickle), and its
    ``original`` bound to itself."""

    row: Row
    ops: dict[str, Any]  # op name -> its Dispatch
    owner: torch.nn.Module
    instance_forward: Any  # what the fused forward's seat held (``instance_forward.bind``), or _NO_INSTANCE_FORWARD
    original: Callable[..., Any] = dataclasses.field(init=False, repr=False)  # the forward before apply (bound)
    # calls that ran transformers' forward instead of the replacement, by reason (``report`` lists them)
    transformers_calls: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    # the apply's kernel choices (ops, exclude, prefer): a later apply with others says they do not reach it
    choosing: tuple = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        self.original = self._forward_before()
        self.__dict__.update(SLOTS)

    def _forward_before(self) -> Callable[..., Any]:
        if self.instance_forward is _NO_INSTANCE_FORWARD:
            return types.MethodType(type(self.owner).forward, self.owner)
        return self.instance_forward

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["original"]  # a bound method of the owner: derived again, never pickled by name
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({**SLOTS, "transformers_calls": {}, "choosing": ()})  # an older pickle's
        self.__dict__.update(state)
        self.original = self._forward_before()
        for feature in FEATURES:
            feature.setstate(self)


def _plan(model: torch.nn.Module, request: Request) -> Plan:
    """The model's rows and compute dtype, or the reason nothing is patched (disabled, no rows for the model)."""
    model_types = discover.model_types(model)
    device, compute, cast = discover.compute(model, request.compute_dtype)
    plan = Plan(model, model_types, {}, {}, device, compute, cast, {})
    for feature in FEATURES:
        plan = feature.plan(plan, request)
    if options.switch("FUSEPATCH_DISABLE"):
        message = "FUSEPATCH_DISABLE is set: nothing patched, the model runs as transformers ships it"
        return dataclasses.replace(plan, message=message)
    rows = rows_for(set(model_types), request.row_precisions)
    found, left = discover.matches(model, rows, features.owners) if rows else ({}, {})
    if not found:
        message = discover.no_rows(model, model_types)
        if request.strict:
            raise FusePatchError(message)
        return dataclasses.replace(plan, message=message)
    if plan.on_meta and request.strict:
        raise FusePatchError(messages.META_STRICT)
    return dataclasses.replace(plan, found=dict(found), owners=features.owners(found), left=left)


def _resolve(plan: Plan, request: Request) -> Resolved:
    """Each row's dispatchers (reused from an earlier apply), and their choices for the model's device and dtype,
    self-tested; on the meta device each op is chosen at its first real call."""
    env = capture()
    resolved = Resolved({}, [])
    for row, modules in plan.found.items():
        if row in plan.owners:  # another library computes it (a trainer's fused head): left to it, and said
            choices = plan.owners[row]
            resolved.layers.append(LayerReport(row.layer, len(modules), False, choices, note=row.note))
            logger.info("fusepatch: %s: %s", row.layer, choices[0].provides if choices else "left as it is")
            continue
        existing = [m for m in modules if hasattr(m, "_fusepatch")]
        if existing:  # reuse the dispatchers of an earlier apply: choices and self-tests stay as they were
            resolved.dispatches[row] = existing[0]._fusepatch.ops
        else:
            made = functools.partial(make_dispatch, env=env, prefer=request.prefer, label=row.layer, ops=request.ops)
            resolved.dispatches[row] = {n: made(n, exclude=request.exclude, module=modules[0]) for n in row.ops}
        dtype = dtype_name(plan.compute)
        choices = () if plan.on_meta else tuple(d.choice(plan.device, dtype) for d in resolved.dispatches[row].values())
        resolved.layers.append(LayerReport(row.layer, len(modules), row.forward is not None, choices, note=row.note))
    return resolved


def _bind(plan: Plan, resolved: Resolved, request: Request) -> tuple[list[tuple[torch.nn.Module, PatchState]], int]:
    """Every matched module's instance forward replaced; returns (the newly patched with their states, how many
    were patched already). The features' ``bind`` sets their slots after."""
    patched, already = [], 0
    for row, modules in plan.found.items():
        if row.forward is None or row in plan.owners:
            continue
        for module in modules:
            if hasattr(module, "_fusepatch"):
                already += 1
                continue
            # in "forward", or in "_old_forward" inside an accelerate hook
            held = instance_forward.bind(module, _Bound(row.forward, module), _NO_INSTANCE_FORWARD)
            module._fusepatch = state = PatchState(row, resolved.dispatches[row], module, held)
            state.choosing = messages.choices_of(request)
            patched.append((module, state))
    return patched, already


def _report(
    plan: Plan, layers: list[LayerReport], *, message: str = "", newly: int = 0, already: int = 0
) -> PatchReport:
    env = capture()
    versions = {"torch": env.torch, "cuda": env.torch_cuda, "transformers": env.transformers, "triton": env.triton}
    return PatchReport(
        model=type(plan.model).__name__,
        model_types=plan.model_types,
        device=plan.device,
        dtype=dtype_name(plan.compute),
        layers=tuple(layers),
        message=message or plan.message,
        newly_patched=newly,
        already_patched=already,
        drift=backends.drifted(),
        lora=plan.adapters,
        sharding=deepspeed.describe(plan.model),
        environment=versions,
    )


def _finish(plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
    """After binding: later choices announced, the log, then each feature's ``finish`` (tracing, layer graphs)."""
    for dispatch in (d for row_dispatches in resolved.dispatches.values() for d in row_dispatches.values()):
        dispatch.announce = True
    messages.log(report, request.verbose, said=bool(newly or plan.on_meta))
    for feature in FEATURES:
        feature.finish(plan, resolved, report, request, newly)


def apply(
    model: torch.nn.Module,
    *,
    ops: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] = (),
    prefer: str | Iterable[str] | None = None,
    strict: bool = False,
    compute_dtype: torch.dtype | str | None = None,
    cuda_graphs: bool = False,
    verbose: bool | None = None,
    precision: str | None = None,
    drop_frozen_weights: bool = False,
    lm_head_precision: str | None = None,
) -> PatchReport:
    """Patch every layer of ``model`` that the registry knows, in place.

    Each op of each layer gets the first candidate kernel (by ``prefer``) that passes its checks and its
    self-test for the model's current device and dtype; the choice is re-made per call if the model moves.
    Anything that falls back to eager is logged at WARNING with the reason and the fix.

    On a model patched before, only what is not patched yet is patched (``precision="fp8"``'s rows), and
    ``cuda_graphs=True`` graphs the layers; what the earlier apply set on its modules (kernel choices, FP8 rows,
    ``drop_frozen_weights``, ``FUSEPATCH_MLP_RECOMPUTE``, CUDA graphs) stays, said at WARNING with the fix
    (``revert``, then ``apply``).

    Args:
        model: a Hugging Face model (``Qwen3_5ForCausalLM``, ``Qwen3ForCausalLM``, ...), or one wrapped by DDP,
            ``nn.DataParallel`` or ``torch.compile``: the model inside is patched.
        ops: only these ops may use fused kernels (default: all); a list, or one string (``"swiglu"``,
            ``"swiglu,rms_norm"``).
        exclude: ops that stay eager (a list or one string).
        prefer: kernel source priority, e.g. ``("pip", "hub")`` or ``"hub"``; default
            ``FUSEPATCH_PREFER`` or ``("pip", "hub")``. Sources left out are reported as the reason
            their candidates were not tried.
        strict: raise :class:`FusePatchError` listing every fallback instead of patching anything.
        compute_dtype: the dtype the layers will compute in when it is not the parameters' (autocast over fp32
            weights, e.g. ``Trainer(bf16=True)``): choices and self-tests are made for it. A torch floating dtype or
            its name (``"bfloat16"``, ``"bf16"``, ``"fp16"``, ``"fp32"``). Default: FSDP2's
            ``MixedPrecisionPolicy.param_dtype``, else an active autocast's dtype, else the parameters'.
        cuda_graphs: replay the decoder layers of training steps from CUDA graphs once a step's shape is steady
            (``fusepatch/layers/layer_graphs.py``): for small models whose GPU waits for the host. Fixed-shape
            batches without packing, padding masks or caches; other calls run as usual, and why is said once.
        precision: ``"fp8"``: the decoder's projections (attention q/k/v/o, the Gated DeltaNet's input and output
            projections, the MLPs' gate/up/down) train with FP8 GEMMs (op ``fp8_linear``; an Ada, Hopper or newer
            GPU), their weights and optimizer as they are; where FP8 cannot run they stay as they were and the
            fallback is said. Default None: every GEMM in the model's own precision.
        drop_frozen_weights: with ``precision="fp8"``: a projection whose weight takes no gradient (LoRA's frozen
            base) keeps it in FP8 only from its first FP8 call: half its memory. The module's ``weight`` then
            raises if read for values (``revert`` puts back an FP8-rounded copy and says so).
        lm_head_precision: ``"fp8"``: the fused loss runs the LM head's GEMMs in FP8 (op ``fp8_linear_cross_entropy``;
            docs/fp8.md, "The LM head in FP8"); where it cannot, in the model's precision, and why is said.
        verbose: ``True``: log the whole report table; ``None``: one line of totals; ``False``: neither. Every
            fallback is logged at WARNING in all three (each distinct reason once, with its fix). The log shows
            without any logging set up (``FUSEPATCH_VERBOSITY``: error, warning, info, debug; default info).

    Raises:
        TypeError, ValueError: an argument, or a ``FUSEPATCH_*`` variable (docs/env-vars.md), outside the values
            it takes (``strict="no"``, ``FUSEPATCH_DISABLE=maybe``); the message names them. Nothing is patched.
        FusePatchError: ``strict=True`` and an op would fall back.

    Returns:
        The :class:`PatchReport`. Example::

            >>> report = fusepatch.apply(model)
            >>> print(report)  # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fusepatch.apply expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    given = (ops, exclude, prefer, strict, compute_dtype, cuda_graphs, verbose, precision, drop_frozen_weights)
    request = checked(*given, lm_head_precision)
    model = discover.unwrapped(model)
    plan = _plan(model, request)
    if plan.message:  # nothing to patch: disabled, or no rows for the model
        logger.warning("fusepatch: %s", plan.message)
        return _report(plan, [])
    messages.say_left(plan)  # modules a row matched but cannot patch: named, never silent
    resolved = _resolve(plan, request)
    if request.strict and (pending := _report(plan, resolved.layers)).fallbacks():
        raise FusePatchError(messages.strict_refusal(plan, pending))
    patched, already = _bind(plan, resolved, request)
    news = [said for feature in FEATURES if (said := feature.bind(plan, request, patched))]
    kept = messages.kept(plan, request) if already else []  # said at WARNING with the fix
    newly = len(patched)
    unselected = messages.nothing_selected(plan, request) if newly else ""  # said at WARNING
    outcome = "; ".join(filter(None, (messages.outcome(plan, newly, already, kept, news), unselected)))
    report = _report(plan, resolved.layers, message=outcome, newly=newly, already=already)
    _finish(plan, resolved, report, request, newly)
    return report


def revert(model: torch.nn.Module) -> int:
    """Restore every forward ``apply`` replaced, exactly as it was. Returns how many modules were restored."""
    model = discover.unwrapped(model)
    patched = [(m, state) for m in model.modules() if (state := m.__dict__.get("_fusepatch")) is not None]
    for feature in FEATURES:
        feature.revert(model, patched)
    for module, state in patched:
        instance_forward.put_back(module, state.instance_forward, _Bound, _NO_INSTANCE_FORWARD)
        del module._fusepatch
    logger.info("fusepatch: reverted %d modules", len(patched))
    return len(patched)


def report(model: torch.nn.Module, compute_dtype: torch.dtype | str | None = None) -> PatchReport:
    """The current report for a model: patched layers, and each op's choice for the model's present device
    and dtype (a model moved to the GPU after ``apply`` shows its GPU choices; ``compute_dtype`` as in
    :func:`apply`)."""
    model = discover.unwrapped(model)
    plan = _plan(model, dataclasses.replace(REPORT_REQUEST, compute_dtype=options.compute_dtype(compute_dtype)))
    device, dtype = plan.device, dtype_name(plan.compute)
    groups = discover.patched(model)
    owned = features.owners(
        groups
    )  # patched, and since taken over (a trainer wrapped the head: its fused head computes)
    layers = []
    for row, modules in groups.items():
        if row in owned:
            choices = owned[row]
        elif device == "meta":
            choices = ()
        else:
            choices = tuple(d.choice(device, dtype) for d in modules[0]._fusepatch.ops.values())
        layers.append(LayerReport(row.layer, len(modules), True, choices, note=row.note))
    for row, choices in plan.owners.items():
        if row not in groups:
            layers.append(LayerReport(row.layer, len(plan.found[row]), False, choices))
    total = sum(len(m) for m in groups.values())
    built = _report(plan, layers, message="" if total else "not patched", already=total)
    built = dataclasses.replace(built, transformers_calls=messages.transformers_calls(groups))
    states = [module._fusepatch for modules in groups.values() for module in modules]
    for feature in FEATURES:
        built = feature.report(built, states)
    return built
