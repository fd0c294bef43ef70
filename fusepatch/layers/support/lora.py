"""peft's LoRA linears inside the fused layers: the base GEMM and every adapter of one input in one autograd
function.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` module by module: per adapter two GEMMs plus
a scale and an add kernel over the whole ``[tokens, out]`` output in the forward, their backwards, and one more
add for the input gradient of every LoRA linear. ``project`` computes the same sum with the base GEMM's output
as the accumulator, ``out.addmm_(s * x A^T, B^T)`` (the scale applied to the narrow ``[tokens, r]`` product),
and the adapters of several projections of one input share their GEMMs: one ``x [A_1; A_2; ...]^T`` in the
forward; in the backward one ``dx += [s_1 g_1 B_1, ...] [A_1; A_2; ...]`` and one ``[...]^T x`` for all the
``A`` gradients. The input gradient is accumulated in one buffer through the GEMMs (``addmm_``), as
``projections.project`` does for plain linears.

fusepatch reads the adapters' parameters and replaces no module: peft's modules, adapter switching, merging and
saving work as before (a merge writes a base's weight, and a handle its op's kernel prepared of it sees it at the next
call: ``ops/prepared.py``).
Dropout (``lora_dropout > 0`` while training) is peft's own module, called in peft's order, so one generator state
gives peft's masks; each dropped input gets its own ``A`` GEMM.

It runs for peft's ``lora.Linear`` over a plain ``nn.Linear`` with vanilla adapters (no DoRA or other variant,
no LoRA bias), enabled and unmerged, without hooks or forwards set on their instances, in one dtype or under
autocast. Merged or disabled adapters and hooked modules (or ones with a forward of their instance's: accelerate's
offload hook) go through peft's forward as they should; anything else that cannot be fused (a QLoRA 4-bit base,
DoRA) goes through peft's forward too, and the first such call says why (``survey`` says it at ``apply``).

peft's default keeps the adapters in fp32 over a bf16 model (``autocast_adapter_dtype``), and without autocast
computes them in fp32: FFMA GEMMs, a tenth of the tensor cores' rate. Here their GEMMs run in the input's dtype,
as autocast would run them; the adapters' weights, and their gradients (through the cast's backward), stay
fp32. Said once at INFO.

A base projection with a forward ``apply`` gave it (a precision row's: ``apply(model, precision=...)``) is called as
its module: its output, from its own GEMM, is what the adapters' products are added to, in place through the
GEMM's ``beta`` (the output is that tensor, not a copy; a copy where a forward set on the instance wraps the base's,
such as an accelerate hook, which may keep the output it returns), and its input gradient comes from its own
backward.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusepatch.base.log import logger
from fusepatch.base.state import current as process_state
from fusepatch.layers.support.hooks import autocast_dtype, hooked, in_dtype, may_bypass, runs_own_forward

PEFT_LAYER = "peft.tuners.lora.layer"  # the module defining peft's LoRA ``Linear``

ADAPTERS_CAST = (
    "peft LoRA adapters in {adapters} over {inputs} inputs: fusepatch runs their GEMMs in {inputs}, as autocast "
    "would (their weights and gradients stay {adapters})"
)


@dataclass(frozen=True)
class Adapter:
    """One active adapter of a LoRA linear: ``B (A dropout(x)) * scaling``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float
    dropout: torch.nn.Module | None  # None: the identity (p = 0, or not training)


@dataclass(frozen=True)
class Unfused:
    """Why a LoRA linear runs through peft's forward, and what would let it fuse (empty: nothing to fix)."""

    reason: str
    fix: str = ""


@dataclass(frozen=True)
class Part:
    """One projection: the base linear's weight and bias, and its adapters (none for a plain ``nn.Linear``);
    ``called``: a base with a forward ``apply`` gave it (a precision row's), called for its output."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapters: tuple[Adapter, ...] = ()
    called: torch.nn.Module | None = None


def own_forward(linear: torch.nn.Module) -> bool:
    """Whether a plain ``nn.Linear`` computes through a forward ``apply`` gave it (a precision row's projection)."""
    return "forward" in linear.__dict__ and "_fusepatch" in linear.__dict__


def lora_linear_type() -> type | None:
    """peft's LoRA ``Linear`` class if peft is imported (a model cannot hold one otherwise: no import here)."""
    module = sys.modules.get(PEFT_LAYER)
    return getattr(module, "Linear", None) if module is not None else None


def held_as(path: str) -> str:
    """The name a module at ``path`` stands for in its layer: its own, or for a module peft holds in a wrapper the
    wrapper's: a LoRA linear's ``base_layer``, and ``modules_to_save``'s frozen ``original_module`` and trained
    copies (``self_attn.q_proj.base_layer`` and ``self_attn.o_proj.modules_to_save.default`` are the layer's
    ``q_proj`` and ``o_proj``)."""
    parts = path.split(".")
    if len(parts) > 1 and parts[-1] in ("base_layer", "original_module"):
        return parts[-2]
    if len(parts) > 2 and parts[-2] == "modules_to_save":
        return parts[-3]
    return parts[-1]


def is_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer of any kind (``lora.Linear``, a quantised one, ...)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def variant_bases(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The base layers of ``model``'s peft LoRA layers with a variant adapter (DoRA): the variant reads the base
    weight at every forward (DoRA: its column norms)."""
    return [
        module.get_base_layer()
        for module in model.modules()
        if is_lora(module) and (getattr(module, "lora_variant", None) or any(getattr(module, "use_dora", {}).values()))
    ]


def _dropout(module: torch.nn.Module) -> torch.nn.Module | None | Unfused:
    if type(module) is torch.nn.Identity:
        return None
    if type(module) is torch.nn.Dropout:
        return module if module.training and module.p > 0 else None
    return Unfused(f"its dropout is a {type(module).__name__}, not nn.Dropout")


def part(module: torch.nn.Module, x: torch.Tensor, cast: bool) -> Part | Unfused | None:
    """``module`` as a ``Part``; ``None`` where it must be called as itself for a plain reason (a hook, merged or
    disabled adapters, not a linear of fusepatch's kind); ``Unfused`` where it is a LoRA layer that cannot be
    fused. ``cast``: under autocast (every tensor is cast to its dtype, as autocast would)."""
    if type(module) is torch.nn.Linear:
        if hooked(module) or ("forward" in module.__dict__ and not own_forward(module)):
            return None
        if own_forward(module):
            return Part(module.weight, module.bias, called=module)
        if not cast and not in_dtype(module, x.dtype):
            return None
        return Part(module.weight, module.bias)
    if not is_lora(module):
        return None
    if type(module) is not lora_linear_type():
        base = type(module.base_layer).__name__
        return Unfused(
            f"{type(module).__module__}.{type(module).__name__} over a {base} computes its base with its own GEMM "
            "(QLoRA's 4-bit base, or another layer kind); the fused path covers LoRA over nn.Linear"
        )
    if module.disable_adapters or module.merged or not may_bypass(module):
        return None
    base = module.base_layer
    if type(base) is not torch.nn.Linear:
        return Unfused(f"its base layer is a {type(base).__name__}, not nn.Linear")
    if hooked(base) or ("forward" in base.__dict__ and not own_forward(base)):
        return None
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}):
            return Unfused(f"adapter {name!r} is a LoRA variant ({type(module.lora_variant[name]).__name__})")
        a, b = module.lora_A[name], module.lora_B[name]
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None or b.bias is not None:
            return Unfused(f"adapter {name!r} has a LoRA bias or A/B modules other than nn.Linear")
        # the fused GEMMs call none of them: not a hook, nor a forward set on one (accelerate's offload hook,
        # outside whose forward the weights are on the meta device)
        if not all(may_bypass(m) for m in (a, b, module.lora_dropout[name])):
            return None
        dropout = _dropout(module.lora_dropout[name])
        if isinstance(dropout, Unfused):
            return dropout
        if not cast and not (_castable(a.weight, x) and _castable(b.weight, x)):
            return Unfused(
                f"adapter weights in {str(a.weight.dtype).removeprefix('torch.')} over "
                f"{str(x.dtype).removeprefix('torch.')} inputs without autocast"
            )
        adapters.append(Adapter(a.weight, b.weight, float(module.scaling[name]), dropout))
    if own_forward(base):
        return Part(base.weight, base.bias, tuple(adapters), called=base)
    if not cast and not in_dtype(base, x.dtype):
        return None
    return Part(base.weight, base.bias, tuple(adapters))


def _castable(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """An adapter weight the fused path can compute with in ``x``'s dtype: that dtype, or fp32 master weights
    over 16-bit inputs (peft's default, cast as autocast would cast them)."""
    return weight.dtype == x.dtype or (weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16))


def say_once(module: torch.nn.Module, why: Unfused) -> None:
    """Log, once per reason, that a LoRA linear runs through peft's forward, and why."""
    if not process_state().said.first(f"LoRA: {why.reason}"):
        return
    logger.warning("fusepatch: %s", describe(type(module).__name__, why))


def describe(name: str, why: Unfused) -> str:
    fix = f"; fix: {why.fix}" if why.fix else ""
    return f"peft LoRA {name} runs through peft's own forward, not fused with its base GEMM: {why.reason}{fix}"


_WEIGHTS = 4  # ``needs_input_grad``'s index of the first weight: after x, residual, layout and recompute


class _LoraLinears(torch.autograd.Function):
    """``base_i(x) + sum_a B_a (A_a dropout_a(x)) s_a`` for every projection i of one input ``x``; with
    ``residual`` (one projection) ``residual + ...``. ``layout``: per projection, its bias flag, per adapter
    ``(scaling, dropped)``, and whether its base output is given; ``recompute``: None, or ``(swiglu, gate, up)``
    when ``x`` is ``swiglu(gate, up)`` (an MLP's down projection, ``FUSEPATCH_MLP_RECOMPUTE``): ``gate`` and
    ``up`` are kept instead of ``x``, which the backward computes again; ``tensors``: the weights (a given base's
    output in its place: the adapters' products are added to it), the biases, then ``A, B, dropped input`` per
    adapter."""

    @staticmethod
    def forward(ctx, x, residual, layout, recompute, *tensors):
        n = len(layout)
        weights, biases, rest = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        given = [entry[2] for entry in layout]
        flat = x.reshape(-1, x.shape[-1])
        # a given base output (a fresh tensor its own function made, that nothing else holds: ``_unviewed``) takes
        # the adapters' products in place: the output is that tensor, marked dirty, not a copy of it (a full write
        # and read of the projection's output per call). A view is copied first: written in place, its base's
        # gradient would be copied whole in the backward instead.
        dirty = [g and w._base is None for w, g in zip(weights, given)]
        if residual is not None:
            outs = [torch.addmm(residual.reshape(-1, residual.shape[-1]), flat, weights[0].t())]
        else:
            outs = [
                w.view(-1, w.shape[-1])
                if dirty[i]
                else w.reshape(-1, w.shape[-1]).clone()
                if given[i]
                else F.linear(flat, w, b)
                for i, (w, b) in enumerate(zip(weights, biases))
            ]
        # (projection, scaling, A, B, dropped input or None)
        adapters = [(i, scaling, *rest[3 * k : 3 * k + 3]) for k, (i, scaling, _) in enumerate(_adapter_plan(layout))]
        shared = [ad for ad in adapters if ad[4] is None]
        joined = h = None
        if shared:
            joined = torch.cat([ad[2] for ad in shared]) if len(shared) > 1 else shared[0][2]
            h = flat.mm(joined.t())
            _scale_columns(h, [(ad[1], ad[2].shape[0]) for ad in shared])
            start = 0
            for i, _, _, b, _ in shared:
                outs[i].addmm_(h[:, start : start + b.shape[1]], b.t())
                start += b.shape[1]
        own = []
        for i, scaling, a, b, dropped in adapters:
            if dropped is not None:
                hd = dropped.reshape(-1, dropped.shape[-1]).mm(a.t())
                if scaling != 1.0:
                    hd.mul_(scaling)
                outs[i].addmm_(hd, b.t())
                own.append(hd)
        ctx.layout, ctx.has_residual = layout, residual is not None
        ctx.recompute, ctx.x_dtype = (None, None) if recompute is None else (recompute[0], x.dtype)
        inputs = (x,) if recompute is None else (None, *recompute[1:])  # what the backward needs of x
        ctx.given_shapes = [w.shape if g else None for w, g in zip(weights, given)]
        ctx.set_materialize_grads(False)
        droppeds = [ad[4] for ad in adapters if ad[4] is not None]
        bases = [None if g else w for w, g in zip(weights, given)]
        ctx.save_for_backward(*inputs, joined, h, *bases, *[t for ad in adapters for t in ad[2:4]], *own, *droppeds)
        ctx.mark_dirty(*(w for w, d in zip(weights, dirty) if d))
        # the others, tensors of their own for autograd, not views made here, which could not be written in place
        # afterwards (a hook on the layer, its attention or MLP may, as on transformers' outputs)
        return tuple(
            w if d else out.view(*x.shape[:-1], out.shape[-1]).detach() for w, d, out in zip(weights, dirty, outs)
        )

    @staticmethod
    def backward(ctx, *grads):
        layout = ctx.layout
        n, plan = len(layout), _adapter_plan(layout)
        count, dropped_count = len(plan), sum(dropped for _, _, dropped in plan)
        if ctx.recompute is None:
            x, joined, h, *saved = ctx.saved_tensors
        else:  # the product again, bit for bit the forward's (the same op on the same inputs)
            _, gate, up, joined, h, *saved = ctx.saved_tensors
            with torch.no_grad():
                x = ctx.recompute(gate, up).to(ctx.x_dtype)
        weights, pairs, kept = saved[:n], saved[n : n + 2 * count], saved[n + 2 * count :]
        own = iter(zip(kept[:dropped_count], kept[dropped_count:]))  # (scaled x_d A^T, x_d) per dropped adapter
        needs = ctx.needs_input_grad
        first = _WEIGHTS + 2 * n  # needs_input_grad's index of the first adapter's A (then its B, its dropped input)
        flat = x.reshape(-1, x.shape[-1])
        grads = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        dx = None
        dweights: list = [None] * n
        dbiases: list = [None] * n
        for i, g in enumerate(grads):
            if g is None:
                continue
            if layout[i][2]:  # a given base output: its gradient is the output's, its backward its own
                dweights[i] = g.view(ctx.given_shapes[i])
                continue
            if needs[0]:
                dx = g.mm(weights[i]) if dx is None else dx.addmm_(g, weights[i])
            if needs[_WEIGHTS + i]:
                dweights[i] = g.t().mm(flat)
            if layout[i][0] and needs[_WEIGHTS + n + i]:
                dbiases[i] = g.sum(0)
        da: list = [None] * count
        db: list = [None] * count
        dd: list = [None] * count
        shared_cols, start = [], 0
        for k, (i, scaling, dropped) in enumerate(plan):
            a, b, g = pairs[2 * k], pairs[2 * k + 1], grads[i]
            rank = a.shape[0]
            if dropped:
                hd, xd = next(own)
                if g is None:
                    continue
                gb = g.mm(b)
                if scaling != 1.0:
                    gb.mul_(scaling)
                if needs[first + 3 * k]:
                    da[k] = gb.t().mm(xd.reshape(-1, xd.shape[-1]))
                if needs[first + 3 * k + 1]:
                    db[k] = g.t().mm(hd)
                if needs[first + 3 * k + 2]:
                    dd[k] = gb.mm(a).view(xd.shape)
                continue
            part = h[:, start : start + rank]
            start += rank
            if g is None:
                shared_cols.append((k, scaling, flat.new_zeros(flat.shape[0], rank)))
                continue
            if needs[first + 3 * k + 1]:
                db[k] = g.t().mm(part)
            shared_cols.append((k, scaling, g.mm(b)))
        if shared_cols and any(grads[plan[k][0]] is not None for k, _, _ in shared_cols):
            gcat = torch.cat([c for _, _, c in shared_cols], dim=1) if len(shared_cols) > 1 else shared_cols[0][2]
            _scale_columns(gcat, [(s, c.shape[1]) for _, s, c in shared_cols])
            if needs[0]:
                dx = gcat.mm(joined) if dx is None else dx.addmm_(gcat, joined)
            wants_a = [k for k, _, _ in shared_cols if needs[first + 3 * k] and grads[plan[k][0]] is not None]
            joined_da = gcat.t().mm(flat) if wants_a else None
            start = 0
            for k, _, c in shared_cols:
                rank = c.shape[1]
                if k in wants_a:
                    rows = joined_da[start : start + rank]
                    da[k] = rows if len(shared_cols) == 1 else rows.clone()  # a copy, not a view of the joined one
                start += rank
        if dx is not None:
            dx = dx.view(x.shape)
        elif needs[0]:
            dx = torch.zeros_like(x)
        dresidual = (
            grads[0].view(x.shape[:-1] + grads[0].shape[-1:]) if ctx.has_residual and grads[0] is not None else None
        )
        dtensors = [t for k in range(count) for t in (da[k], db[k], dd[k])]  # as ``tensors`` held them
        return dx, dresidual, None, None, *dweights, *dbiases, *dtensors


def _adapter_plan(layout: tuple) -> list[tuple[int, float, bool]]:
    """Per adapter, in the order ``tensors`` holds them: its projection, its scaling, whether its input is dropped."""
    return [(i, scaling, dropped) for i, (_, plan, _) in enumerate(layout) for scaling, dropped in plan]


def _scale_columns(t: torch.Tensor, blocks: list[tuple[float, int]]) -> None:
    """Multiply ``t``'s consecutive column blocks by their scalings in place: one kernel when they are equal."""
    scales = {s for s, _ in blocks}
    if len(scales) == 1:
        (s,) = scales
        if s != 1.0:
            t.mul_(s)
        return
    start = 0
    for s, width in blocks:
        if s != 1.0:
            t[:, start : start + width].mul_(s)
        start += width


def project(
    x: torch.Tensor,
    linears: tuple[torch.nn.Module, ...],
    residual: torch.Tensor | None = None,
    recompute: tuple | None = None,
) -> tuple[torch.Tensor, ...] | None:
    """``tuple(linear(x) for linear in linears)`` (``residual + linear(x)`` for one linear with ``residual``)
    through ``_LoraLinears`` when at least one is a LoRA linear and every one can be fused; ``None`` otherwise
    (the caller calls the modules), having said why for a LoRA linear that cannot be fused. ``recompute``:
    ``(swiglu, gate, up)`` for ``x = swiglu(gate, up)``, which is then not kept for the backward."""
    cast_to = autocast_dtype(x)
    parts = []
    for linear in linears:
        found = part(linear, x, cast_to is not None)
        if isinstance(found, Unfused):
            say_once(linear, found)
            return None
        if found is None:
            return None
        parts.append(found)
    if not any(p.adapters for p in parts):
        return None
    if residual is not None:
        if residual.shape != (*x.shape[:-1], parts[0].weight.shape[0]):
            return None
        # the GEMM cannot take the residual (a base with its own GEMM, a bias, an fp32 residual stream under
        # autocast): the sum is added after, as the module's caller would
        if parts[0].called is not None or parts[0].bias is not None or residual.dtype != (cast_to or x.dtype):
            fused = project(x, linears, recompute=recompute)
            return None if fused is None else (residual + fused[0],)
    dtype = cast_to or x.dtype
    if cast_to is None:
        _say_cast(parts, x.dtype)
    with torch.autocast(x.device.type, enabled=False) if cast_to is not None else contextlib.nullcontext():
        x = x.to(dtype)
        droppeds = []
        for p in parts:  # peft's order: each linear's adapters in turn (same generator draws, same masks)
            droppeds.append([None if ad.dropout is None else ad.dropout(x) for ad in p.adapters])
        # a base with a forward apply gave it computes its output itself; the adapters are added to it, and
        # one without adapters is its own output (never an output of the function)
        given = [None if p.called is None else _base_output(p.called, x) for p in parts]
        fused = [i for i, p in enumerate(parts) if p.called is None or p.adapters]
        parts, droppeds, given_fused = (
            [parts[i] for i in fused],
            [droppeds[i] for i in fused],
            [given[i] for i in fused],
        )
        layout = tuple(
            (
                p.bias is not None and p.called is None,
                tuple((ad.scaling, ad.dropout is not None) for ad in p.adapters),
                p.called is not None,
            )
            for p in parts
        )
        tensors = [p.weight if g is None else g for p, g in zip(parts, given_fused)]
        tensors += [None if p.called is not None else p.bias for p in parts]
        for p, drops in zip(parts, droppeds):
            for ad, dropped in zip(p.adapters, drops):
                tensors += [ad.a, ad.b, dropped]
        cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors]
        outs = _LoraLinears.apply(x, residual, layout, recompute, *cast)
        for i, out in zip(fused, outs):
            given[i] = out
        return tuple(g if g.dim() == x.dim() else g.view(*x.shape[:-1], g.shape[-1]) for g in given)


def _base_output(base: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``base(x)`` as a tensor the adapters' products may be added to in place: the one its own function made
    (``_unviewed``) where the call runs the forward ``apply`` gave it; a copy where a forward set on the instance
    wraps that (an accelerate hook's, whose ``post_forward`` may keep the output it returns)."""
    out = base(x)
    return _unviewed(out) if runs_own_forward(base) else out.clone(memory_format=torch.contiguous_format)


def _unviewed(out: torch.Tensor) -> torch.Tensor:
    """A base's output as the tensor its function made, where it is a reshaping view of it (a precision row's op
    returns its 2-D product viewed in the input's shape): that tensor can take the adapters' products in place."""
    base = out._base
    if base is None or base.numel() != out.numel() or not (base.is_contiguous() and out.is_contiguous()):
        return out
    return base if base.storage_offset() == out.storage_offset() else out


def _say_cast(parts: list[Part], dtype: torch.dtype) -> None:
    """Say once that fp32 adapters over 16-bit inputs compute their GEMMs in the inputs' dtype."""
    for p in parts:
        for ad in p.adapters:
            if ad.a.dtype != dtype or ad.b.dtype != dtype:
                adapters, inputs = (str(t).removeprefix("torch.") for t in (ad.a.dtype, dtype))
                line = ADAPTERS_CAST.format(adapters=adapters, inputs=inputs)
                if process_state().said.first(line):
                    logger.info("fusepatch: %s", line)
                return


def survey(model: torch.nn.Module, dtype: torch.dtype, cast: bool) -> dict:
    """The model's peft LoRA linears as ``apply`` reports them: how many; how many can be fused when computing
    in ``dtype`` (``cast``: under autocast or a mixed-precision policy; only dtypes are read); the others as
    log lines with their reason and fix (QLoRA, DoRA) and their count. Merged,
    disabled or hooked adapters count as neither: they run through peft's forward as they should."""
    probe = torch.empty(0, dtype=dtype)
    total, fusable, unfused = 0, 0, {}
    for module in model.modules():
        if not is_lora(module):
            continue
        total += 1
        found = part(module, probe, cast)
        if isinstance(found, Unfused):
            line = describe(type(module).__name__, found)
            unfused[line] = unfused.get(line, 0) + 1
        elif found is not None:
            fusable += 1
    return {"linears": total, "fusable": fusable, "unfused": unfused}
