"""Packed rows under sdpa go to a varlen attention kernel over the document boundaries, and only when the mask
transformers built is exactly what that kernel computes. The GPU run (tests/gpu/test_other_ops.py) checks
torch's FlashAttention candidate itself; here a CPU stand-in candidate shows the routing and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fusepatch
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.layers.support import packing
from fusepatch.layers.support.packing import mask_plan
from fusepatch.ops import OPS, boundaries
from fusepatch.ops.varlen_attention import torch_varlen_adapter
from fusepatch.ops.varlen_attention.reference import varlen_attention_reference
from fusepatch.tools.tiny import tiny_model
from tests.helpers import grads

LENGTHS = [23, 1, 40, 17]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _per_document(q, k, v, lengths, scale):
    """Each document alone through sdpa's own causal path: the definition the varlen op must meet."""
    groups = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


def test_reference_is_causal_attention_within_each_document():
    q, k, v = (torch.randn(sum(LENGTHS), h, 16, dtype=torch.float64) for h in (4, 2, 2))
    expected = _per_document(q, k, v, LENGTHS, 0.3)
    torch.testing.assert_close(varlen_attention_reference(q, k, v, _cu(LENGTHS), max(LENGTHS), 0.3), expected)


def _fake_varlen(signature: str, calls: list):
    """torch's varlen_attn as three releases spelled it, computing with the reference (scale default,
    equal head counts unless told)."""

    def compute(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, gqa=False):
        assert torch.equal(cu_q, cu_k) and max_q == max_k
        if q.shape[1] != k.shape[1] and not gqa:
            raise ValueError("Expect query and key/value to have the same number of heads")
        return varlen_attention_reference(q, k, v, cu_q, max_q, scale)

    if signature == "is_causal":

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
            calls.append({"is_causal": is_causal})
            assert is_causal
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)

    elif signature == "is_causal+scale":

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
            calls.append({"is_causal": is_causal, "scale": scale})
            assert is_causal
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)

    else:

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
        ):
            calls.append({"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa})
            assert tuple(window_size) == (-1, 0)
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa)

    return varlen_attn


@pytest.mark.parametrize("signature", ["is_causal", "is_causal+scale", "window_size+gqa"])
def test_adapter_computes_the_op_on_every_torch_signature(signature):
    calls: list = []
    fn = torch_varlen_adapter(_fake_varlen(signature, calls))
    q, k, v = (torch.randn(sum(LENGTHS), h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = fn(q, k, v, _cu(LENGTHS), max(LENGTHS), 0.7)
    expected = _per_document(q, k, v, LENGTHS, 0.7)
    torch.testing.assert_close(out, expected)
    # the k/v heads repeated for a torch without enable_gqa: their gradients sum each group back
    cotangent = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), cotangent), torch.autograd.grad(expected, (q, k, v), cotangent)
    ):
        torch.testing.assert_close(got, want)
    assert len(calls) == 1
    if signature == "window_size+gqa":
        assert calls[0]["enable_gqa"] and calls[0]["scale"] == 0.7


def test_adapter_refuses_a_signature_without_causality():
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("never called")

    with pytest.raises(ImportError, match="neither window_size nor is_causal.*torch>=2.10"):
        torch_varlen_adapter(varlen_attn)


def _block_causal(lengths, rows: int = 1) -> torch.Tensor:
    total = sum(lengths)
    docs = boundaries.document_ids(_cu(lengths), total).view(rows, total // rows)
    pos = torch.arange(total // rows)
    return ((docs[:, :, None] == docs[:, None, :]) & (pos[None, None, :] <= pos[None, :, None]))[:, None]


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_plan_accepts_only_the_exact_block_causal_mask(kind):
    def as_kind(mask):
        return mask if kind == "bool" else torch.where(mask, 0.0, torch.finfo(torch.float32).min)

    lengths = [5, 1, 9, 7, 2, 8]  # two rows of 16: a document boundary at the row start too
    cu = _cu(lengths)
    exact = _block_causal(lengths, rows=2)
    plan = mask_plan(as_kind(exact), cu)
    assert plan.block_causal and not plan.crosses and plan.longest == 9
    padded = exact.clone()
    padded[1, 0, :, 14:] = False  # two padding positions at the end of the second row
    assert not mask_plan(as_kind(padded), cu).block_causal
    windowed = exact & (torch.arange(16)[None, :] > torch.arange(16)[:, None] - 4)  # a sliding window
    assert not mask_plan(as_kind(windowed), cu).block_causal
    leaking = exact.clone()
    leaking[0, 0, 5, 4] = True  # the second document's first token sees the first document
    plan = mask_plan(as_kind(leaking), cu)
    assert plan.crosses and not plan.block_causal
    assert not mask_plan(as_kind(exact), _cu([5, 1, 9, 7, 2, 6])).block_causal  # boundaries of other rows
    assert mask_plan(None, cu) is None


def test_mask_plan_compares_in_chunks(monkeypatch):
    monkeypatch.setattr(packing, "_QUERY_ROWS", 40)  # two query rows at a time over a 20-token row
    exact = _block_causal([7, 13])
    assert mask_plan(exact, _cu([7, 13])).block_causal
    late = exact.clone()
    late[0, 0, 19, 3] = True  # in the last chunk
    assert not mask_plan(late, _cu([7, 13])).block_causal


@pytest.fixture
def cpu_candidate(monkeypatch):
    """A CPU varlen candidate (the reference, counted) put first, as a GPU build gets torch's kernel."""
    calls: list[tuple] = []

    def load():
        def varlen(q, k, v, cu_seqlens, max_seqlen, scale=None):
            calls.append((tuple(q.shape), cu_seqlens.tolist(), max_seqlen, q.dtype))
            return varlen_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale)

        return varlen

    candidate = Candidate(
        "cpu-reference", "pip", (), load, InputRule(devices=("cpu",), dtypes=("float32", "bfloat16")), provides="test"
    )
    op = OPS["varlen_attention"]
    monkeypatch.setitem(OPS, "varlen_attention", dataclasses.replace(op, candidates=(candidate, *op.candidates)))
    return calls


def _routed(calls: list[tuple]) -> list[tuple]:
    """The candidate's calls from the model (the self-test's inputs have other boundaries)."""
    return [call for call in calls if call[1] == _cu(LENGTHS).tolist()]


def _packed(vocab, lengths=LENGTHS):
    ids = torch.randint(0, vocab, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, position_ids


def _loss(model, ids, position_ids, **kwargs):
    labels = ids.clone()
    labels[0, _cu(LENGTHS)[:-1].long()] = -100  # no document predicts across a boundary
    return model(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False, **kwargs)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_packed_sdpa_model_routes_to_varlen_and_matches_transformers(cpu_candidate, model_type):
    model = tiny_model(model_type, attn_implementation="sdpa")
    ids, position_ids = _packed(model.config.vocab_size)
    fusepatch.apply(model, exclude=["varlen_attention"])  # transformers' masked sdpa (and packed linear attention)
    expected = _loss(model, ids, position_ids)
    expected.loss.backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)
    assert _routed(cpu_candidate) == []
    fusepatch.revert(model)

    report = fusepatch.apply(model)
    assert ("varlen_attention", "cpu-reference") in {(c.op, c.chosen) for layer in report.layers for c in layer.choices}
    out = _loss(model, ids, position_ids)
    out.loss.backward()
    full_attention = sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
    assert _routed(cpu_candidate) == [((81, 4, 32), _cu(LENGTHS).tolist(), 40, torch.float32)] * full_attention
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-3, atol=1e-6, msg=name)


def test_routing_survives_gradient_checkpointing(cpu_candidate):
    model = tiny_model("qwen3_5_text", attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, position_ids = _packed(model.config.vocab_size)
    fusepatch.apply(model, exclude=["varlen_attention"])
    expected = _loss(model, ids, position_ids)
    expected.loss.backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)
    fusepatch.revert(model)
    fusepatch.apply(model)
    out = _loss(model, ids, position_ids)
    out.loss.backward()
    assert len(_routed(cpu_candidate)) == 2  # the forward and the checkpoint's recompute
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-3, atol=1e-6, msg=name)


def test_unpacked_and_eager_calls_are_not_routed(cpu_candidate):
    sdpa = tiny_model("qwen3", attn_implementation="sdpa")
    eager = tiny_model("qwen3")
    for model in (sdpa, eager):
        fusepatch.apply(model)
    ids, position_ids = _packed(sdpa.config.vocab_size)
    sdpa(input_ids=ids, use_cache=False)  # one document per row
    eager(input_ids=ids, position_ids=position_ids, use_cache=False)  # eager attention stays eager
    assert _routed(cpu_candidate) == []


def test_padded_packed_batch_is_refused_with_the_fix(cpu_candidate):
    """Packed rows with a padding mask: transformers builds a mask over the whole row (documents see each other);
    patched, the call is refused with the fix, as for the hybrid models, never trained on silently."""
    model = tiny_model("qwen3", attn_implementation="sdpa")
    ids, position_ids = _packed(model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # padding at the end of the row
    fusepatch.apply(model)
    with pytest.raises(packing.PackedSequenceError, match="DataCollatorWithFlattening"):
        model(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
    assert _routed(cpu_candidate) == []


def test_binding_is_undone_by_revert(cpu_candidate):
    import transformers.models.qwen3.modeling_qwen3 as modeling
    from helpers import assert_released, transformers_own

    original = transformers_own(modeling, "ALL_ATTENTION_FUNCTIONS")
    model = tiny_model("qwen3", attn_implementation="sdpa")
    fusepatch.apply(model)
    ids, position_ids = _packed(model.config.vocab_size)
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    fusepatch.revert(model)
    assert_released(modeling, "ALL_ATTENTION_FUNCTIONS", original)


def test_excluded_op_is_not_routed_and_plans_once_a_call(cpu_candidate, monkeypatch):
    """With varlen_attention excluded, a packed call stays on transformers' block mask (exact); the boundaries are
    read once a call, for the check that the mask does not cross documents."""
    plans = []
    real = packing._plan
    monkeypatch.setattr(packing, "_plan", lambda *a: plans.append(1) or real(*a))
    model = tiny_model("qwen3", attn_implementation="sdpa")
    fusepatch.apply(model, exclude=["varlen_attention"])
    ids, position_ids = _packed(model.config.vocab_size)
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    assert len(plans) == 1 and _routed(cpu_candidate) == []


def test_packed_batch_with_a_2d_mask_is_refused(cpu_candidate):
    """A 2D all-ones mask with packed position_ids makes transformers build a causal mask over the whole row
    (documents see each other): refused with the fix rather than trained on."""
    model = tiny_model("qwen3", attn_implementation="sdpa")
    fusepatch.apply(model)
    ids, position_ids = _packed(model.config.vocab_size)
    with pytest.raises(packing.PackedSequenceError, match="attend across"):
        model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert _routed(cpu_candidate) == []


def test_fp32_model_under_autocast_routes_in_autocast_dtype(cpu_candidate):
    """The Trainer's bf16=True over fp32 weights: q/k/v may reach attention in fp32 (the q/k norms' fp32
    weights), and sdpa would compute in bf16 under autocast; the varlen kernel is asked for bf16 the same way."""
    model = tiny_model("qwen3", attn_implementation="sdpa")
    ids, position_ids = _packed(model.config.vocab_size)
    fusepatch.apply(model, exclude=["varlen_attention"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss(model, ids, position_ids)
    fusepatch.revert(model)
    fusepatch.apply(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _loss(model, ids, position_ids)
    routed = _routed(cpu_candidate)
    assert routed and all(call[0] == (81, 4, 32) and call[3] == torch.bfloat16 for call in routed)
    assert model.model.layers[0].self_attn._fusepatch.ops["varlen_attention"].choice("cpu", "bfloat16", True).fused
    torch.testing.assert_close(out.loss, expected.loss, rtol=2e-2, atol=2e-2)
