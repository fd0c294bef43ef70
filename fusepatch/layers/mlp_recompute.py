"""The SwiGLU MLP's down projection with its input recomputed in the backward instead of kept (opt-in).

Why: the down projection's input ``swiglu(gate, up)`` is ``tokens x intermediate`` (136 MB a layer at the
Qwen3.5-27B shape and 4096 tokens), kept from the forward only for the down weight's gradient, while the SwiGLU
op keeps ``gate`` and ``up`` for its own backward anyway. Recomputing it there costs one elementwise SwiGLU
kernel a layer (reads ``gate`` and ``up``, writes the product): less peak memory for a little more GPU time.
Off by default, for a larger micro-batch or longer rows: ``FUSEPATCH_MLP_RECOMPUTE=1`` (or
true/yes/on, as fusepatch's other switches) turns it on for the models ``apply`` patches while it is set
(another value than a switch's is an error of ``apply``).

The recomputed product is the forward's bit for bit (the same op on the same inputs), so the down weight's
gradient is the same GEMM on the same values; the SwiGLU op's own backward (whichever candidate the registry
chose) gives the gate and up gradients. The residual, when given, is added by the forward's GEMM as
``linear_plus`` adds it, and its gradient is the output's.

A peft LoRA down projection keeps the product for its adapters' ``A`` gradients (its frozen base, plain or with a
forward ``apply`` gave it, needs none): the fused LoRA path (``lora.project`` with ``recompute``) keeps ``gate`` and ``up`` instead and
computes the product again in its backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusepatch.base.log import logger
from fusepatch.base.state import current as process_state
from fusepatch.layers.support import lora, projections
from fusepatch.layers.support.hooks import autocast_dtype


class _RecomputedDown(torch.autograd.Function):
    """``[residual +] swiglu(gate, up) @ weight.t()``, keeping ``gate``, ``up`` and ``weight`` only."""

    @staticmethod
    def forward(ctx, gate, up, weight, residual, swiglu: Callable):
        act = swiglu(gate, up)
        flat = act.reshape(-1, act.shape[-1])
        if residual is None:
            out = flat.mm(weight.t())
        else:
            out = torch.addmm(residual.reshape(-1, residual.shape[-1]), flat, weight.t())
        ctx.swiglu, ctx.has_residual = swiglu, residual is not None
        ctx.save_for_backward(gate, up, weight)
        # a tensor of its own for autograd, not a view made here, which could not be written in place afterwards
        # (a hook on the layer or the MLP may, as on transformers' output)
        return out.view(*act.shape[:-1], weight.shape[0]).detach()

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        wants_gate, wants_up, wants_weight = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(wants_gate), up.detach().requires_grad_(wants_up)
            act = ctx.swiglu(g, u)
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = dy.t().mm(act.detach().reshape(-1, act.shape[-1])) if wants_weight else None
        grad_gate = grad_up = None
        if wants_gate or wants_up:
            grad_act = dy.mm(weight).view(act.shape)
            inputs = [t for t, wanted in ((g, wants_gate), (u, wants_up)) if wanted]
            grads = iter(torch.autograd.grad(act, inputs, grad_act))
            grad_gate = next(grads) if wants_gate else None
            grad_up = next(grads) if wants_up else None
        grad_residual = grad_out if ctx.has_residual and ctx.needs_input_grad[3] else None
        return grad_gate, grad_up, grad_weight, grad_residual, None


def recomputed_down(
    swiglu: Callable,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.nn.Module,
    residual: torch.Tensor | None,
    *,
    enabled: bool,
) -> torch.Tensor | None:
    """``[residual +] down(swiglu(gate, up))`` with the product recomputed in the backward, when it is switched on
    (``enabled``: ``FUSEPATCH_MLP_RECOMPUTE=1`` when the model was patched), a gradient is being recorded, and
    ``down`` is a bias-free plain ``nn.Linear`` in the inputs' dtype (no autocast; the residual, if any, of the
    output's shape and dtype) or a peft LoRA linear the fused LoRA path takes (which keeps the product for the
    adapters' gradients, over a base with a forward ``apply`` gave it too); None otherwise (the caller runs the usual path). Switched on but
    stepping aside while training is said once, with the reason: the switch promised less memory."""
    if not (enabled and torch.is_grad_enabled() and up.shape == gate.shape and up.dtype == gate.dtype):
        return None
    if lora.is_lora(down) and projections.adapted(gate, (down,)):
        act = swiglu(gate, up)
        # gate and up are kept anyway only where they take a gradient (not before the first layer that does)
        keeps = gate.requires_grad and up.requires_grad
        fused = lora.project(act, (down,), residual=residual, recompute=(swiglu, gate, up) if keeps else None)
        if fused is not None:
            return fused[0]
        _say_kept(LORA_UNFUSED, CHECKPOINTING)  # the usual path, on the product computed already
        return projections.apply_linear(down, act) if residual is None else projections.linear_plus(down, act, residual)
    if not projections.gemm_ready(down, gate, residual):  # the conditions of linear_plus's one-GEMM path
        _say_kept(*_kept_because(down, gate))
        return None
    return _RecomputedDown.apply(gate, up, down.weight, residual, swiglu)


def _say_kept(why: str, fix: str) -> None:
    if process_state().said.first(f"{KEPT}: {why}"):
        logger.warning("fusepatch: %s: %s; fix: %s", KEPT, why, fix)


LORA_UNFUSED = (
    "it is a peft LoRA linear run through peft's own forward (merged or disabled adapters, a hook, or the reason "
    "said for it)"
)
KEPT = "FUSEPATCH_MLP_RECOMPUTE=1: an MLP's down projection keeps its input instead of recomputing it"
CHECKPOINTING = "activation checkpointing (model.gradient_checkpointing_enable()) recomputes whole layers instead"


def _kept_because(down: torch.nn.Module, x: torch.Tensor) -> tuple[str, str]:
    """Why ``down`` is no projection the recompute can compute (``gemm_ready`` said no), and the fix, in a user's
    words."""
    if torch.compiler.is_compiling():
        return "torch.compile traces the layer (the recompute runs outside it)", CHECKPOINTING
    if x.device.type not in projections.DEVICES:
        return f"the recompute runs on {', '.join(projections.DEVICES)}, not {x.device.type}", CHECKPOINTING
    if lora.own_forward(down):
        return f"it computes through a forward apply gave it ({_ops_of(down)}), whose backward keeps its input", (
            CHECKPOINTING
        )
    if autocast_dtype(x) is not None:
        return "it runs under autocast", f"train with the weights in the compute dtype, or {CHECKPOINTING}"
    return (
        "it is not a bias-free plain nn.Linear in its input's dtype (a bias, a hook, another class or dtype)",
        CHECKPOINTING,
    )


def _ops_of(module: torch.nn.Module) -> str:
    """The ops a patched module runs, in a user's words: ``op <name>: <summary>``."""
    dispatches = module.__dict__["_fusepatch"].ops
    return "; ".join(f"op {name}: {getattr(getattr(d, 'op', None), 'summary', name)}" for name, d in dispatches.items())
