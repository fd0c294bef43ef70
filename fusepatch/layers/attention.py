"""Attention forward: the rotary embedding from a fused kernel, packed rows through a varlen flash kernel.

transformers' attention forwards (Qwen2/3 and their MoE variants, Qwen3-Next, Qwen3.5) apply the rotary
embedding inline, through their modeling module's ``apply_rotary_pos_emb``, and pick the attention function
from the module's ``ALL_ATTENTION_FUNCTIONS``. Re-implementing each forward per family and per transformers
release is what this avoids: the layer's own forward runs unchanged, with those names bound to objects that send
the call to the chosen kernel, or back to transformers for anything the kernel
does not reproduce exactly (another ``unsqueeze_dim``, mixed dtypes, cos/sin that need gradients, a fallback).
The attention rows declare those names (:func:`attn_names`): ``apply`` binds them once and ``revert`` puts
them back (``layers/support/bindings.py``); each call finds its own layer's choices in the calling thread's context,
so threads (``nn.DataParallel`` replicas, the checkpoint recompute in the autograd thread) and unpatched models of
the same family are not affected.

Packed rows (``position_ids`` restarting at 0) under ``attn_implementation="sdpa"``: transformers builds a
block-causal 4D mask, and sdpa with a mask runs cuDNN or the memory-efficient kernel over every masked block,
cuDNN planning anew for every new row length. When the mask is exactly causal within each document and nothing
else (``packing.mask_plan``: no padding, no window, no cache), ``sdpa`` is answered with a varlen kernel over
the boundaries instead (op ``varlen_attention``). Eager attention stays eager: it is what users pick to see
attention weights.

The gated attention of Qwen3.5 and Qwen3-Next is the one forward fusepatch runs itself
(``gated_attention_forward``): its output gate is a strided copy, a sigmoid and a multiply written inline, with no
module-level name to bind. The forward repeats transformers' steps in their order (both supported releases' are the
same but for the cache argument, ``past_key_values`` in 5.17, ``cache`` later, and what ``cache.update`` is
given); test_attention_gate.py holds it to transformers' own forward on each release CI runs.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass

import torch

from fusepatch.base.dtypes import autocast_dtype, dtype_name
from fusepatch.base.op import OpDispatch
from fusepatch.base.row import Binding
from fusepatch.base.state import current as process_state
from fusepatch.layers.support import bindings
from fusepatch.layers.support.packing import boundaries_for_call, mask_plan
from fusepatch.layers.support.projections import apply_linear, project
from fusepatch.layers.support.signature import CACHE_NAMES, forward_parameters
from fusepatch.ops.rotary import unsupported

logger = logging.getLogger("fusepatch")

ROTARY = "apply_rotary_pos_emb"
INTERFACES = "ALL_ATTENTION_FUNCTIONS"
# the context's slots (``bindings.inside``): the calling layer's rotary dispatch, and its packed call's varlen route
ROTARY_SLOT = "rotary"
ROUTE_SLOT = "attention_route"


def attn_names(module: str) -> tuple[Binding, ...]:
    """The names an attention row of the modeling module ``module`` declares: its rotary and attention functions."""
    return Binding(module, ROTARY, _dispatching), Binding(module, INTERFACES, _RoutingInterfaces)


def _dispatching(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *rest, **extra):
        dispatch = bindings.active(ROTARY_SLOT)
        unsqueeze_dim = extra.get("unsqueeze_dim", rest[0] if rest else 1)
        plain = unsqueeze_dim == 1 and len(rest) <= 1 and set(extra) <= {"unsqueeze_dim"}
        if dispatch is not None and plain and unsupported(q, k, cos, sin) is None:
            if dispatch.choice(q.device.type, dtype_name(q.dtype)).fused:
                return dispatch(q, k, cos, sin)
        return original(q, k, cos, sin, *rest, **extra)

    return apply_rotary_pos_emb


@dataclass(frozen=True)
class _Route:
    """A packed call's varlen plan: the boundaries over the flattened rows and the longest document."""

    dispatch: OpDispatch
    cu_seqlens: torch.Tensor
    longest: int
    tokens: int


class _RoutingInterfaces:
    """Stands in for a modeling module's ``ALL_ATTENTION_FUNCTIONS``: ``sdpa`` asked for inside a routed call
    gets the varlen function; every other lookup, and every other thread, gets transformers' own."""

    def __init__(self, original) -> None:
        self._original = original

    def get_interface(self, implementation, default):
        found = self._original.get_interface(implementation, default)
        route = bindings.active(ROUTE_SLOT)
        if route is None or implementation != "sdpa":
            return found
        return functools.partial(_varlen_attention, route, found)

    def __getitem__(self, key):
        return self._original[key]

    def __contains__(self, key) -> bool:
        return key in self._original

    def __getattr__(self, name):
        return getattr(self._original, name)


def _varlen_attention(route: _Route, sdpa, module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-interface signature ([B, H, S, D] in, [B, S, H, D] out) over the varlen op;
    anything the op does not compute exactly goes to transformers' sdpa with its mask."""
    dropout, scaling = kwargs.get("dropout", 0.0), kwargs.get("scaling")
    batch, heads, length, dim = query.shape
    device = query.device.type
    dtype = query.dtype
    if dtype == torch.float32:  # under autocast sdpa computes in autocast's dtype; so does the varlen kernel
        dtype = autocast_dtype(device) or dtype
    choice = route.dispatch.choice(device, dtype_name(dtype), True)
    if not choice.fused or dropout or kwargs.get("sliding_window") is not None or batch * length != route.tokens:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    fn = route.dispatch.implementation(device, dtype_name(dtype), True)
    q = query.transpose(1, 2).reshape(batch * length, heads, dim).to(dtype)
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim).to(dtype)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], value.shape[-1]).to(dtype)
    out = fn(q, k, v, route.cu_seqlens, route.longest, scaling)
    return out.view(batch, length, heads, -1), None


def _route(self, args: tuple, kwargs: dict) -> _Route | None:
    """The varlen route of this call, or None (not packed, not sdpa, a cache, dropout, a mask that is not
    plain block-causal: those keep transformers' path, the last one said once per layer class)."""
    dispatch = self._fusepatch.ops.get("varlen_attention")
    if dispatch is None or dispatch.disabled_reason is not None:  # excluded: not even the mask is read
        return None
    if getattr(self.config, "_attn_implementation", None) != "sdpa":
        return None
    if any(kwargs.get(name) is not None for name in CACHE_NAMES):
        return None
    if self.training and getattr(self, "attention_dropout", 0.0):
        return None
    position_ids = kwargs.get("position_ids")
    cu = boundaries_for_call(position_ids)
    if cu is None:
        return None
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    plan = mask_plan(mask, cu)
    if plan is None or not plan.block_causal:
        if plan is None or plan.crosses:  # transformers does this when an attention_mask or a cache is passed
            why = "transformers' attention lets its documents attend to each other (an attention_mask was passed?)"
        else:
            why = "its mask is not plain causal within each document (padding or a sliding window)"
        if process_state().said.first(f"{type(self).__name__}: packed batch not routed: {why}"):
            logger.warning(
                "fusepatch: %s: a packed batch stays on transformers' sdpa, not the varlen kernel: %s. "
                "Fix: pack without padding (DataCollatorWithFlattening), no attention_mask, use_cache=False.",
                type(self).__name__,
                why,
            )
        return None
    return _Route(
        dispatch, cu, plan.longest, position_ids[0].numel() if position_ids.ndim == 3 else position_ids.numel()
    )


def _with_bindings(self, args: tuple, kwargs: dict, body):
    """``body(module)`` with the layer's modeling module's rotary (and, for a packed call, its attention
    interfaces) sending this thread's calls to fusepatch's dispatch. The module's names were bound by ``apply``
    (``layers/support/bindings.py``); a call only sets this thread's choices."""
    module = sys.modules[type(self).__module__]
    with bindings.inside({ROTARY_SLOT: self._fusepatch.ops.get("rotary"), ROUTE_SLOT: _route(self, args, kwargs)}):
        return body(module)


def attention_forward(self, *args, **kwargs):
    """The attention layer's own forward, with the fused rotary and, for packed rows, the varlen kernel."""
    return _with_bindings(self, args, kwargs, lambda module: self._fusepatch.original(*args, **kwargs))


_GATED_POSITIONAL = ("hidden_states", "position_embeddings", "attention_mask", "cache")


def _gated_call(self, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name when fusepatch's gated forward computes it as transformers' would (nothing
    positional beyond the four named ones, ``q_proj`` twice as wide as the heads); None otherwise."""
    if len(args) > len(_GATED_POSITIONAL):
        return None
    named = dict(zip(_GATED_POSITIONAL, args), **kwargs)
    if "hidden_states" not in named or "position_embeddings" not in named or "layer_past" in named:
        return None
    heads, dim = self.config.num_attention_heads, getattr(self, "head_dim", None)
    if dim is None or getattr(self.q_proj, "out_features", None) != 2 * heads * dim:
        return None
    return named


def _update_cache(self, cache, key: torch.Tensor, value: torch.Tensor, extra: dict):
    """``cache.update`` as the layer's release calls it: transformers 5.17 passes the layer index only; later
    releases (whose forward names the argument ``cache``) also hand it the attention kwargs."""
    if "cache" in forward_parameters(type(self)):
        return cache.update(key, value, self.layer_idx, kwargs=extra)
    return cache.update(key, value, self.layer_idx)


def gated_attention_forward(self, *args, **kwargs):
    """Qwen3.5 / Qwen3-Next gated full attention: transformers' forward, step for step, with q/k/v projected
    through ``project`` (one accumulated input gradient), the gate half of ``q_proj``'s output left in place and
    the output gate ``attn * sigmoid(gate)`` through the ``attention_gate`` op; rotary and packed rows as
    ``attention_forward``. A call this forward does not take runs transformers' forward with those bindings."""
    named = _gated_call(self, args, kwargs)
    if named is None:
        return attention_forward(self, *args, **kwargs)

    def body(module):
        hidden_states = named.pop("hidden_states")
        cos, sin = named.pop("position_embeddings")
        attention_mask = named.pop("attention_mask", None)
        cache = next((c for c in (named.pop(n, None) for n in CACHE_NAMES) if c is not None), None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        joint, key, value = project(hidden_states, self.q_proj, self.k_proj, self.v_proj)
        query, gate = torch.chunk(joint.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(key.view(hidden_shape)).transpose(1, 2)
        value = value.view(hidden_shape).transpose(1, 2)
        query, key = module.apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = _update_cache(self, cache, key, value, named)
        interface = getattr(module, INTERFACES).get_interface(
            self.config._attn_implementation, module.eager_attention_forward
        )
        attn_output, attn_weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **named,
        )
        attn_output = attn_output.reshape(*input_shape, -1)
        return apply_linear(self.o_proj, _gate(self, attn_output, gate)), attn_weights

    return _with_bindings(self, args, kwargs, body)


def _gate(self, attn_output: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``attn_output * sigmoid(gate)`` through the op where it takes the call (one dtype), as transformers
    computes it otherwise."""
    dispatch = self._fusepatch.ops.get("attention_gate")
    if dispatch is not None and attn_output.dtype == gate.dtype:
        return dispatch(attn_output.contiguous(), gate)
    return attn_output.contiguous() * torch.sigmoid(gate.reshape(attn_output.shape))
