"""Eager references against simpler ground truths, on fresh random inputs (no seed reuse between tests)."""

from __future__ import annotations

import pytest
import torch

from fusepatch.ops.causal_conv1d import causal_conv1d_reference
from fusepatch.ops.common import relative_error
from fusepatch.ops.gated_delta_rule.reference import gated_delta_rule_recurrent, gated_delta_rule_reference
from fusepatch.ops.rms_norm.reference import (
    gated_rms_norm_reference,
    rms_norm_reference,
    rms_norm_zero_centered_reference,
)


def _gdn_inputs(batch, length, hk, hv, dk, dv, dtype=torch.float64):
    q = torch.randn(batch, length, hk, dk, dtype=dtype)
    k = torch.randn(batch, length, hk, dk, dtype=dtype)
    v = torch.randn(batch, length, hv, dv, dtype=dtype)
    a = torch.randn(batch, length, hv, dtype=dtype)
    b = torch.randn(batch, length, hv, dtype=dtype)
    A_log = torch.empty(hv, dtype=dtype).uniform_(0.01, 16).log()
    dt_bias = torch.randn(hv, dtype=dtype)
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("hk, hv", [(2, 2), (2, 4), (1, 3)])
def test_chunked_delta_rule_matches_the_token_recurrence(length, hk, hv):
    inputs = _gdn_inputs(2, length, hk, hv, 16, 8)
    chunked = gated_delta_rule_reference(*inputs).double()
    recurrent = gated_delta_rule_recurrent(*inputs)
    assert chunked.shape == (2, length, hv, 8)
    # fp32 inside the chunked path: fp32-level agreement with the fp64 recurrence
    assert relative_error(chunked, recurrent) < 1e-5


def test_packed_delta_rule_restarts_the_state_at_every_document():
    inputs = _gdn_inputs(1, 150, 2, 4, 16, 16)
    cu = torch.tensor([0, 40, 41, 110, 150])
    packed = gated_delta_rule_reference(*inputs, cu_seqlens=cu)
    assert relative_error(packed.double(), gated_delta_rule_recurrent(*inputs, cu_seqlens=cu)) < 1e-5
    q, k, v, a, b, A_log, dt_bias = inputs
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = gated_delta_rule_reference(q[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e], A_log, dt_bias)
        torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-6, atol=1e-7)
    leaky = gated_delta_rule_reference(*inputs)
    assert relative_error(leaky[:, 40:], packed[:, 40:]) > 1e-3  # proves the boundary matters


def test_delta_rule_gradients_match_the_recurrence():
    inputs = [t.clone().requires_grad_(True) for t in _gdn_inputs(1, 70, 1, 2, 8, 8)]
    cu = torch.tensor([0, 33, 70])
    cot = torch.randn(1, 70, 2, 8, dtype=torch.float64)
    g1 = torch.autograd.grad((gated_delta_rule_reference(*inputs, cu_seqlens=cu).double() * cot).sum(), inputs)
    g2 = torch.autograd.grad((gated_delta_rule_recurrent(*inputs, cu_seqlens=cu) * cot).sum(), inputs)
    for x, y in zip(g1, g2):
        assert relative_error(x, y) < 1e-3  # fp32 inside the chunked path; a wrong gradient is O(1) off


@pytest.mark.parametrize("width", [2, 4])
def test_packed_conv_equals_each_document_alone(width):
    x = torch.randn(1, 57, 12, dtype=torch.float64)
    w = torch.randn(12, width, dtype=torch.float64)
    bias = torch.randn(12, dtype=torch.float64)
    cu = torch.tensor([0, 1, 20, 57], dtype=torch.int32)
    packed = causal_conv1d_reference(x, w, bias, "silu", cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(packed[:, s:e], causal_conv1d_reference(x[:, s:e], w, bias, "silu"))


def test_conv_matches_transformers_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    fn = getattr(m.causal_conv1d_fn, "__wrapped__", m.causal_conv1d_fn)
    x = torch.randn(2, 30, 16)
    w = torch.randn(16, 4)
    expected = fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert torch.equal(causal_conv1d_reference(x, w, None, "silu"), expected)


def test_conv_rejects_batched_packing():
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d_reference(torch.randn(2, 5, 4), torch.randn(4, 4), None, "silu", torch.tensor([0, 2, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_references_equal_transformers_modules(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    x = torch.randn(3, 7, 32, dtype=dtype)
    z = torch.randn(3, 7, 32, dtype=dtype)
    plain, centered, gated = Qwen3RMSNorm(32), Qwen3_5RMSNorm(32), Qwen3_5RMSNormGated(32)
    for module in (plain, centered, gated):
        module.weight.data.normal_()
        module.to(dtype)
    assert torch.equal(rms_norm_reference(x, plain.weight, 1e-6), plain(x))
    assert torch.equal(rms_norm_zero_centered_reference(x, centered.weight, 1e-6), centered(x))
    assert torch.equal(gated_rms_norm_reference(x, z, gated.weight, 1e-6), gated(x, z))


def test_delta_rule_reference_trains_under_aot_autograd():
    """The gate's gradient reaches its projection through AOTAutograd as it does eagerly: torch's decomposition of
    ``softplus_backward`` (what the trace's fake tensors follow) lays its result out as the softplus input, the
    kernel that runs under ``backend="aot_eager"`` as the incoming gradient, which the reference's transpose made
    non-contiguous, and the projection's backward then failed to ``view`` it."""
    q, k, v, a, b, A_log, dt_bias = (t.float() for t in _gdn_inputs(2, 16, 2, 4, 8, 8))
    hidden = torch.randn(2, 16, 6)
    weight = torch.randn(4, 6, requires_grad=True)
    params = (weight, A_log.requires_grad_(True), dt_bias.requires_grad_(True))

    def loss(weight, A_log, dt_bias):
        a = torch.nn.functional.linear(hidden, weight)  # the layer's in_proj_a: its backward views the gradient
        return gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias).square().sum()

    expected = torch.autograd.grad(loss(*params), params)
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*params), params)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
