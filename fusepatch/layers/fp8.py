"""The forward of a projection that ``apply(model, precision="fp8")`` trains with FP8 GEMMs (op ``fp8_linear``).

Only the instance's forward changes: the module stays a ``torch.nn.Linear`` with its bf16 (or fp32) weight, so
state dicts, optimizers, FSDP and peft see what they saw. The fused layers that compute several projections
themselves (``layers/support/projections.py``) call a projection patched here through its module, so its FP8 GEMMs
run there too.
"""

from __future__ import annotations

import copy

import torch

from fusepatch.backends import deepspeed, fsdp2
from fusepatch.base.dtypes import dtype_name
from fusepatch.base.log import logger
from fusepatch.base.state import current as process_state
from fusepatch.kernels.fp8_range import unaligned
from fusepatch.layers.support.hooks import autocast_dtype
from fusepatch.layers.support.lora import variant_bases
from fusepatch.ops.fp8_linear import MULTIPLE
from fusepatch.ops.prepared import HELD, PER_CALL, Held, held_by

# the decoder's projections that train in FP8: attention q/k/v/o, the Gated DeltaNet's input and output
# projections, the MLPs' (and the MoE shared expert's) gate/up/down. Left as they are: the embeddings, the norms,
# the LM head, the Gated DeltaNet's gate projections (in_proj_a/b, in_proj_ba: one output per head), routers,
# and everything fla computes.
PROJECTIONS = (
    *("q_proj", "k_proj", "v_proj", "o_proj"),
    *("in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj"),
    *("gate_proj", "up_proj", "down_proj"),
)
UNALIGNED = (
    f"a weight dimension that is not a multiple of {MULTIPLE} (FP8 GEMMs need it): they compute in the "
    "model's dtype; nothing to fix, it is the model's shape"
)
RESIZED = f"resized since apply to a weight dimension that is not a multiple of {MULTIPLE} (FP8 GEMMs need it)"


def aligned(module: torch.nn.Module) -> str | None:
    """``Row.fits`` of the FP8 rows: None for a projection FP8 GEMMs can compute, else why not."""
    rows, columns = deepspeed.full_shape(module.weight)  # a ZeRO-3 weight between its module's calls: a placeholder
    return None if unaligned((rows, columns)) is None else UNALIGNED


def fp8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``self(x)`` with FP8 GEMMs where the op chose a kernel for ``x``'s device and compute dtype; the
    projection as before otherwise (the fallback, said by ``apply`` with its reason). A frozen weight's FP8 copy is
    the dispatcher's to keep and check (``ops/prepared.py``); with ``apply(drop_frozen_weights=True)`` the weight
    itself is dropped at its first FP8 call, its copy all that is left (``DroppedWeight``)."""
    state = self._fusepatch
    if aligned(self) is not None:  # resized since apply, which patches aligned projections only
        state.transformers_calls[RESIZED] = state.transformers_calls.get(RESIZED, 0) + 1
        return state.original(x)
    cast = autocast_dtype(x)
    fp8_linear = state.ops["fp8_linear"]
    weight = self.weight
    if isinstance(weight, DroppedWeight):
        if weight.requires_grad:  # set to train after it was dropped: there is nothing to train
            raise RuntimeError(DROPPED)
    elif weight.requires_grad or isinstance(weight, fsdp2.GatheredWeight) or deepspeed.partitioned(weight):
        pass  # trained; gathered by FSDP2 from its FP8 rows; gathered by ZeRO-3 at each call (nothing kept)
    elif getattr(weight, PER_CALL, False):
        pass  # gathered by FSDP2 where its rows cannot be kept in FP8: quantized at each call
    elif (param := fsdp2.param_of(self)) is not None and fsdp2.why_not_kept(param) != "single":
        weight = _sharded_once_prepared(self, param, fp8_linear, x.device.type, dtype_name(cast or x.dtype))
    elif state.drop_frozen:
        weight = _dropped_once_prepared(self, fp8_linear, x.device.type, dtype_name(cast or x.dtype))
    if cast is not None:  # autocast would run the projection in its dtype: quantize from that input
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.to(cast)
            return fp8_linear(x.to(cast), weight, bias)
    return fp8_linear(x, weight, self.bias)


def _dropped_once_prepared(module: torch.nn.Linear, dispatch, device: str, dtype: str) -> torch.Tensor:
    """``drop_frozen_weights``: the frozen weight dropped once its FP8 copy is made, the copy kept by the weight in
    its place; the weight as it is where the kernel chosen prepares nothing to keep (the fallback, said once) or
    nothing is kept now (``torch.compile``, ``inference_mode``)."""
    held = dispatch.prepared(module.weight, device, dtype, once=True)
    if held is None or held.restore is None:
        if not dispatch.choice(device, dtype).fused and process_state().said.first(NOTHING_DROPPED):
            logger.warning("fusepatch: %s", NOTHING_DROPPED)
        return module.weight
    module.weight = DroppedWeight.of(module.weight, held)
    return module.weight


def _sharded_once_prepared(module: torch.nn.Linear, param, dispatch, device: str, dtype: str) -> torch.Tensor:
    """A frozen weight FSDP2 shards, at its first FP8 call (gathered now): from now on each rank keeps its own rows
    in FP8 (and, with ``drop_frozen_weights``, nothing else of them), and FSDP2 gathers those; this call computes
    with the gathered weight quantized now (the same bits: rows are quantized alone). Where that cannot be
    (``fsdp2.why_not_kept``), or nothing is kept now, the weight is quantized at each call, nothing kept."""
    weight = module.weight
    why = "read" if module._fusepatch.weight_read else fsdp2.why_not_kept(param)
    whole = None if why else dispatch.prepared(weight, device, dtype, once=True)
    if whole is None or whole.restore is None:
        if why is not None:
            param.fusepatch_not_kept = why  # the report's count
            setattr(weight, PER_CALL, True)  # the same unsharded parameter at every gather
        return weight
    drop = module._fusepatch.drop_frozen
    shard = dispatch.prepared(param.sharded_param._local_tensor, device, dtype, once=True).handle if drop else None

    candidate, restore = whole.candidate, whole.restore  # not ``whole``: its whole copy goes with this call

    def carry(gathered: torch.Tensor, handle) -> None:
        setattr(gathered, HELD, Held(candidate, handle, restore))

    def current(kept: torch.Tensor):  # each gather: the rows' copy checked against their values (ops/prepared.py)
        with torch.inference_mode(False):
            held = dispatch.prepared(kept, device, dtype)
        if held is None:
            raise RuntimeError(SHARD_UNPREPARED)
        return held.handle

    return fsdp2.keep_sharded(
        param,
        whole.handle,
        shard,
        carry=carry,
        current=None if drop else current,
        restore=restore,
        refusal=DROPPED,
    )


# why a frozen FP8 projection FSDP2 shards quantizes the gathered weight at each call instead of keeping its rows
NOT_KEPT = {
    **fsdp2.NOT_KEPT,
    "read": "their peft LoRA adapters are DoRA (or another variant), which reads the base weight's values every step",
}
SHARD_UNPREPARED = (
    "fusepatch: FSDP2 gathered a frozen FP8 projection's rows where no FP8 copy can be made (inside torch.compile); "
    "fix: leave the FSDP2 units' forwards uncompiled, or fusepatch.revert(model)"
)


DROPPED = (
    'fusepatch: this projection\'s weight was dropped: apply(model, precision="fp8", drop_frozen_weights=True) '
    "keeps frozen projections in FP8 only; fix: fusepatch.revert(model) puts back a copy in the weight's dtype "
    "(rounded to FP8), or reload the checkpoint and apply without drop_frozen_weights for the exact weight "
    "(peft's DoRA adapters read their base weight at every step: apply after get_peft_model keeps theirs)"
)
NOTHING_DROPPED = (
    "drop_frozen_weights=True: nothing is dropped where the FP8 projections fall back (their weights are what "
    "they compute with); the fallback's reason and fix are in the report"
)


KEPT_FOR_VARIANTS = (
    "drop_frozen_weights=True: %d frozen FP8 projections keep their weight: their peft LoRA adapters are DoRA (or "
    "another variant), which may read the base weight at every step"
)
LOST_UNDER_VARIANTS = (
    "drop_frozen_weights=True: %d frozen projections under DoRA (or another LoRA variant) were dropped by a step "
    "before their adapters came, and those adapters cannot run; fix: reload the model, call get_peft_model, then "
    "apply (fusepatch.revert(model) gives them back rounded to FP8)"
)


def keep_what_variants_read(model: torch.nn.Module) -> None:
    """The FP8 projections under peft's DoRA (a LoRA variant) keep their weight's values where the forward sees
    them, since the variant reads them at every step: marked ``weight_read`` (under FSDP2 their gathered weight stays
    bf16, quantized at each call); with ``drop_frozen_weights=True`` not dropped, said with their count, and those a
    step already dropped (the adapters came after ``apply``) with the fix."""
    kept = lost = 0
    for base in variant_bases(model):
        state = base.__dict__.get("_fusepatch")
        if state is None:
            continue
        state.weight_read = True
        if not state.drop_frozen:
            continue
        state.drop_frozen = False
        if is_dropped(base):
            lost += 1
        else:
            kept += 1
    if kept:
        logger.warning("fusepatch: " + KEPT_FOR_VARIANTS, kept)
    if lost:
        logger.warning("fusepatch: " + LOST_UNDER_VARIANTS, lost)


class DroppedWeight(torch.nn.Parameter):
    """What a frozen FP8 projection holds as ``weight`` after ``drop_frozen_weights``: shape, strides, dtype, device
    and ``requires_grad`` as before, no values (a meta tensor), and its FP8 copy (``Held``, as ``ops/prepared.HELD``:
    the dispatcher passes it to the kernel that made it), which deep-copies and pickles with it. Reading it for
    values (a GEMM, a copy, a move to another device) raises with the fix instead of computing with nothing, and so
    does every write (``copy_``, through ``.data``, setting ``.data``, ``load_state_dict``), which would otherwise be
    lost; ``detach`` (``state_dict``) gives a :class:`DroppedValues`, which peft's adapter saving leaves out and a
    whole checkpoint refuses."""

    device_of: torch.device

    @staticmethod
    def of(weight: torch.Tensor, held: Held) -> DroppedWeight:
        return _dropped(tuple(weight.shape), weight.dtype, weight.device, weight.stride(), held)

    def __deepcopy__(self, memo: dict) -> DroppedWeight:
        held = copy.deepcopy(held_by(self), memo)
        memo[id(self)] = copied = _dropped(tuple(self.shape), self.dtype, self.device_of, self.stride(), held)
        return copied

    def __reduce_ex__(self, protocol):
        return _dropped, (tuple(self.shape), self.dtype, self.device_of, self.stride(), held_by(self))

    def __repr__(self, **kwargs) -> str:  # a meta tensor's repr would name the meta device, not the weight's
        return (
            f"DroppedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device_of}: kept in FP8 "
            "only by drop_frozen_weights=True; fusepatch.revert(model) puts back a rounded copy)"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the ``device`` property's getter
            return args[0].device_of
        if getattr(func, "__self__", None) is torch.Tensor.is_meta:  # as the weight answered: it stands for one
            return False
        if getattr(func, "__self__", None) is torch.Tensor.data:
            if func.__name__ == "__set__":  # ``weight.data = values`` (``vector_to_parameters``): nowhere to go
                if args[1] is args[0]:  # ``model.to`` where it is: itself, nothing changes
                    return None
                raise RuntimeError(DROPPED)
            return args[0]  # ``weight.data += delta`` (a merge) reaches the raising path, not a meta tensor
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and _same_place(args, kwargs):
            return args[0]
        cast = _CASTS.get(func)
        if cast is not None and cast == args[0].dtype:  # model.bfloat16() on a bf16 model: nothing to do
            return args[0]
        if getattr(func, "__name__", "") == "detach":  # ``state_dict``'s entry
            return DroppedValues.of(args[0])
        return _metadata_only(func, args, kwargs)


class DroppedValues(torch.Tensor):
    """A dropped weight's ``state_dict`` entry: a meta tensor of the weight's shape and dtype. A checkpoint of it
    would hold nothing, so saving it (``torch.save``, ``save_pretrained``), copying it or computing with it raises
    with the fix, where a plain meta tensor would be written without values or fail in torch's words."""

    @staticmethod
    def of(weight: torch.Tensor) -> DroppedValues:
        with torch._C.DisableTorchFunctionSubclass():
            meta = torch.empty(tuple(weight.shape), dtype=weight.dtype, device="meta")
        return torch.Tensor._make_subclass(DroppedValues, meta)

    def __reduce_ex__(self, protocol):
        raise RuntimeError(DROPPED)

    def __repr__(self, **kwargs) -> str:
        return f"DroppedValues(shape={tuple(self.shape)}, dtype={self.dtype}: {DROPPED})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # no ``detach``: it would hand out a plain meta tensor (a value-less checkpoint, a value-less parameter
        # through ``load_state_dict(assign=True)``)
        return _metadata_only(func, args, kwargs or {})


def _metadata_only(func, args: tuple, kwargs: dict):
    """What a dropped weight and its ``state_dict`` entry answer: their metadata (shape, dtype, attributes), and
    for anything that would read values the drop's message with its fix."""
    if func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__"):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    raise RuntimeError(DROPPED)


def _dropped(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    stride: tuple[int, ...] | None = None,
    held: Held | None = None,
) -> DroppedWeight:
    """A ``DroppedWeight`` of this shape, strides (contiguous: None) and dtype standing for a weight on ``device``,
    holding ``held`` (also how it unpickles)."""
    if stride is None:
        stride = torch.empty(shape, device="meta").stride()
    dropped = DroppedWeight(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), requires_grad=False)
    dropped.device_of = device
    setattr(dropped, HELD, held)
    return dropped


_METADATA = {
    torch.Tensor.size,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
    torch.Tensor.dim,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.numel,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.requires_grad_,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.__hash__,
    torch.Tensor.__eq__,
    torch.Tensor.data_ptr,
    torch._has_compatible_shallow_copy_type,
}


_CASTS = {
    torch.Tensor.bfloat16: torch.bfloat16,
    torch.Tensor.half: torch.float16,
    torch.Tensor.float: torch.float32,
    torch.Tensor.double: torch.float64,
}


def _same_place(args: tuple, kwargs: dict) -> bool:
    """``weight.to(...)``, ``.cuda()``, ``.cpu()`` that would change nothing: its own device and dtype."""
    weight, targets = args[0], [*args[1:], *kwargs.values()]
    for target in targets:
        if isinstance(target, torch.dtype) and target != weight.dtype:
            return False
        if isinstance(target, (str, torch.device, int)) and not isinstance(target, bool):
            device = torch.device(target) if not isinstance(target, int) else torch.device("cuda", target)
            if device.type != weight.device_of.type or (device.index is not None and device != weight.device_of):
                return False
        if isinstance(target, torch.Tensor):
            return False
    return True


def is_dropped(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weight was dropped (``drop_frozen_weights``): its FP8 copy is all that is left of it
    (under FSDP2: of this rank's rows)."""
    if isinstance(module.__dict__.get("_parameters", {}).get("weight"), DroppedWeight):
        return True
    param = fsdp2.param_of(module)
    return param is not None and isinstance(fsdp2.kept_shard(param), fsdp2.DroppedShard)


def restore_dropped(module: torch.nn.Module) -> bool:
    """``revert``: a dropped weight back as a real parameter, from the FP8 copy it holds (rounded: FP8 keeps 3
    mantissa bits); anything else as it is. Under FSDP2 the local rows likewise, and rows kept with their values
    gathered as FSDP2 gathers them again. Whether it restored one rounded (``revert`` says how many, once)."""
    param = fsdp2.param_of(module)
    shard = fsdp2.kept_shard(param) if param is not None else None
    if shard is not None:
        dropped = isinstance(shard, fsdp2.DroppedShard)
        values = shard.restore(shard.kept).to(shard.dtype) if dropped else shard.as_subclass(torch.Tensor)
        fsdp2.release(param, values)
        return dropped
    if not is_dropped(module):
        return False
    weight = module.weight
    held = held_by(weight)
    values = held.restore(held.handle).to(weight.dtype)
    module.weight = torch.nn.Parameter(values, requires_grad=False)
    return True


def say_restored(count: int) -> None:
    """What ``revert`` could not give back exactly: the weights ``drop_frozen_weights`` kept in FP8 only."""
    logger.warning(
        "fusepatch: revert: %d frozen weights were kept in FP8 only (drop_frozen_weights=True); they are back, "
        "rounded to FP8 (about 3%% off the original values); reload the checkpoint for the exact weights",
        count,
    )


def sharding_lines(states: list) -> tuple[str, ...]:
    """What the report says of the frozen FP8 projections' copies under a sharding engine: under FSDP2, kept as
    each rank's rows and gathered in FP8 (how many so far, how many without their bf16 rows), and those quantized
    at each call instead, by reason; under ZeRO-3, quantized at each call, nothing kept or dropped. Nothing for a
    model no engine shards."""
    shared = kept = dropped = zero3 = 0
    per_call: dict[str, int] = {}
    for state in states:
        module = state.owner
        if state.row.precision != "fp8" or "weight" not in module.__dict__.get("_parameters", {}):
            continue
        weight = module.weight
        if deepspeed.partitioned(weight):
            zero3 += not weight.requires_grad
            continue
        param = fsdp2.param_of(module)
        if param is None or weight.requires_grad or fsdp2.why_not_kept(param) == "single":
            continue
        shared += 1
        shard = fsdp2.kept_shard(param)
        kept += shard is not None
        dropped += isinstance(shard, fsdp2.DroppedShard)
        why = getattr(param, "fusepatch_not_kept", None)
        if why is not None:
            per_call[why] = per_call.get(why, 0) + 1
    lines = []
    sharded = shared - sum(per_call.values())
    if sharded:
        lines.append(
            f"FSDP2: {sharded} frozen FP8 projections keep their FP8 copy sharded like their weight (each rank its own "
            "rows and their scales), gathered in FP8 for their unit's forward and backward and freed after; made at "
            f"each one's first FP8 call: {kept} so far, {dropped} of them without their bf16 rows "
            "(drop_frozen_weights=True)"
        )
    for why, count in per_call.items():
        lines.append(
            f"FSDP2: {count} frozen FP8 projections quantize the weight FSDP2 gathered at each call, forward and "
            f"backward, keeping no copy: {NOT_KEPT[why]}"
        )
    if zero3:
        lines.append(
            f"DeepSpeed ZeRO-3: {zero3} frozen FP8 projections quantize the weight ZeRO-3 gathered at each call, "
            "forward and again for the backward, keeping no copy (one kept would be whole on every rank); "
            "drop_frozen_weights=True drops none of them (the partitions are DeepSpeed's)"
        )
    return tuple(lines)
