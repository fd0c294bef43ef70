"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next linear attention) for training, prefill and continuation.

The flow is transformers' (projections, conv + SiLU, gated delta rule, gated RMSNorm, out projection), with
four differences: every op goes through a per-call dispatcher (fused on GPU, eager elsewhere), q/k are not
copied for grouped value heads in the forward (the kernels take them natively; the default delta rule's backward
expands them once, ops/gated_delta_rule/saved_states.py), packed documents are exact (``cu_seqlens`` reaches the
conv and the recurrence), and a cache is filled by the fused kernels themselves: the delta rule's final state and
the conv's last inputs, through the cache's own methods (``layers/support/linear_cache.py``), so a training
forward with ``use_cache=True`` (Qwen3.5 configs' default) runs fused, and a continuation from the cache starts
from those states. Calls the fused path cannot compute exactly run transformers' forward, with the kernels
fusepatch refused kept out of its dispatch (``layers/support/dispatch_guard.py``); each reason is said once and
counted for the report.
"""

from __future__ import annotations

import functools
import logging

import torch

from fusepatch.backends import deepspeed
from fusepatch.base.state import current as process_state
from fusepatch.layers.support import dispatch_guard, linear_cache
from fusepatch.layers.support.hooks import may_bypass, same_family
from fusepatch.layers.support.projections import apply_linear, project

logger = logging.getLogger("fusepatch")


def _transformers_forward_reason(self, cache, cu_seqlens) -> str | None:
    """Why this call runs transformers' forward rather than the fused one, or None."""
    if self.activation not in ("silu", "swish"):
        return f"activation {self.activation!r} (the fused conv applies SiLU)"
    if cache is None:
        return None
    why = linear_cache.unsupported(cache, self.layer_idx)
    if (
        why is None
        and cu_seqlens is not None
        and linear_cache.previous_recurrent_state(cache, self.layer_idx) is not None
    ):
        why = "a packed call continuing from a cache"
    return why


def _transformers_forward(self, why: str, hidden_states, cache, attention_mask, kwargs):
    """transformers' forward for this call, the ops fusepatch refused for its device and dtype kept out of its
    dispatch; counted per reason on the layer (``fusepatch.report``) and said once per layer class and reason."""
    state = self._fusepatch
    state.transformers_calls[why] = state.transformers_calls.get(why, 0) + 1
    device, dtype = hidden_states.device.type, str(hidden_states.dtype).removeprefix("torch.")
    packed = kwargs.get("cu_seq_lens_q") is not None
    refused = {name for name, dispatch in state.ops.items() if not dispatch.choice(device, dtype, packed).fused}
    module = type(self).__module__
    key = f"{type(self).__name__}: {why}"
    if process_state().said.first(key):
        kernels = dispatch_guard.kernels_behind(module)
        ran = ", ".join(
            f"{name} -> {'torch (refused by fusepatch)' if dispatch_guard.GUARDED[name] in refused else kernel}"
            for name, kernel in kernels.items()
        )
        logger.warning(
            "fusepatch: %s: %s runs transformers' forward, not the fused one; its dispatch: %s",
            type(self).__name__,
            why,
            ran or "(none found)",
        )
        missing = dispatch_guard.unguardable(module, refused)
        if missing:
            logger.warning(
                "fusepatch: %s: transformers' %s has no torch code fusepatch can find, so a kernel fusepatch "
                "refused may run there. Fix: upgrade fusepatch, or use the transformers release it supports",
                type(self).__name__,
                ", ".join(missing),
            )
    with dispatch_guard.refusing(refused):
        # The cache goes in positionally: it is `cache_params` up to transformers 5.2x and `cache` after.
        return state.original(hidden_states, cache, attention_mask=attention_mask, **kwargs)


def _projections(self, hidden_states: torch.Tensor):
    """(mixed_qkv [B, T, conv_dim], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv]) for either layout; the
    projections of the one input through ``project`` (one accumulated input gradient)."""
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            *project(hidden_states, self.in_proj_qkvz, self.in_proj_ba)
        )
        query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
        return torch.cat((query, key, value), dim=-1), z, b, a
    batch, length, _ = hidden_states.shape
    mixed, z, b, a = project(hidden_states, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
    return mixed, z.reshape(batch, length, -1, self.head_v_dim), b, a


COPY_DEVICES = ("cuda",)  # where split_channels copies (the tests add "cpu" to run that path in a model)
TRITON_SPLIT_DEVICES = ("cuda",)  # where the copy tries fusepatch's Triton split first (the tests add "cpu")
_SPLIT_FAILED = (
    "Gated DeltaNet: the Triton split failed"  # said once the Triton split failed here: torch's op from then on
)


@functools.cache
def _triton_split3():
    """fusepatch's Triton kernel for three parts (``kernels/split.py``: no host wait), where Triton imports."""
    try:
        from fusepatch.kernels.split import split3
    except ImportError:  # no Triton: torch's split_with_sizes_copy
        return None
    return split3


def _triton_split(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...] | None:
    """The Triton split's parts, or None where it does not run: not three parts, not a device it runs on, no
    Triton, or a Triton that failed to build or launch it here (a broken install, which the ops' self-tests
    refuse on their own: the layer must still run). That failure is said once and torch's op is used from then
    on, never silently."""
    if len(sizes) != 3 or x.device.type not in TRITON_SPLIT_DEVICES or _SPLIT_FAILED in process_state().said:
        return None
    split3 = _triton_split3()
    if split3 is None:
        return None
    try:
        return split3(x, sizes)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # compile and launch errors of a Triton that cannot build kernels here
        process_state().said.first(_SPLIT_FAILED)
        logger.warning(
            "fusepatch: the Gated DeltaNet's Triton q/k/v split failed here (%s: %s); the layers split with torch's "
            "split_with_sizes_copy from now on (one wait for the GPU a layer). Fix: install the Triton your torch "
            "was built with (pip install triton)",
            type(exc).__name__,
            exc,
        )
        return None


class _SplitCopy(torch.autograd.Function):
    """The last dimension split into contiguous tensors by one kernel: on CUDA fusepatch's Triton one for three
    parts (torch's CUDA fast path of ``split_with_sizes_copy`` copies its launch metadata to the GPU and waited
    for it there), torch's otherwise; the backward is one ``cat``, as ``torch.split``'s is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int]):
        split = _triton_split(x, sizes)
        if split is not None:
            return split
        parts = [x.new_empty(*x.shape[:-1], size) for size in sizes]
        torch.split_with_sizes_copy(x, sizes, dim=-1, out=parts)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        return torch.cat(grads, dim=-1), None


def split_channels(mixed: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """q, k and v out of the conv output. On the GPU as contiguous copies made in one kernel: the delta-rule
    kernels copy views to contiguous tensors anyway (fla's input guard), each view on its own with a strided
    elementwise kernel, where one split kernel writes all three. On the CPU, and under ``torch.compile`` (whose own kernels fuse the
    copies), views, as transformers splits."""
    if mixed.device.type in COPY_DEVICES and not torch.compiler.is_compiling():
        # contiguous first (a no-op for causal-conv1d's output): torch's fused kernel derives its chunk strides
        # from the sizes (aten/src/ATen/native/cuda/TensorShape.cu), so it is given a row-major input
        return _SplitCopy.apply(mixed.contiguous(), sizes)
    return torch.split(mixed, sizes, dim=-1)


def gated_deltanet_forward(
    self,
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    **kwargs,
):
    state = self._fusepatch
    cache = cache if cache is not None else cache_params
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    why = _transformers_forward_reason(self, cache, cu_seqlens)
    if why is not None:
        return _transformers_forward(self, why, hidden_states, cache, attention_mask, kwargs)

    if attention_mask is not None and attention_mask.ndim == 2:  # zero padded positions, as transformers does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)

    batch, length, _ = hidden_states.shape
    mixed_qkv, z, b, a = _projections(self, hidden_states)
    conv_inputs, previous = mixed_qkv, None
    if cache is not None:
        previous = linear_cache.previous_recurrent_state(cache, self.layer_idx)
        window = linear_cache.store_conv_window(cache, self.layer_idx, mixed_qkv, self.conv_kernel_size)
        if previous is not None:  # a continuation: the conv reads the cached inputs before this call's
            conv_inputs = window
        elif cu_seqlens is not None:  # packed: the kept inputs are those of each row's last document
            _keep_last_documents(linear_cache.conv_window(cache, self.layer_idx), cu_seqlens, batch, length)

    if cu_seqlens is not None and batch > 1:  # varlen kernels take one flattened row
        if cu_seqlens[-1] != batch * length:
            raise ValueError(
                f"cu_seq_lens_q ends at {int(cu_seqlens[-1])} but the batch holds {batch}x{length} tokens; "
                "packed batches must be flattened to one row (DataCollatorWithFlattening does this)"
            )
        conv_inputs, z, b, a = (t.reshape(1, batch * length, *t.shape[2:]) for t in (conv_inputs, z, b, a))

    ops = state.ops
    deepspeed.gather(self, self.conv1d.weight, self.conv1d.bias, self.norm.weight)  # modules not called (ZeRO-3)
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
    if weight.dtype != conv_inputs.dtype:  # autocast over fp32 weights: the conv runs in the activations' dtype
        weight, bias = weight.to(conv_inputs.dtype), None if bias is None else bias.to(conv_inputs.dtype)
    mixed_qkv = ops["causal_conv1d"](conv_inputs, weight, bias, activation="silu", cu_seqlens=cu_seqlens)
    if previous is not None:
        mixed_qkv = mixed_qkv[:, -length:]
    rows, tokens = mixed_qkv.shape[:2]
    query, key, value = split_channels(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim])
    query = query.reshape(rows, tokens, -1, self.head_k_dim)
    key = key.reshape(rows, tokens, -1, self.head_k_dim)
    value = value.reshape(rows, tokens, -1, self.head_v_dim)

    rule = ops["gated_delta_rule"]
    if cache is None:
        core = rule(query, key, value, a, b, self.A_log, self.dt_bias, cu_seqlens=cu_seqlens)
    else:
        core, final = rule(
            query,
            key,
            value,
            a,
            b,
            self.A_log,
            self.dt_bias,
            cu_seqlens=cu_seqlens,
            initial_state=previous,
            output_final_state=True,
        )
        if cu_seqlens is not None:  # each row's state is its last document's
            final = final.index_select(0, _last_documents(cu_seqlens, batch, length))
        linear_cache.store_recurrent_state(cache, self.layer_idx, final)
    core, z = core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)
    if may_bypass(self.norm, gathering=True) and same_family(self.norm, self):
        core = ops["gated_rms_norm"](core, z, self.norm.weight, self.norm.variance_epsilon)
    else:  # a hook, a forward set on it or another class: the module called, as transformers calls it
        core = self.norm(core, z)
    return apply_linear(self.out_proj, core.reshape(batch, length, -1))


def _last_documents(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """The index of each row's last document among the packed documents (one ends at every row end), computed on
    the device without a wait: a stable sort puts the row-ending documents first, in order."""
    ends = cu_seqlens[1:].long()
    row_end = torch.remainder(ends, length) == 0
    return torch.argsort((~row_end).to(torch.int8), stable=True)[:batch]


def _keep_last_documents(window: torch.Tensor, cu_seqlens: torch.Tensor, batch: int, length: int) -> None:
    """Zero the kept conv inputs (``[B, D, W]``, in place) that come before each row's last document: a continuation
    of that document must not see the one before it."""
    starts = cu_seqlens[:-1].long().index_select(0, _last_documents(cu_seqlens, batch, length))
    first = starts - torch.arange(batch, device=starts.device) * length  # where it starts within its row
    width = window.shape[-1]
    positions = torch.arange(length - width, length, device=window.device)
    window.mul_((positions[None, :] >= first.to(window.device)[:, None]).to(window.dtype)[:, None, :])
