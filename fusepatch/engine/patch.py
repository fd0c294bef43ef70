"""apply / revert / report: replace ``forward`` on matching module instances, and undo it exactly.

Only the instance's ``forward`` attribute changes, so parameter names, ``state_dict()``, checkpoints and the
module tree stay as they were, and ``revert`` restores the previous forward object itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fusepatch import backends
from fusepatch.backends import deepspeed
from fusepatch.base import options
from fusepatch.base.dtypes import autocast_dtype, dtype_name, fsdp_compute_dtype
from fusepatch.base.env import capture
from fusepatch.base.row import Row
from fusepatch.base.state import current as process_state
from fusepatch.engine import outcome as messages
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.registry import known_model_types, rows_for
from fusepatch.engine.reporting import LayerReport, PatchReport
from fusepatch.engine.resolve import PREFERABLE, Choice, Dispatch, candidate_names, make_dispatch, preferred_sources
from fusepatch.layers import layer_graphs, rotary_embedding
from fusepatch.layers.causal_lm import causal_lm_forward, conditional_generation_forward, trainer_head
from fusepatch.layers.decoder import decoder_layer_forward, hybrid_decoder_layer_forward
from fusepatch.layers.fp8 import keep_what_variants_read, restore_dropped, say_restored
from fusepatch.layers.simple import swiglu_mlp_forward
from fusepatch.layers.support import bindings, lora
from fusepatch.ops import OPS

logger = logging.getLogger("fusepatch")


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
    dataset's columns."""

    def __init__(self, function: Callable[..., Any], module: torch.nn.Module) -> None:
        self.__func__ = function
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not _traceable(self.__self__._fusepatch, args, kwargs):
            return _outside_dynamo(self.__func__, self.__self__, args, kwargs)
        graphs = self.__self__.__dict__.get(layer_graphs.ATTRIBUTE)  # a decoder layer under apply(cuda_graphs=True)
        if graphs is not None:
            return graphs[0].call(graphs[1], self.__func__, self.__self__, args, kwargs)
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        state = self.__self__.__dict__.get("_fusepatch")
        return inspect.signature(
            state.original if state is not None else types.MethodType(self.__func__, self.__self__)
        )

    def __repr__(self) -> str:
        return f"<fusepatch {self.__func__.__name__} of {type(self.__self__).__name__}>"


OUTSIDE_DYNAMO = (
    "fusepatch: torch.compile: the patched model runs outside dynamo, on its fused kernels; the rest compiles "
    "as usual. Its kernels are not traceable ops yet: every call of one would split the graph, and a step compiled "
    "around them is slower than the uncompiled patched step"
)
UNCHECKED_TRACE = (
    "fusepatch: torch.compile: the patched model runs outside dynamo on {device}, eagerly as it runs uncompiled; "
    "the rest compiles as usual. On a GPU, inductor compiles transformers' Qwen3.5 rotary embedding to wrong "
    "cos/sin tables (transformers' own Qwen3.5 compiled gives logits far outside the bf16 bound). Patched "
    "forwards are traced only on the CPU, where the tests check the trace"
)
# the device types on which dynamo may trace a patched forward without fused kernels: those where the tests
# compare the traced model with the uncompiled one and it matches (on a GPU, everything but the Qwen3.5 rotary
# embedding matched when traced)
TRACED_DEVICES = ("cpu",)


def _traceable(state: PatchState, args: tuple, kwargs: dict) -> bool:
    """Whether dynamo may trace this call of a patched forward: only on the device type where ``apply`` found
    that no op runs a fused kernel. A model patched on the CPU and moved to a GPU afterwards chooses its kernels
    at its first call there, so a call on another device type is kept outside too. (Traced through the fused
    kernels or not, a Qwen3.5 mini model gave wrong logits on a GPU, from inductor's compile of transformers'
    rotary embedding: the GPU tests keep that checked.)"""
    if state.traceable_on is None:
        return False
    device = next((v.device.type for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return device is None or device == state.traceable_on


@torch.compiler.disable
def _outside_dynamo(function: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """A patched forward that torch.compile reached, run as it runs uncompiled; said once per process, with the
    reason that holds for this model: its fused kernels, or a device where the traced path is not checked."""
    if process_state().said.first("patched forward outside dynamo"):
        untraced = module._fusepatch.untraced_on
        logger.warning(UNCHECKED_TRACE.format(device=untraced) if untraced else OUTSIDE_DYNAMO)
    return function(module, *args, **kwargs)


class FusePatchError(RuntimeError):
    """Raised by ``apply(..., strict=True)`` when any op would fall back; nothing was patched."""


@dataclass
class PatchState:
    """Kept on each patched module as ``module._fusepatch``.

    It copies and pickles with the module (``copy.deepcopy``: EMA copies, TRL's reference model; ``torch.save``):
    the copy is patched too, its dispatchers shared with the source (a copy) or made anew (a pickle), and its
    ``original`` bound to itself."""

    row: Row
    ops: dict[str, Dispatch]
    owner: torch.nn.Module
    instance_forward: Any  # what ``module.__dict__['forward']`` held, or _NO_INSTANCE_FORWARD
    original: Callable[..., Any] = dataclasses.field(init=False, repr=False)  # the forward before apply (bound)
    # the device type on which torch.compile may trace the forward (``_traceable``): set by apply where no op runs
    # a fused kernel; None: it always runs outside dynamo
    traceable_on: str | None = dataclasses.field(default=None, repr=False)
    # the device type apply found without fused kernels where dynamo still may not trace (not in TRACED_DEVICES)
    untraced_on: str | None = dataclasses.field(default=None, repr=False)
    # calls that ran transformers' forward instead of the replacement, by reason (``report`` lists them)
    transformers_calls: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    # FUSEPATCH_MLP_RECOMPUTE=1 when apply patched it: the SwiGLU MLP recomputes its product in the backward
    mlp_recompute: bool = dataclasses.field(default=False, repr=False)
    # what a patched forward keeps between calls (an FP8 projection's frozen weight, quantized): never pickled
    cache: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    # apply(precision="fp8", drop_frozen_weights=True): a frozen FP8 projection keeps its weight in FP8 only
    drop_frozen: bool = dataclasses.field(default=False, repr=False)
    # the apply's kernel choices (ops, exclude, prefer): a later apply with others says they do not reach it
    choosing: tuple = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        self.original = self._forward_before()

    def _forward_before(self) -> Callable[..., Any]:
        if self.instance_forward is _NO_INSTANCE_FORWARD:
            return types.MethodType(type(self.owner).forward, self.owner)
        return self.instance_forward

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["original"]  # a bound method of the owner: derived again, never pickled by name
        if self.cache.get("dropped"):  # all that is left of the weight (``layers/fp8.Kept``: without its reference)
            state["cache"] = {"fp8": state["cache"]["fp8"], "dropped": True}
        else:
            state["cache"] = {}  # derived from the module's tensors, again at the next call
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("transformers_calls", {})  # pickled by a release without the count
        self.__dict__.setdefault("cache", {})
        self.__dict__.setdefault("drop_frozen", False)
        self.__dict__.setdefault("choosing", ())
        self.original = self._forward_before()


def _model_types(model: torch.nn.Module) -> tuple[str, ...]:
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


def _held_model(model: torch.nn.Module) -> str:
    """For a module without a model type: where in it a model fusepatch knows sits, and how to patch that one
    (a container fusepatch does not know may copy or shard what it holds, so it is not patched through)."""
    known = set(known_model_types())
    for path, module in model.named_modules():
        if path and known & set(_model_types(module)):
            outer, inner = type(model).__name__, type(module).__name__
            return (
                f"{outer} holds a {inner} at .{path}: apply to that model, before wrapping it "
                f"(fusepatch.apply(model.{path}))"
            )
    return ""


def _compute(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> tuple[str, torch.dtype, bool]:
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


def _disabled() -> bool:
    return options.switch("FUSEPATCH_DISABLE")


def _matches(model: torch.nn.Module, rows: list[Row]) -> tuple[dict[Row, list[torch.nn.Module]], dict[str, list[str]]]:
    """The modules each row patches; and, by reason, the paths of those a row matched but leaves (``Row.fits``)."""
    found: dict[Row, list[torch.nn.Module]] = defaultdict(list)
    left: dict[str, list[str]] = defaultdict(list)
    for path, module in model.named_modules():
        name = lora.held_as(path)
        for row in rows:
            if row.matches(module, name):
                why = row.fits(module) if row.fits is not None else None
                if why is None:
                    found[row].append(module)
                else:
                    left[why].append(path)
                break
    return found, dict(left)


def _request(model, *arguments) -> tuple[torch.nn.Module, Request]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fusepatch.apply expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    return unwrapped(model), _checked(*arguments)


def _checked(
    ops, exclude, prefer, strict, compute_dtype, cuda_graphs, verbose, precision=None, drop_frozen_weights=False
) -> Request:
    """``apply``'s arguments and the ``FUSEPATCH_*`` variables checked: the request, or the error naming the values
    an argument or variable takes."""
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
        drop_frozen_weights=options.boolean(drop_frozen_weights, "drop_frozen_weights"),
    )
    if request.drop_frozen_weights and request.precision != "fp8":
        raise ValueError(
            'drop_frozen_weights=True keeps frozen projections in FP8 only; fix: pass precision="fp8" with it'
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
    signature = inspect.signature(apply)
    names = [name for name in signature.parameters if name != "model"]
    if "model" in kwargs:
        raise TypeError("apply_kwargs: 'model' is the model itself, not one of apply's keyword arguments")
    try:
        bound = signature.bind(None, **kwargs)
    except TypeError as exc:
        raise TypeError(f"fusepatch.apply() {exc}; it takes {', '.join(names)}") from None
    bound.apply_defaults()
    _checked(**{name: bound.arguments[name] for name in names})  # apply's keyword arguments are _checked's


_REPORT_REQUEST = Request(None, (), (), False, None, False, None)  # report(model): a plan that raises nothing


def _plan(model: torch.nn.Module, request: Request) -> Plan:
    """The model's rows and compute dtype, or the reason nothing is patched (disabled, no rows for the model)."""
    bindings.sweep()  # names a model collected during a torch.compile left bound go back first
    model_types = tuple(_model_types(model))
    device, compute, cast = _compute(model, request.compute_dtype)
    adapters = lora.survey(model, compute, cast)  # in the dtype the layers compute in
    plan = Plan(model, model_types, {}, {}, device, compute, cast, adapters if adapters["linears"] else {})
    if _disabled():
        message = "FUSEPATCH_DISABLE is set: nothing patched, the model runs as transformers ships it"
        return dataclasses.replace(plan, message=message)
    rows = rows_for(set(model_types), request.precision)
    found, left = _matches(model, rows) if rows else ({}, {})
    if not found:
        label = ", ".join(repr(t) for t in model_types) or "(no config.model_type)"
        message = (
            f"no fusepatch rows for model_type {label}; the model is left untouched "
            f"(supported: {', '.join(known_model_types())})"
        )
        held = "" if model_types else _held_model(model)
        message = f"{held}; {type(model).__name__} is left untouched" if held else message
        if request.strict:
            raise FusePatchError(message)
        return dataclasses.replace(plan, message=message)
    if plan.on_meta and request.strict:
        raise FusePatchError(
            "fusepatch.apply(strict=True): the model is on the meta device, so no kernel can be self-tested; "
            "call apply after materialising it (model.to_empty(device=...) and loading the weights)"
        )
    return dataclasses.replace(plan, found=dict(found), owners=_trainer_heads(found), left=left)


def _resolve(plan: Plan, request: Request) -> Resolved:
    """Each row's dispatchers (reused from an earlier apply), and their choices for the model's device and dtype,
    self-tested; on the meta device each op is chosen at its first real call."""
    env = capture()
    resolved = Resolved({}, [])
    for row, modules in plan.found.items():
        if (
            row in plan.owners
        ):  # a trainer's fused head computes the loss: the head is left to it, and the report says so
            choices = tuple(_stepped_aside(name, plan.owners[row]) for name in row.ops)
            resolved.layers.append(LayerReport(row.layer, len(modules), False, choices, note=row.note))
            logger.info(
                "fusepatch: %s's loss is computed by %s; fusepatch leaves the head to it", row.layer, plan.owners[row]
            )
            continue
        existing = [m for m in modules if hasattr(m, "_fusepatch")]
        if existing:  # reuse the dispatchers of an earlier apply: choices and self-tests stay as they were
            resolved.dispatches[row] = existing[0]._fusepatch.ops
        else:
            resolved.dispatches[row] = {
                name: make_dispatch(
                    name,
                    env=env,
                    prefer=request.prefer,
                    label=row.layer,
                    ops=request.ops,
                    exclude=request.exclude,
                    module=modules[0],
                )
                for name in row.ops
            }
        dtype = dtype_name(plan.compute)
        choices = () if plan.on_meta else tuple(d.choice(plan.device, dtype) for d in resolved.dispatches[row].values())
        resolved.layers.append(LayerReport(row.layer, len(modules), row.forward is not None, choices, note=row.note))
    return resolved


def _bind(plan: Plan, resolved: Resolved, request: Request) -> tuple[int, int]:
    """Every matched module's instance forward replaced; returns (newly patched, already patched)."""
    newly = already = 0
    for row, modules in plan.found.items():
        if row.forward is None or row in plan.owners:
            continue
        for module in modules:
            if hasattr(module, "_fusepatch"):
                already += 1
                continue
            instance_forward = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
            module._fusepatch = PatchState(row, resolved.dispatches[row], module, instance_forward)
            module._fusepatch.mlp_recompute = request.mlp_recompute
            module._fusepatch.drop_frozen = request.drop_frozen_weights and row.precision == "fp8"
            module._fusepatch.choosing = messages.choices_of(request)
            module.forward = _Bound(row.forward, module)
            module._replicate_for_data_parallel = _Bound(_replicate_patched, module)
            newly += 1
    return newly, already


def _report(
    plan: Plan, layers: list[LayerReport], *, message: str = "", newly: int = 0, already: int = 0
) -> PatchReport:
    env = capture()
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
        environment={
            "torch": env.torch,
            "cuda": env.torch_cuda,
            "transformers": env.transformers,
            "triton": env.triton,
        },
    )


def _finish(plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
    """After binding: where dynamo may trace the forwards, later choices announced, the layer graphs, the log."""
    # dynamo traces the patched forwards only where no op runs a kernel it cannot trace (on meta: chosen later),
    # on a device type where the traced path is checked
    eager_on = None if report.fused_ops or plan.on_meta else report.device
    traceable_on = eager_on if eager_on in TRACED_DEVICES else None
    for modules in plan.found.values():
        for module in modules:
            state = module.__dict__.get("_fusepatch")  # a trainer-owned head or a row without a forward: none
            if state is not None:
                state.traceable_on = traceable_on
                state.untraced_on = eager_on if traceable_on is None else None
    for row_dispatches in resolved.dispatches.values():
        for dispatch in row_dispatches.values():
            dispatch.announce = True
    if newly:  # graphs captured before replay the layers as they were: captured again once steady
        layer_graphs.drop(plan.model)
    if request.cuda_graphs:
        _install_graphs(plan.model)
    _log(report, request.verbose, said=bool(newly or plan.on_meta))
    if newly and request.mlp_recompute and any(row.forward is swiglu_mlp_forward for row in resolved.dispatches):
        logger.info(
            "fusepatch: FUSEPATCH_MLP_RECOMPUTE=1: the SwiGLU MLPs' down projections recompute their input in the "
            "backward instead of keeping it (less activation memory, one more SwiGLU kernel per MLP a step); one "
            "that cannot (in FP8 and trained, under autocast or torch.compile) is said at its first training step"
        )


def _log(report: PatchReport, verbose: bool | None, *, said: bool) -> None:
    """The table (verbose), its totals (default) or nothing; each fallback reason once per process (``said``:
    this call patched something new, or chose nothing yet on meta); the LoRA lines."""
    if verbose:
        logger.info("%s", report)
    elif verbose is None:
        logger.info("%s", report.totals())
    if not said:
        return
    for reason, line in report.fallback_reasons():
        process_state().said.warn(
            reason, "%s", line
        )  # once per process: another model, or apply again, says it no more
    lines = report.lora_lines()
    if lines:
        logger.info(lines[0])
        for line in lines[1:]:
            logger.warning(line)


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
        verbose: ``True``: log the whole report table; ``None``: one line of totals; ``False``: neither. Every
            fallback is logged at WARNING in all three (each distinct reason once, with its fix). The log shows
            without any logging set up (``FUSEPATCH_VERBOSITY``: error, warning, info, debug; default info).

    Raises:
        TypeError, ValueError: an argument, or a ``FUSEPATCH_*`` variable (the docs' environment variables page), outside the values it
            takes (``strict="no"``, ``compute_dtype=torch.int8``, ``FUSEPATCH_DISABLE=maybe``); the message names
            the values it takes. Nothing is patched then.
        FusePatchError: ``strict=True`` and an op would fall back.

    Returns:
        The :class:`PatchReport`. Example::

            >>> report = fusepatch.apply(model)
            >>> print(report)  # doctest: +SKIP
    """
    model, request = _request(
        model, ops, exclude, prefer, strict, compute_dtype, cuda_graphs, verbose, precision, drop_frozen_weights
    )
    plan = _plan(model, request)
    if plan.message:  # nothing to patch: disabled, or no rows for the model
        logger.warning("fusepatch: %s", plan.message)
        return _report(plan, [])
    for why, paths in plan.left.items():  # modules a row matched but cannot patch: named, never silent
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        logger.warning("fusepatch: %d modules run as before: %s: %s", len(paths), why, shown)
    resolved = _resolve(plan, request)
    if request.strict and (pending := _report(plan, resolved.layers)).fallbacks():
        raise FusePatchError(messages.strict_refusal(plan, pending))
    graphs = request.cuda_graphs and not messages.graphed(plan.model) and bool(decoder_stacks(plan.model)[0])
    newly, already = _bind(plan, resolved, request)
    if request.drop_frozen_weights:
        keep_what_variants_read(plan.model)
    kept = messages.kept(plan, request) if already else []
    if kept:
        logger.warning(
            "fusepatch: %s was patched before, and this apply did not change what that one set: %s; fix: "
            "fusepatch.revert(model), then apply with the options wanted (weights kept in FP8 only come back rounded)",
            type(plan.model).__name__,
            "; ".join(kept),
        )
    unselected = messages.nothing_selected(plan, request) if newly else ""
    if unselected:
        logger.warning("fusepatch: %s", unselected)
    outcome = "; ".join(filter(None, (messages.outcome(plan, newly, already, kept, graphs), unselected)))
    report = _report(plan, resolved.layers, message=outcome, newly=newly, already=already)
    _finish(plan, resolved, report, request, newly)
    return report


HEAD_FORWARDS = (causal_lm_forward, conditional_generation_forward)


def _trainer_heads(found: dict[Row, list[torch.nn.Module]]) -> dict[Row, str]:
    """The head rows whose loss a trainer's own fused head computes (TRL's, Liger's): row -> who."""
    owners = {}
    for row, modules in found.items():
        if row.forward in HEAD_FORWARDS and (owner := trainer_head(modules[0])) is not None:
            owners[row] = owner
    return owners


def _stepped_aside(op: str, owner: str) -> Choice:
    return Choice(op, owner, "trainer", f"{owner} computes the loss; fusepatch leaves the model's head to it")


def _rebind(fn: Any, old: torch.nn.Module, new: torch.nn.Module) -> Any:
    """``fn`` bound to ``new`` where it was a method bound to ``old``; anything else as it is."""
    if isinstance(fn, types.MethodType) and fn.__self__ is old:
        return types.MethodType(fn.__func__, new)
    return fn


def _replicate_patched(self: torch.nn.Module) -> torch.nn.Module:
    """``nn.DataParallel`` (what the Trainer uses when it sees several GPUs without torchrun) copies each module's
    ``__dict__`` into its replicas, so the patched forward and the saved original, both bound to this module,
    would make replica 1 run replica 0's weights on another GPU's inputs. Each replica gets its own binding."""
    replica = type(self)._replicate_for_data_parallel(self)
    state = self._fusepatch
    replica._fusepatch = dataclasses.replace(
        state, owner=replica, instance_forward=_rebind(state.instance_forward, self, replica)
    )
    replica.forward = _Bound(state.row.forward, replica)
    replica.__dict__.pop(rotary_embedding.TABLES, None)  # the tables are per device: the replica keeps its own
    replica._replicate_for_data_parallel = _Bound(_replicate_patched, replica)
    return replica


_DECODER_FORWARDS = (decoder_layer_forward, hybrid_decoder_layer_forward)


def decoder_stacks(model: torch.nn.Module) -> tuple[list[list[torch.nn.Module]], bool]:
    """The decoder stacks ``cuda_graphs`` can capture (``ModuleList``s of patched dense decoder layers), and whether
    a patched stack was left out for its mixture-of-experts layers (their routing decides work on the host)."""
    stacks, moe = [], False
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        layers = list(module)
        states = [layer.__dict__.get("_fusepatch") for layer in layers]
        if not all(state is not None and state.row.forward in _DECODER_FORWARDS for state in states):
            continue
        if any(hasattr(getattr(layer, "mlp", None), "experts") for layer in layers):
            moe = True
            continue
        stacks.append(layers)
    return stacks, moe


def _install_graphs(model: torch.nn.Module) -> None:
    """``apply(cuda_graphs=True)``: one :class:`~fusepatch.layers.layer_graphs.LayerGraphs` per decoder stack."""
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


def revert(model: torch.nn.Module) -> int:
    """Restore every forward ``apply`` replaced, exactly as it was. Returns how many modules were restored."""
    model = unwrapped(model)
    restored = rounded = 0
    layer_graphs.drop(model)  # a revert in part leaves graphs on the layers beside it: they replayed this part
    for module in model.modules():
        module.__dict__.pop(layer_graphs.ATTRIBUTE, None)
        state = module.__dict__.get("_fusepatch")
        if state is None:
            continue
        if state.instance_forward is _NO_INSTANCE_FORWARD:
            del module.forward
        else:
            module.forward = state.instance_forward
        module.__dict__.pop("_replicate_for_data_parallel", None)
        module.__dict__.pop(rotary_embedding.TABLES, None)
        rounded += restore_dropped(module, state.cache)
        del module._fusepatch
        bindings.release(module)  # transformers' module-level names back once no patched layer holds them
        restored += 1
    if rounded:
        say_restored(rounded)
    logger.info("fusepatch: reverted %d modules", restored)
    return restored


def report(model: torch.nn.Module, compute_dtype: torch.dtype | str | None = None) -> PatchReport:
    """The current report for a model: patched layers, and each op's choice for the model's present device
    and dtype (a model moved to the GPU after ``apply`` shows its GPU choices; ``compute_dtype`` as in
    :func:`apply`)."""
    model = unwrapped(model)
    plan = _plan(model, dataclasses.replace(_REPORT_REQUEST, compute_dtype=options.compute_dtype(compute_dtype)))
    device, dtype = plan.device, dtype_name(plan.compute)
    groups: dict[Row, list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        if state is not None:
            groups[state.row].append(module)
    layers = []
    for row, modules in groups.items():
        owner = trainer_head(modules[0]) if row.forward in HEAD_FORWARDS else None
        if owner is not None:  # a trainer wrapped the patched head since: its fused head computes the loss
            choices = tuple(_stepped_aside(name, owner) for name in row.ops)
        elif device == "meta":
            choices = ()
        else:
            choices = tuple(d.choice(device, dtype) for d in modules[0]._fusepatch.ops.values())
        layers.append(LayerReport(row.layer, len(modules), True, choices, note=row.note))
    for row, owner in _trainer_heads({r: m for r, m in plan.found.items() if r not in groups}).items():
        layers.append(
            LayerReport(row.layer, len(plan.found[row]), False, tuple(_stepped_aside(n, owner) for n in row.ops))
        )
    total = sum(len(m) for m in groups.values())
    built = _report(plan, layers, message="" if total else "not patched", already=total)
    dropped = sum(bool(m._fusepatch.cache.get("dropped")) for modules in groups.values() for m in modules)
    return dataclasses.replace(built, transformers_calls=_transformers_calls(groups), dropped_weights=dropped)


def _transformers_calls(groups: dict[Row, list[torch.nn.Module]]) -> tuple[str, ...]:
    """Per layer class and reason, how many calls its patched layers handed to transformers' forward."""
    lines = []
    for row, modules in groups.items():
        counts: dict[str, int] = defaultdict(int)
        for module in modules:
            for why, count in module._fusepatch.transformers_calls.items():
                counts[why] += count
        lines += [f"{row.layer}: {count} calls: {why}" for why, count in counts.items()]
    return tuple(lines)
