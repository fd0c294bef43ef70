"""Linear projections the fused layers call themselves: several of one input, and the MLP's last one with the
residual added by the GEMM.

Several projections of one input (the Gated DeltaNet's ``in_proj_qkv/z/b/a``, the MLP's ``gate_proj`` and
``up_proj``): called one by one, autograd gives each its own input gradient and adds them, one elementwise
kernel per extra projection over the whole ``[tokens, hidden]`` tensor (0.88 ms of the 27B-shaped step on the
H200: ``ViewBackward0 > aten::add``, benchmarks/RESULTS.md, session 10). ``project`` computes the same outputs
with the same kernels and, in its backward, accumulates the input gradient in place through the GEMMs'
``beta = 1`` (``addmm_``): no add kernels, one buffer.

The MLP's down projection plus the decoder layer's residual (``residual + down_proj(act)``): one
``addmm(residual, act, W.t())`` instead of a GEMM and an add kernel (each forward, and again in the checkpoint
recompute). The sum is rounded once, from fp32, instead of twice: within one bf16 ulp of transformers' result.

Both paths take plain ``nn.Linear`` modules only (no subclass such as a LoRA, quantised or FSDP-wrapped layer,
no hooks), outside ``torch.compile``, on the devices in ``DEVICES``; the projections in one dtype or under
autocast (cast as autocast casts them), the residual GEMM in one dtype outside autocast (there the residual
stream is fp32 and the MLP output bf16). Anything else calls the modules as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

DEVICES = ("cuda",)  # where the fused paths run (the tests add "cpu" to run them in a model)


def _active(hooks) -> bool:
    """Whether ``hooks`` (a module's or the global hook dict) holds one that must see the module's call. The
    profiler labels of ``fusepatch.profile.label_layers`` are marked passive: skipping them only moves the ops
    into the enclosing label, and honouring them would make the profiled step differ from the timed ones."""
    return any(not getattr(hook, "_fusepatch_passive", False) for hook in (hooks or {}).values())


def hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module``'s parts directly would skip a hook (its own or a global one)."""
    return any(
        _active(hooks)
        for hooks in (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            getattr(module, "_backward_pre_hooks", None),
            _module._global_forward_hooks,
            _module._global_forward_pre_hooks,
            _module._global_backward_hooks,
            getattr(_module, "_global_backward_pre_hooks", None),
        )
    )


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def plain_linears(x: torch.Tensor, linears: tuple[torch.nn.Module, ...], autocast: bool = False) -> bool:
    """Whether ``linears`` can be computed here instead of through their modules, with the same result: plain
    ``nn.Linear`` without hooks, on a device in ``DEVICES``, outside ``torch.compile``; in ``x``'s dtype, or,
    where the caller casts as autocast would (``autocast=True``), under autocast."""
    if x.device.type not in DEVICES or torch.compiler.is_compiling():
        return False
    cast = _autocast_dtype(x) is not None
    if cast and not autocast:
        return False
    for linear in linears:
        if type(linear) is not torch.nn.Linear or hooked(linear):
            return False
        if not cast and any(p.dtype != x.dtype for p in linear.parameters(recurse=False)):
            return False
    return True


class _SharedInputLinears(torch.autograd.Function):
    """``F.linear(x, w_i, b_i)`` for every i; the backward accumulates ``dx`` through ``addmm_``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, count: int, *params: torch.Tensor | None):
        weights, biases = params[:count], params[count:]
        ctx.count, ctx.has_bias = count, tuple(b is not None for b in biases)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, and costs nothing
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x, *weights = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        wants_x, wants = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        dx = None
        dweights: list[torch.Tensor | None] = [None] * ctx.count
        dbiases: list[torch.Tensor | None] = [None] * ctx.count
        for i, (grad, weight) in enumerate(zip(grads, weights)):
            if grad is None:
                continue
            grad = grad.reshape(-1, grad.shape[-1])
            if wants_x:
                dx = grad.mm(weight) if dx is None else dx.addmm_(grad, weight)
            if wants[i]:
                dweights[i] = grad.t().mm(flat)
            if ctx.has_bias[i] and wants[ctx.count + i]:
                dbiases[i] = grad.sum(0)
        if dx is not None:
            dx = dx.view(x.shape)
        elif wants_x:
            dx = torch.zeros_like(x)
        return dx, None, *dweights, *dbiases


def project(x: torch.Tensor, *linears: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, with one accumulated input gradient where it can
    (``plain_linears``); the modules themselves otherwise, or when no gradient is being recorded. Under autocast
    (the Trainer's bf16 over fp32 weights) the input, weights and biases are cast to autocast's dtype first, as
    autocast casts them for ``F.linear``; the casts' backward returns the weight gradients in fp32."""
    if len(linears) < 2 or not torch.is_grad_enabled() or not plain_linears(x, linears, autocast=True):
        return tuple(linear(x) for linear in linears)
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    dtype = _autocast_dtype(x)
    if dtype is None:
        return _SharedInputLinears.apply(x, len(linears), *weights, *biases)
    cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in (x, *weights, *biases)]
    with torch.autocast(x.device.type, enabled=False):
        return _SharedInputLinears.apply(cast[0], len(linears), *cast[1:])


def linear_plus(linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)`` as one ``addmm`` where it can (bias-free plain ``nn.Linear``, ``residual`` of
    the output's shape and dtype); as that sum otherwise."""
    if (
        linear.bias is None
        and residual.dtype == x.dtype
        and residual.shape[:-1] == x.shape[:-1]
        and residual.shape[-1] == linear.out_features
        and plain_linears(x, (linear,))
    ):
        out = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), linear.weight.t())
        return out.view(residual.shape)
    return residual + linear(x)
