"""Linear projections the fused layers call themselves: several of one input, and the MLP's last one with the
residual added by the GEMM.

Several projections of one input (the Gated DeltaNet's ``in_proj_qkv/z/b/a``, the MLP's ``gate_proj`` and
``up_proj``): called one by one, autograd gives each its own input gradient and adds them, one elementwise
kernel per extra projection over the whole ``[tokens, hidden]`` tensor (``ViewBackward0 > aten::add`` in a
profile). ``project`` computes the same outputs
with the same kernels and, in its backward, accumulates the input gradient in place through the GEMMs'
``beta = 1`` (``addmm_``): no add kernels, one buffer. The narrow ones among them (``in_proj_b`` and
``in_proj_a``, one output per value head) share one GEMM, forward and backward (``narrow_group``).

The MLP's down projection plus the decoder layer's residual (``residual + down_proj(act)``): one
``addmm(residual, act, W.t())`` instead of a GEMM and an add kernel (each forward, and again in the checkpoint
recompute). The sum is rounded once, from fp32, instead of twice: within one bf16 ulp of transformers' result.

peft's LoRA linears go to ``lora.project``, which fuses their adapters into these GEMMs. Otherwise both paths
take plain ``nn.Linear`` modules only (no subclass such as a quantised or FSDP-wrapped layer, no hooks, no forward of
its own such as a projection ``apply(precision=...)`` patched), outside
``torch.compile``, on the devices in ``DEVICES``; the projections in one dtype or under autocast (cast as
autocast casts them), the residual GEMM in one dtype outside autocast (there the residual stream is fp32 and the
MLP output bf16). Anything else calls the modules as transformers does; several FP8 projections of one input
(``apply(precision="fp8")``) called so share one quantization of it (a ``kernels/fp8_rows`` frame).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusepatch.kernels import fp8_rows
from fusepatch.layers.support import lora
from fusepatch.layers.support.hooks import autocast_dtype as _autocast_dtype
from fusepatch.layers.support.hooks import hooked, in_dtype

DEVICES = ("cuda",)  # where the fused paths run (the tests add "cpu" to run them in a model)


def plain_linears(x: torch.Tensor, linears: tuple[torch.nn.Module, ...], autocast: bool = False) -> bool:
    """Whether ``linears`` can be computed here instead of through their modules, with the same result: plain
    ``nn.Linear`` without hooks or an instance forward, on a device in ``DEVICES``, outside ``torch.compile``; in ``x``'s dtype, or,
    where the caller casts as autocast would (``autocast=True``), under autocast."""
    if x.device.type not in DEVICES or torch.compiler.is_compiling():
        return False
    cast = _autocast_dtype(x) is not None
    if cast and not autocast:
        return False
    for linear in linears:
        # an instance forward (apply's precision rows give their projections one) computes what the weight alone
        # does not say: the module is called
        if type(linear) is not torch.nn.Linear or hooked(linear) or "forward" in linear.__dict__:
            return False
        if not cast and not in_dtype(linear, x.dtype):  # an exact nn.Linear: its parameters are these two
            return False
    return True


NARROW = 256  # out_features up to which bias-free projections of one input share one GEMM


def narrow_group(linears) -> tuple[int, ...]:
    """Indices of the bias-free projections with at most ``NARROW`` outputs, when there are two or more: their
    GEMMs are too narrow to fill the GPU, each costing about what one GEMM of their summed width does (the
    Gated DeltaNet's ``in_proj_b`` and ``in_proj_a``, 48 outputs each at the 27B shape: 0.04 ms a GEMM, three
    GEMMs each a layer's step, benchmarks/studies/gemm_bench.py). One GEMM over their concatenated weights (a copy of
    ``n x hidden`` values a step) computes them together."""
    group = tuple(i for i, linear in enumerate(linears) if linear.bias is None and linear.out_features <= NARROW)
    return group if len(group) > 1 else ()


class _SharedInputLinears(torch.autograd.Function):
    """``F.linear(x, w_i, b_i)`` for every i; the backward accumulates ``dx`` through ``addmm_``. The projections
    named in ``narrow`` run as one GEMM over their concatenated weights, forward and backward; their outputs are
    copies of its columns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, count: int, narrow: tuple[int, ...], *params: torch.Tensor | None):
        weights, biases = params[:count], params[count:]
        ctx.count, ctx.narrow, ctx.has_bias = count, narrow, tuple(b is not None for b in biases)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, and costs nothing
        outs = [None if i in narrow else F.linear(x, w, b) for i, (w, b) in enumerate(zip(weights, biases))]
        joined = None
        if narrow:
            joined = torch.cat([weights[i] for i in narrow])
            sizes = [weights[i].shape[0] for i in narrow]
            for i, out in zip(narrow, F.linear(x, joined).split(sizes, dim=-1)):
                # a copy, not a view made here: a view made inside an autograd function cannot be written in
                # place afterwards (a hook's ``mul_``), where a module's output can (narrow: a few values a row)
                outs[i] = out.clone()
        # x only where a weight's gradient needs it: eager keeps no input of a frozen projection either, so an
        # in-place write to x later (a hook on the next module) is no error there or here
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.save_for_backward(x if any(ctx.needs_input_grad[3 : 3 + count]) else None, joined, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x, joined, *weights = ctx.saved_tensors
        shape, dtype, device = ctx.x_meta
        flat = None if x is None else x.reshape(-1, shape[-1])
        wants_x, wants = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        dx = None
        dweights: list[torch.Tensor | None] = [None] * ctx.count
        dbiases: list[torch.Tensor | None] = [None] * ctx.count
        jobs = [(grad, weight, (i,)) for i, (grad, weight) in enumerate(zip(grads, weights)) if i not in ctx.narrow]
        if ctx.narrow and any(grads[i] is not None for i in ctx.narrow):
            parts = [
                grads[i]
                if grads[i] is not None
                else torch.zeros(*shape[:-1], weights[i].shape[0], dtype=dtype, device=device)
                for i in ctx.narrow
            ]
            jobs.append((torch.cat(parts, dim=-1), joined, ctx.narrow))
        for grad, weight, owners in jobs:
            if grad is None:
                continue
            grad = grad.reshape(-1, grad.shape[-1])
            if wants_x:
                dx = grad.mm(weight) if dx is None else dx.addmm_(grad, weight)
            if any(wants[i] for i in owners):
                dweight = grad.t().mm(flat)
                rows = [weights[i].shape[0] for i in owners]
                for i, part in zip(owners, dweight.split(rows) if len(owners) > 1 else (dweight,)):
                    # a narrow weight's gradient is a copy of its rows, not a view of the joined one
                    if wants[i] and grads[i] is not None:  # an unused output's weight gets no gradient
                        dweights[i] = part.clone() if len(owners) > 1 else part
            if len(owners) == 1 and ctx.has_bias[owners[0]] and wants[ctx.count + owners[0]]:
                dbiases[owners[0]] = grad.sum(0)
        if dx is not None:
            dx = dx.view(shape)
        elif wants_x:
            dx = torch.zeros(shape, dtype=dtype, device=device)
        return dx, None, None, *dweights, *dbiases


def project(x: torch.Tensor, *linears: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, with one accumulated input gradient where it can
    (``plain_linears``), the narrow bias-free ones through one GEMM (``narrow_group``); the modules themselves
    otherwise, or when no gradient is being recorded. Under autocast (the Trainer's bf16 over fp32 weights) the
    input, weights and biases are cast to autocast's dtype first, as autocast casts them for ``F.linear``; the
    casts' backward returns the weight gradients in fp32. FP8 projections among them (``apply(precision="fp8")``,
    also as LoRA bases) quantize ``x`` once: the first records its FP8 rows in this call's frame, the others find
    them (``kernels/fp8_rows``); other modules ignore the frame."""
    if len(linears) < 2 or torch.compiler.is_compiling():
        return _project(x, linears)
    with fp8_rows.frame(share=True):
        return _project(x, linears)


def _project(x: torch.Tensor, linears: tuple[torch.nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    if adapted(x, linears):
        fused = lora.project(x, linears)
        if fused is not None:
            return fused
    if len(linears) < 2 or not torch.is_grad_enabled() or not plain_linears(x, linears, autocast=True):
        return tuple(linear(x) for linear in linears)
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    narrow = narrow_group(linears)
    dtype = _autocast_dtype(x)
    if dtype is None:
        return _SharedInputLinears.apply(x, len(linears), narrow, *weights, *biases)
    cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in (x, *weights, *biases)]
    with torch.autocast(x.device.type, enabled=False):
        return _SharedInputLinears.apply(cast[0], len(linears), narrow, *cast[1:])


def gemm_ready(linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``[residual +] linear(x)`` may run as one GEMM here: a bias-free plain ``nn.Linear``
    (``plain_linears``, no autocast) and ``residual``, if any, of the output's shape and ``x``'s dtype."""
    return (
        linear.bias is None
        and (
            residual is None
            or (
                residual.dtype == x.dtype
                and residual.shape[:-1] == x.shape[:-1]
                and residual.shape[-1] == linear.out_features
            )
        )
        and plain_linears(x, (linear,))
    )


def adapted(x: torch.Tensor, linears: tuple[torch.nn.Module, ...]) -> bool:
    """Whether ``linears`` hold a peft LoRA linear that ``lora.project`` may compute (device, no compiling)."""
    return (
        any(type(linear) is not torch.nn.Linear and lora.is_lora(linear) for linear in linears)
        and x.device.type in DEVICES
        and not torch.compiler.is_compiling()
    )


def apply_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a peft LoRA linear with its adapters fused into its base GEMM (``lora.project``)."""
    if adapted(x, (module,)):
        fused = lora.project(x, (module,))
        if fused is not None:
            return fused[0]
    return module(x)


def linear_plus(linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)`` as one ``addmm`` where it can (``gemm_ready``; for a peft LoRA linear
    ``lora.project``); as that sum otherwise."""
    if adapted(x, (linear,)):
        fused = lora.project(x, (linear,), residual=residual)
        if fused is not None:
            return fused[0]
    if gemm_ready(linear, x, residual):
        out = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), linear.weight.t())
        return out.view(residual.shape)
    return residual + linear(x)
