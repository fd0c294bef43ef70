"""Packed rows (padding-free SFT): a patched model gives each document exactly what it gets alone."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from helpers import ONE_OF_EACH

import fusepatch
from fusepatch.layers.support import packing
from fusepatch.layers.support.packing import (
    PackedSequenceError,
    attention_crosses_documents,
    cu_seqlens_from_position_ids,
)
from fusepatch.ops import boundaries
from fusepatch.tools.tiny import tiny_model

LENGTHS = [23, 1, 40, 17]


def _packed_batch(vocab):
    docs = [torch.randint(0, vocab, (n,)) for n in LENGTHS]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return docs, ids, position_ids


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5, 9]
    assert cu_seqlens_from_position_ids(torch.arange(6)[None].expand(2, 6)) is None  # ordinary batch
    two_rows = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(two_rows).tolist() == [0, 2, 4, 8]
    assert cu_seqlens_from_position_ids(None) is None


def test_boundaries_keep_their_host_values_for_the_chunk_table():
    """The boundaries carry their values as host integers (read in their one wait), and the Gated DeltaNet's
    fla path builds fla's chunk table from them: document and chunk within it, 64 tokens a chunk, a partial
    chunk at every document's end (what fla's ``prepare_chunk_indices`` builds, checked against it on the GPU)."""
    from fusepatch.ops.gated_delta_rule.fla import chunk_table

    lengths = [1, 64, 65, 130, 7]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = cu_seqlens_from_position_ids(pos)
    assert boundaries.host_values(cu) == (0, 1, 65, 130, 260, 267) == tuple(cu.tolist())
    expected = [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2], [4, 0]]
    table = chunk_table(cu)
    assert table.dtype == cu.dtype and table.tolist() == expected
    assert chunk_table(cu) is table  # once per boundaries tensor: the recompute and backward reuse it
    assert chunk_table(cu, 32).tolist()[:5] == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1]]
    # boundaries from elsewhere (a caller's cu_seq_lens_q, a copy): no host values, fla builds its own table
    assert boundaries.host_values(cu.clone()) is None and chunk_table(cu.clone()) is None


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("marker", ["position_ids", "cu_seq_lens"])
def test_packed_row_equals_documents_alone(model_type, marker):
    model = tiny_model(model_type)
    fusepatch.apply(model)
    docs, ids, position_ids = _packed_batch(model.config.vocab_size)
    kwargs = {"position_ids": position_ids, "use_cache": False}
    if marker == "cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    packed = model(input_ids=ids, **kwargs).logits[0]
    start = 0
    for doc in docs:
        alone = model(input_ids=doc[None]).logits[0]
        torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=1e-4, atol=1e-5)
        start += len(doc)


def test_packed_gradients_equal_documents_alone():
    model = tiny_model("qwen3_5_text")
    fusepatch.apply(model)
    docs, ids, position_ids = _packed_batch(model.config.vocab_size)
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100  # no document predicts across a boundary
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0
    for doc in docs:
        logits = model(input_ids=doc[None]).logits
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1], doc[1:], reduction="sum")
    total.backward()
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-4)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_unpatched_transformers_leaks_across_documents():
    """Why the patch matters: transformers' reference path ignores the boundaries in linear attention."""
    model = tiny_model("qwen3_5_text")
    docs, ids, position_ids = _packed_batch(model.config.vocab_size)
    packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[0]
    alone = model(input_ids=docs[2][None]).logits[0]
    start = LENGTHS[0] + LENGTHS[1]
    assert not torch.allclose(packed[start : start + LENGTHS[2]], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ONE_OF_EACH)
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("attention_mask", [False, True])
def test_packed_batch_whose_attention_would_leak_is_refused(model_type, attn_implementation, attention_mask):
    """With a cache (use_cache at its default, True) or an explicit 2D mask transformers builds a plain causal
    mask for full attention: fusepatch refuses rather than let documents see each other, in the hybrid families
    and in Qwen2/Qwen3 alike (those leaked with no word)."""
    model = tiny_model(model_type, attn_implementation=attn_implementation)
    fusepatch.apply(model)
    _, ids, position_ids = _packed_batch(model.config.vocab_size)
    kwargs = {"attention_mask": torch.ones_like(ids), "use_cache": False} if attention_mask else {}
    with pytest.raises(PackedSequenceError, match="use_cache=False and no attention_mask"):
        model(input_ids=ids, position_ids=position_ids, **kwargs)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_moe"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_rows_of_plain_families_equal_each_document_alone(model_type, attn_implementation):
    """What the refusal points to (use_cache=False, no mask) is exact: each document as if alone."""
    model = tiny_model(model_type, attn_implementation=attn_implementation)
    fusepatch.apply(model)
    docs, ids, position_ids = _packed_batch(model.config.vocab_size)
    packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[0]
    start = 0
    for doc in docs:
        alone = model(input_ids=doc[None], use_cache=False).logits[0]
        torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=1e-4, atol=1e-5)
        start += len(doc)


@pytest.mark.parametrize("packed", [False, True])
def test_boundaries_are_found_once_per_forward(monkeypatch, packed):
    """Finding the boundaries and probing the mask wait for the GPU: once per forward, not once per layer (the
    2B benchmark's 24 layers made 24 such waits a forward)."""
    calls = {"boundaries": 0, "mask": 0}
    real_boundaries, real_mask = packing.cu_seqlens_from_position_ids, packing._plan

    def counted_boundaries(*args):
        calls["boundaries"] += 1
        return real_boundaries(*args)

    def counted_mask(*args):
        calls["mask"] += 1
        return real_mask(*args)

    monkeypatch.setattr(packing, "cu_seqlens_from_position_ids", counted_boundaries)
    monkeypatch.setattr(packing, "_plan", counted_mask)
    model = tiny_model("qwen3_5_text", num_hidden_layers=8, layer_types=["linear_attention", "full_attention"] * 4)
    fusepatch.apply(model)
    _, ids, position_ids = _packed_batch(model.config.vocab_size)
    if not packed:
        position_ids = torch.arange(ids.shape[1])[None]
    for step in range(2):  # a new batch: a new tensor, found again
        model(input_ids=ids, position_ids=position_ids.clone(), use_cache=False)
        assert calls["boundaries"] == step + 1, calls
        assert calls["mask"] == (step + 1 if packed else 0), calls
    position_ids = position_ids.clone()
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    position_ids.add_(0)  # changed in place (version counter): found again
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    assert calls["boundaries"] == 4, calls


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_probe_matches_a_boundary_by_boundary_check(batch, kind):
    """The mask is probed at every boundary at once: the same verdict as looking at each boundary alone."""
    generator = torch.Generator().manual_seed(batch)
    length = 12
    for _ in range(20):
        allowed = torch.rand(batch, 1, length, length, generator=generator) < 0.15
        mask = allowed if kind == "bool" else torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        cuts = sorted(set(torch.randint(1, batch * length, (4,), generator=generator).tolist()))
        cu = torch.tensor([0, *cuts, batch * length], dtype=torch.int32)
        expected = False
        for start in cuts:
            if start // length == (start - 1) // length and bool(
                allowed[start // length if batch > 1 else 0, 0, start % length, (start - 1) % length]
            ):
                expected = True
        assert attention_crosses_documents(mask, cu, "sdpa") == expected


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_packed_batch_under_activation_checkpointing(model_type):
    """The recompute in the backward pass must see the same document boundaries as the forward pass (transformers
    >= 5.2x checkpoints the layer's original forward, below fusepatch's wrapper)."""
    plain = tiny_model(model_type)
    checkpointed = tiny_model(model_type)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for model in (plain, checkpointed):
        fusepatch.apply(model)
        model.train()
    _, ids, position_ids = _packed_batch(plain.config.vocab_size)
    results = []
    for model in (plain, checkpointed):
        loss = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_first_packed_self_test_inside_a_checkpointed_forward(monkeypatch):
    """A packed-call self-test runs at the first packed batch, i.e. inside the checkpointed layer's forward. Its
    own backward must not make the checkpoint recompute the layer from inside that forward (on the H200 this
    deadlocked the first FSDP2 + activation-checkpointing step). A CPU stand-in candidate makes the self-test run
    here; the step runs in a thread so that a deadlock fails the test instead of hanging the suite."""
    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op = OPS["causal_conv1d"]
    standin = Candidate(
        name="cpu-standin", source="pip", requirements=(), load=lambda: op.reference, inputs=InputRule(devices=("cpu",))
    )
    monkeypatch.setitem(OPS, "causal_conv1d", dataclasses.replace(op, candidates=(standin,)))
    selftest.clear_cache()
    plain, checkpointed = tiny_model("qwen3_5_text"), tiny_model("qwen3_5_text")
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, ids, position_ids = _packed_batch(plain.config.vocab_size)
    results: dict = {}

    def step(model, name):
        report = fusepatch.apply(model.train())
        loss = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        results[name] = (report, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})

    for model, name in ((checkpointed, "checkpointed"), (plain, "plain")):
        selftest.clear_cache()  # each model's first packed call self-tests inside its forward
        worker = threading.Thread(target=step, args=(model, name), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), f"{name}: the first packed step did not finish (deadlock in the self-test?)"
        assert name in results, f"{name}: the step raised (see the thread's traceback above)"
    conv = next(layer for layer in results["checkpointed"][0].layers if layer.layer == "Qwen3_5GatedDeltaNet")
    dispatch = checkpointed.model.layers[0].linear_attn._fusepatch.ops["causal_conv1d"]
    assert {(c.dtype, c.chosen) for c in dispatch.seen()} >= {("float32", "cpu-standin")}, conv
    _, loss_a, grads_a = results["plain"]
    _, loss_b, grads_b = results["checkpointed"]
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_transformers(side):
    """With an attention_mask, padded positions are zeroed before the linear-attention layers, as in
    transformers, and the real tokens' outputs do not change."""
    reference = tiny_model("qwen3_5_text")
    model = tiny_model("qwen3_5_text")
    fusepatch.apply(model)
    ids = torch.randint(0, 512, (2, 30))
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :7] = 0
    else:
        mask[0, -7:] = 0
    expected = reference(input_ids=ids, attention_mask=mask).logits
    got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-5)


def test_boundaries_are_found_once_per_position_ids_across_threads(monkeypatch):
    """An activation-checkpoint recompute runs the layers again in the autograd engine's thread with the
    forward's own position_ids: the boundaries (a wait for the GPU on CUDA) are not computed again there. A
    changed or different tensor is computed afresh."""
    calls = []
    real = packing.cu_seqlens_from_position_ids
    monkeypatch.setattr(packing, "cu_seqlens_from_position_ids", lambda *a: calls.append(1) or real(*a))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    first = packing.boundaries_for_call(positions)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(packing.boundaries_for_call(positions)))
    thread.start()
    thread.join()
    assert seen[0] is first and len(calls) == 1
    assert first.tolist() == [0, 3, 5, 8]
    other = positions.clone()
    assert packing.boundaries_for_call(other).tolist() == [0, 3, 5, 8] and len(calls) == 2
    positions[0, 3] = 3  # changed in place: its version moved on
    assert packing.boundaries_for_call(positions).tolist() == [0, 5, 8] and len(calls) == 3


def test_a_collators_seq_idx_changes_nothing():
    """``DataCollatorWithFlattening(return_seq_idx=True)`` adds each token's document number (``seq_idx``), the
    argument the causal-conv1d package takes to keep packed documents apart. fusepatch takes the boundaries from
    the positions and ``cu_seq_lens``: the extra argument reaches every layer and changes neither the loss nor a
    gradient."""
    from helpers import grads
    from transformers import DataCollatorWithFlattening

    model = tiny_model("qwen3_5_text").train()
    fusepatch.apply(model, verbose=False)
    features = [{"input_ids": torch.randint(0, 512, (n,)).tolist()} for n in (11, 17, 6)]
    results = []
    for flags in ({}, {"return_seq_idx": True}):
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, **flags)(features)
        assert ("seq_idx" in batch) == bool(flags)
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), grads(model)))
    (loss, got), (with_idx, got_idx) = results
    torch.testing.assert_close(with_idx, loss, rtol=0, atol=0)
    for name, grad in got.items():
        torch.testing.assert_close(got_idx[name], grad, rtol=0, atol=0, msg=name)
