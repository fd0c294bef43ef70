"""Decoder layers: the residual add fused into the post-attention RMSNorm.

transformers' decoder layer computes ``h = residual + attn_out`` and then ``post_attention_layernorm(h)``: two
passes over the residual stream forward and two backward (the norm's input gradient plus the residual's). The
fused op does both in one kernel each way. The layer's second add (``h + mlp_out``) feeds the *next* layer's
norm, across the layer boundary; where the MLP is fusepatch's SwiGLU with plain linear layers it is done by the
down projection's GEMM (``addmm``, see ``projections.linear_plus``), else it stays an add.

Where the projections a producer feeds are FP8 (``apply(precision="fp8")``), the producer writes their FP8 rows
beside its output in the same kernel (``kernels/fp8_rows``): the input norm for the mixer's input projections
(q/k/v, the Gated DeltaNet's), the residual add + norm for the MLP's gate/up, the SwiGLU for the down projection;
in the backward the SwiGLU for gate/up's output gradients and the add + norm for the mixer's output projection's
(o_proj, out_proj: the gradient of the residual add's summand), where those weights are trained.
Each is asked inside a frame that holds the rows for that call only; the projections check that the tensor they
get is the one the rows were made for, unwritten since, and quantize it themselves otherwise.

The forward below is the layer's own, step for step, with those changes; it runs when the fused op has a
candidate for the layer input's device and dtype. Where the two summands' dtypes differ (autocast over fp32
weights: an fp32 residual stream, a bf16 attention output) it adds them as transformers does, since the kernel
takes one dtype. Without a candidate the layer's original forward runs unchanged, so the eager path is
transformers' own code, bit for bit.

Release drift it absorbs: the cache argument (``past_key_values`` in transformers 5.17, ``cache`` later; the
linear-attention mixer's ``cache_params`` / ``cache``) and where activation checkpointing wraps the layer
(5.17 checkpoints ``__call__``, around this forward; later releases wrap the class's ``forward``, which this
instance forward replaces, so it checkpoints itself the same way).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fusepatch.backends import deepspeed
from fusepatch.base.dtypes import dtype_name
from fusepatch.kernels import fp8_rows
from fusepatch.layers.simple import _eps, swiglu_mlp_plus
from fusepatch.layers.support.hooks import may_bypass, same_family
from fusepatch.layers.support.packing import packed_kwargs
from fusepatch.layers.support.signature import CACHE_NAMES, forward_parameters

ADD_NORM_OPS = ("add_rms_norm", "add_rms_norm_zero_centered")


# A per-class memo as a plain dict, not functools.cache: torch.compile traces through a cache wrapper (and warns).
_CHECKPOINTS_IN_FORWARD: dict[type, bool] = {}


def _checkpoints_in_forward(cls: type) -> bool:
    """Whether this transformers wraps the layer class's ``forward`` in activation checkpointing (5.2x), rather
    than ``__call__`` (5.17). Read from the base class itself, not from the version number."""
    found = _CHECKPOINTS_IN_FORWARD.get(cls)
    if found is None:
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:
            found = False
        else:
            found = issubclass(cls, GradientCheckpointingLayer) and "__init_subclass__" in vars(
                GradientCheckpointingLayer
            )
        _CHECKPOINTS_IN_FORWARD[cls] = found
    return found


def _bind(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict, dict]:
    """Split a call into (hidden_states, the layer's named parameters, the extra ``**kwargs``)."""
    names = forward_parameters(type(self))
    named = dict(zip(names, args))
    extra = {}
    for key, value in kwargs.items():
        if key in names:
            named[key] = value
        else:
            extra[key] = value
    hidden_states = named.pop(names[0])
    return hidden_states, named, extra


def _mixer(self, hidden_states: torch.Tensor, named: dict, extra: dict) -> torch.Tensor:
    """The token mixer, called as the layer's own forward calls it."""
    linear = getattr(self, "linear_attn", None)
    if linear is not None and getattr(self, "block_type", "linear_attention") == "linear_attention":
        cache = next((named[n] for n in CACHE_NAMES if n in named), None)
        cache_name = "cache_params" if "cache_params" in forward_parameters(type(linear)) else "cache"
        return linear(
            hidden_states=hidden_states,
            attention_mask=named.get("attention_mask"),
            **{cache_name: cache},
            **extra,
        )
    out = self.self_attn(hidden_states=hidden_states, **named, **extra)
    return out[0] if isinstance(out, tuple) else out


def _fused_forward(self, *args, **kwargs) -> torch.Tensor:
    hidden_states, named, extra = _bind(self, args, kwargs)
    residual = hidden_states
    fed = _feeds_fp8(hidden_states, _mixer_inputs(self))
    with _frame(fed) as frame:  # the FP8 rows of the input norm's output, for the mixer's projections
        with frame.emitting(fed):
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states = _mixer(self, hidden_states, named, extra)
    norm = self.post_attention_layernorm
    mlp = self.mlp
    # (asked on the residual before the add: where transformers' add below promotes the sum's dtype, the rows are
    # still only a hint, which a projection checks against the tensor it gets)
    fed = _feeds_fp8(residual, (getattr(mlp, "gate_proj", None),))
    mixed = _feeds_fp8(residual, _mixer_outputs(self), trained=True)  # the mixer's output projection
    fed_down = _feeds_fp8(residual, (getattr(mlp, "down_proj", None),))
    trained = _feeds_fp8(residual, (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)), trained=True)
    with _frame(fed or mixed or fed_down or trained) as frame:  # the norm's and the SwiGLU's rows, for the MLP's
        # _run chose this forward because the op is fused for the layer input's device and dtype: the same dtype
        # here means the same choice. The norm module is called where its own work would not be the fused one's: a
        # hook on it, a forward set on it, or another class swapped in.
        if hidden_states.dtype == residual.dtype and may_bypass(norm, gathering=True) and same_family(norm, self):
            dispatch = self._fusepatch.ops[_add_norm_op(self)]
            deepspeed.gather(self, norm.weight)  # the norm's own forward (ZeRO-3 would gather it for) is not called
            with frame.emitting(fed, gradients=mixed):
                hidden_states, residual = dispatch(hidden_states, residual, norm.weight, _eps(norm))
        else:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        with frame.emitting(fed_down, gradients=trained):
            fused = swiglu_mlp_plus(mlp, hidden_states, residual)  # the add in the down projection's GEMM
        if fused is not None:
            return fused
        hidden_states = mlp(hidden_states)  # in the frame: its projections may read the norm's rows
    if isinstance(hidden_states, tuple):  # MoE blocks that also return router logits
        hidden_states = hidden_states[0]
    return residual + hidden_states


class _NoFrame:
    """Where no producer of a layer call is asked for FP8 rows (no FP8 projection reads them): no frame to open."""

    def emitting(self, wanted: bool = True, gradients: bool = False) -> contextlib.nullcontext:
        return contextlib.nullcontext()


_NO_FRAME = contextlib.nullcontext(_NoFrame())


def _frame(wanted: bool):
    """A ``kernels/fp8_rows`` frame where a producer inside is asked to write FP8 rows, else nothing (a bf16 model's
    decoder layers open none: each frame and its ``emitting`` are host time in every layer's call)."""
    return fp8_rows.frame() if wanted else _NO_FRAME


def _mixer_module(self) -> torch.nn.Module | None:
    mixer = getattr(self, "linear_attn", None)
    if mixer is None or getattr(self, "block_type", "linear_attention") != "linear_attention":
        mixer = getattr(self, "self_attn", None)
    return mixer


def _mixer_inputs(self) -> tuple:
    """The token mixer's input projections (attention's q_proj, the Gated DeltaNet's in_proj_qkv or in_proj_qkvz)."""
    mixer = _mixer_module(self)
    return tuple(getattr(mixer, name, None) for name in ("q_proj", "in_proj_qkv", "in_proj_qkvz"))


def _mixer_outputs(self) -> tuple:
    """The token mixer's output projection (attention's o_proj, the Gated DeltaNet's out_proj), whose output the
    residual add takes: the add-RMSNorm's backward writes its output gradient."""
    mixer = _mixer_module(self)
    found = next((p for p in (getattr(mixer, n, None) for n in ("o_proj", "out_proj")) if p is not None), None)
    return (found,)


def _feeds_fp8(x: torch.Tensor, projections: tuple, trained: bool = False) -> bool:
    """Whether one of ``projections`` (peft's LoRA linears: their base) computes with FP8 GEMMs for ``x``'s device
    and dtype (``trained``: all of them, with a trained weight, whose input gradient reads its output gradient's
    rows unscaled): its producer then writes the FP8 rows it would quantize (a hint only: a projection that is not
    FP8 never reads them, and one that is checks them)."""
    if torch.compiler.is_compiling():
        return False
    found = []
    for projection in projections:
        base = getattr(projection, "base_layer", projection)
        state = getattr(base, "__dict__", {}).get("_fusepatch")
        dispatch = None if state is None else getattr(state, "ops", {}).get("fp8_linear")
        fp8 = dispatch is not None and dispatch.choice(x.device.type, dtype_name(x.dtype)).fused
        found.append(fp8 and (not trained or (projection is base and bool(base.weight.requires_grad))))
    return all(found) if trained else any(found)


def _add_norm_op(self) -> str:
    return next(name for name in ADD_NORM_OPS if name in self._fusepatch.ops)


def _wants_fused(self, args: tuple, kwargs: dict) -> bool:
    """Whether the fused op has a kernel for this call's device and dtype (decided on the layer's input)."""
    hidden_states = args[0] if args else kwargs.get(forward_parameters(type(self))[0])
    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        return False
    if not all(hasattr(self, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False  # a layer laid out differently from the ones this forward mirrors
    dispatch = self._fusepatch.ops[_add_norm_op(self)]
    return dispatch.choice(hidden_states.device.type, dtype_name(hidden_states.dtype)).fused


def _run(self, args: tuple, kwargs: dict) -> torch.Tensor:
    if not _wants_fused(self, args, kwargs):
        return self._fusepatch.original(*args, **kwargs)
    checkpointing = getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled()
    if checkpointing and _checkpoints_in_forward(type(self)):
        # What the class's checkpointing wrapper does before it checkpoints the layer: a cache cannot be
        # written twice (once more in the backward's recompute).
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            for name in ("cache", "layer_past"):
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        return self._gradient_checkpointing_func(functools.partial(_fused_forward, self, **kwargs), *args)
    return _fused_forward(self, *args, **kwargs)


def decoder_layer_forward(self, *args, **kwargs):
    """Qwen2/Qwen3 (and their MoE) decoder layer: the residual add fused into the post-attention norm; a packed
    batch whose attention mask would let documents see each other is refused, as in the hybrid layers."""
    return _run(self, args, packed_kwargs(self, args, kwargs))


def hybrid_decoder_layer_forward(self, *args, **kwargs):
    """Hybrid (Qwen3.5, Qwen3-Next) decoder layer: packed-document boundaries handed to linear attention (see
    ``packing.packed_kwargs``), and the residual add fused into the post-attention norm."""
    return _run(self, args, packed_kwargs(self, args, kwargs))
