"""Faulty candidates for the self-test's fault matrix: an op's reference (on the CPU) or a real kernel (on the GPU)
with one kind of error injected. Each must be refused by the self-test before training uses it."""

from __future__ import annotations

import math

import torch

# the ops of the matrix and, for each, the argument a "signature" fault silently ignores
IGNORED = {
    "gated_delta_rule": "cu_seqlens",
    "causal_conv1d": "cu_seqlens",
    "rms_norm": "weight",
    "swiglu": "up",
    "linear_cross_entropy": "num_items_in_batch",
}
PACKED_OPS = ("gated_delta_rule", "causal_conv1d")
# the input whose gradient the gradient faults hit: the first (the delta rule's q, whose bf16 bound is ~2.8% by
# relative error alone: the bf16 reference itself is 1-1.4% off there, beta rounded to bf16 as transformers
# computes it; the scale statistic sees a factor through that noise)
GRAD_FAULT_INPUT = {"gated_delta_rule": 0}
FAULTS = ("output_x1.02", "grad_x1.02", "grad_sign_1pct", "document_first_token", "grad_nan", "ignores_argument")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _replace_first(out, new):
    return (new, *out[1:]) if isinstance(out, tuple) else new


class _GradFault(torch.autograd.Function):
    """Identity forward; the backward changes the incoming gradient of this tensor."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.kind = kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        flat = grad.view(-1)
        if ctx.kind == "grad_x1.02":
            grad = grad * 1.02
        elif ctx.kind == "grad_sign_1pct":
            count = max(1, math.ceil(0.01 * flat.numel()))
            flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:count].to(flat.device)] *= -1
        elif ctx.kind == "grad_nan":
            flat[flat.numel() // 2] = float("nan")
        return grad, None


def _as_one_row(out, documents: int):
    """A delta rule that ran a packed row as one sequence: its one final state stands for every document's, so that
    the values (not the shapes) are what the self-test compares."""
    if not isinstance(out, tuple):
        return out
    return (out[0], out[1].expand(documents, *out[1].shape[1:]), *out[2:])


def faulty(fn, op: str, fault: str):
    """``fn`` with ``fault`` injected. Gradient faults hit one input's gradient (``GRAD_FAULT_INPUT``); the boundary fault scales
    the output's first token of every document after the first by 1.1; the signature fault drops one argument
    (``IGNORED``)."""

    def call(*args, **kwargs):
        if fault in ("grad_x1.02", "grad_sign_1pct", "grad_nan"):
            index = GRAD_FAULT_INPUT.get(op, 0)
            args = (*args[:index], _GradFault.apply(args[index], fault), *args[index + 1 :])
        if fault == "ignores_argument":
            name = IGNORED[op]
            if name in kwargs:
                kwargs = {**kwargs, name: None}
                start = kwargs.get("initial_state")
                if name == "cu_seqlens" and start is not None:  # one row, so one start state: the first document's
                    return _as_one_row(fn(*args, **{**kwargs, "initial_state": start[: args[0].shape[0]]}), len(start))
            elif name == "weight":  # rms_norm(x, weight, eps)
                args = (args[0], torch.ones_like(args[1]), *args[2:])
            elif name == "up":  # swiglu(gate, up)
                args = (args[0], torch.ones_like(args[1]))
        out = fn(*args, **kwargs)
        if fault == "output_x1.02":
            out = _replace_first(out, _first(out) * 1.02)
        elif fault == "document_first_token":
            first = _first(out)
            scale = torch.ones(first.shape[1], device=first.device, dtype=first.dtype)
            starts = kwargs["cu_seqlens"][1:-1].long()
            scale[starts] = 1.1
            out = _replace_first(out, first * scale.view(1, -1, *([1] * (first.ndim - 2))))
        return out

    return call


def cases():
    """(op, fault) pairs of the matrix (the boundary fault applies to the packed ops only)."""
    return [(op, fault) for op in IGNORED for fault in FAULTS if fault != "document_first_token" or op in PACKED_OPS]
