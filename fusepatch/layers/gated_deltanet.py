"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next linear attention) for training and prefill.

The flow is transformers' (projections, conv + SiLU, gated delta rule, gated RMSNorm, out projection), with
three differences: every op goes through a per-call dispatcher (fused on GPU, eager elsewhere), q/k are not
copied for grouped value heads in the forward (the kernels take them natively; the default delta rule's backward
expands them once, ops/gated_delta_rule/saved_states.py), and packed documents are exact
(``cu_seqlens`` reaches the conv and the recurrence). With a cache (generation) the original forward runs.
"""

from __future__ import annotations

import functools
import logging

import torch

from fusepatch.layers.support.projections import apply_linear, project

logger = logging.getLogger("fusepatch")
_NOTED: set[str] = set()


def _use_original(self, cache) -> bool:
    """Whether this call runs transformers' forward: another activation, or a cache to fill.

    The fused path keeps no conv or recurrent state, so any call that was handed a cache runs transformers'
    cached path, which fills it exactly: a continuation from that cache (generation, or inference code that
    forgot ``torch.no_grad()``) is then transformers' own. A training forward that builds a cache it never reads
    pays for it; that is said once per layer class, with the fix."""
    if self.activation not in ("silu", "swish"):
        return True
    if cache is None:
        return False
    name = type(self).__name__
    if self.training and torch.is_grad_enabled() and name not in _NOTED:
        _NOTED.add(name)
        logger.warning(
            "fusepatch: %s: a training forward was given a cache (use_cache=True), so this layer runs transformers' "
            "cached path to fill it, not the fused one. Fix: pass use_cache=False (or set model.config.use_cache = "
            "False) when training",
            name,
        )
    return True


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
_SPLIT_FAILED = "triton-split"  # in _NOTED once the Triton split failed here: torch's op from then on


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
    if len(sizes) != 3 or x.device.type not in TRITON_SPLIT_DEVICES or _SPLIT_FAILED in _NOTED:
        return None
    split3 = _triton_split3()
    if split3 is None:
        return None
    try:
        return split3(x, sizes)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # compile and launch errors of a Triton that cannot build kernels here
        _NOTED.add(_SPLIT_FAILED)
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
    elementwise kernel: 1.2 ms of the 27B step and 3.4 ms of the 2B-like one on the H200 (GPU time by op,
    the H200 run of 2026-11-30). On the CPU, and under ``torch.compile`` (whose own kernels fuse the
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
    if _use_original(self, cache):
        # Generation keeps transformers' own cached path (conv/recurrent state updates). The cache goes in
        # positionally: it is `cache_params` up to transformers 5.2x and `cache` after.
        return state.original(hidden_states, cache, attention_mask=attention_mask, **kwargs)

    if attention_mask is not None and attention_mask.ndim == 2:  # zero padded positions, as transformers does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    batch, length, _ = hidden_states.shape
    mixed_qkv, z, b, a = _projections(self, hidden_states)

    if cu_seqlens is not None and batch > 1:  # varlen kernels take one flattened row
        if cu_seqlens[-1] != batch * length:
            raise ValueError(
                f"cu_seq_lens_q ends at {int(cu_seqlens[-1])} but the batch holds {batch}x{length} tokens; "
                "packed batches must be flattened to one row (DataCollatorWithFlattening does this)"
            )
        mixed_qkv, z, b, a = (t.reshape(1, batch * length, *t.shape[2:]) for t in (mixed_qkv, z, b, a))

    ops = state.ops
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
    if weight.dtype != mixed_qkv.dtype:  # autocast over fp32 weights: the conv runs in the activations' dtype
        weight, bias = weight.to(mixed_qkv.dtype), None if bias is None else bias.to(mixed_qkv.dtype)
    mixed_qkv = ops["causal_conv1d"](mixed_qkv, weight, bias, activation="silu", cu_seqlens=cu_seqlens)
    rows, tokens = mixed_qkv.shape[:2]
    query, key, value = split_channels(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim])
    query = query.reshape(rows, tokens, -1, self.head_k_dim)
    key = key.reshape(rows, tokens, -1, self.head_k_dim)
    value = value.reshape(rows, tokens, -1, self.head_v_dim)

    core = ops["gated_delta_rule"](query, key, value, a, b, self.A_log, self.dt_bias, cu_seqlens=cu_seqlens)
    core = ops["gated_rms_norm"](
        core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight, self.norm.variance_epsilon
    )
    return apply_linear(self.out_proj, core.reshape(batch, length, -1))
