"""Whole hybrid models on a real GPU: a patched mini model of each Gated DeltaNet family against its fp32 eager
reference (bounds in conftest.py), packed rows, a training curve, generation and padding.

Per family and per gated-delta-rule candidate: the fused model in fp32 must match the fp32 eager reference
(the wiring and every kernel that takes fp32; fla's delta rule refuses fp32 and runs eager there); in bf16 it
must be no further from that reference than FACTOR x the bf16 eager model. The eager delta rule runs its
recurrence in fp32 even for bf16 inputs, so for the two decay parameters (A_log, dt_bias), whose gradients are
sums over every token of the decay gradient, with heavy cancellation, the bf16 kernel's rounding is amplified
(measured on the H200: 5-16% where the eager path has 0.2-2%): their bound at bf16 is at least DECAY_TOL. Where
a layer's decay gradient cancels to nearly zero, every bf16 path is far off in relative terms (measured: the
bf16 eager model 629% off in one qwen3_5_moe layer, fla 1694%) and the FACTOR rule is the one that applies.
The op tests (test_gdn_ops.py) hold dA_log and ddt_bias against an fp64 reference at bf16.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import MINI, compare_models, eager, forward_syncs, loss_curves, model_failures, record, require
from helpers import HYBRID

import fusepatch
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.ops.common import relative_error
from fusepatch.tools.tiny import tiny_model

pytestmark = pytest.mark.gpu

CANDIDATE_CASES = [
    ("qwen3_5_text", "fla-saved-states"),
    ("qwen3_5_text", "fla-saved-states-grouped"),
    ("qwen3_5_text", "fla"),
    ("qwen3_5_text", "fla-gate-outside"),
    ("qwen3_5_moe_text", "fla-saved-states"),
    ("qwen3_5_moe_text", "fla-saved-states-grouped"),
    ("qwen3_next", "fla-saved-states"),
    ("qwen3_next", "fla-saved-states-grouped"),
    ("qwen3_next", "fla"),
]


@pytest.fixture
def delta_rule_first(request, monkeypatch):
    """Put one gated-delta-rule candidate first, so each is tested inside the model."""
    op = OPS["gated_delta_rule"]
    first = [c for c in op.candidates if c.name == request.param]
    rest = [c for c in op.candidates if c.name != request.param]
    monkeypatch.setitem(OPS, "gated_delta_rule", dataclasses.replace(op, candidates=tuple(first + rest)))
    return request.param


@pytest.mark.parametrize("model_type, delta_rule_first", CANDIDATE_CASES, indirect=["delta_rule_first"])
def test_mini_model_logits_loss_and_every_gradient(model_type, delta_rule_first):
    errors, kernels32, kernels16 = compare_models(model_type)
    record(f"{model_type}/{delta_rule_first}", {"kernels_fp32": kernels32, "kernels_bf16": kernels16, "errors": errors})
    require(type("V", (), {"ok": kernels16["gated_delta_rule"] != "eager", "reason": "fla not chosen"})(), model_type)
    assert kernels16["gated_delta_rule"] == delta_rule_first, kernels16
    failures = model_failures(errors)
    assert not failures, f"kernels fp32 {kernels32} bf16 {kernels16}; errors against fp32 eager: {failures}"


@pytest.mark.parametrize("model_type", HYBRID)
def test_packed_row_equals_documents_alone_on_gpu(model_type):
    model = tiny_model(model_type, **MINI).cuda().to(torch.bfloat16)
    report = fusepatch.apply(model)
    assert any(c.fused for layer in report.layers for c in layer.choices) or pytest.skip("nothing fused here")
    lengths = [100, 1, 257, 64, 91]
    docs = [torch.randint(0, model.config.vocab_size, (n,), device="cuda") for n in lengths]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[0].float()
    start = 0
    for doc in docs:
        alone = model(input_ids=doc[None], use_cache=False).logits[0].float()
        assert relative_error(packed[start : start + len(doc)], alone) < 2e-2
        start += len(doc)


def test_thirty_training_steps_track_the_eager_loss_curve():
    eager_curve, fused_curve = loss_curves("qwen3_5_text")
    assert eager_curve[-1] < eager_curve[0] - 0.5  # it learns (tokens drawn from a 64-token subset)
    gaps = [abs(a - b) / a for a, b in zip(eager_curve, fused_curve)]
    assert max(gaps) < 0.03, list(zip(eager_curve, fused_curve))


def test_generation_with_cache_matches_the_unpatched_model():
    model = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 50), device="cuda")
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    fusepatch.apply(model)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_fused_matches_eager(side):
    base = tiny_model("qwen3_5_text", **MINI)
    reference = eager(copy.deepcopy(base).cuda().to(torch.bfloat16))
    fused = copy.deepcopy(base).cuda().to(torch.bfloat16)
    fusepatch.apply(fused)
    ids = torch.randint(0, base.config.vocab_size, (2, 200), device="cuda")
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :37] = 0
    else:
        mask[0, -37:] = 0
    real = mask.bool()
    a = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits[real].float()
    b = fused(input_ids=ids, attention_mask=mask, use_cache=False).logits[real].float()
    assert relative_error(b, a) < 2e-2


def test_activation_checkpointing_gives_the_same_gradients_on_gpu():
    """The fused kernels under transformers' activation checkpointing (non-reentrant): the recompute must see
    the same packed boundaries and give the same loss and gradients as the run that keeps activations."""
    base = tiny_model("qwen3_5_text", **MINI)
    lengths = [120, 64, 1, 200]
    ids = torch.randint(0, base.config.vocab_size, (1, sum(lengths)), device="cuda")
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    results = []
    for checkpointing in (False, True):
        # No remembered verdicts: the packed self-tests must run at the first packed call, i.e. inside the
        # checkpointed forward (that once deadlocked; an earlier test in the same worker had hidden it here)
        selftest.clear_cache()
        model = copy.deepcopy(base).cuda().to(torch.bfloat16).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        report = fusepatch.apply(model)
        assert any(c.fused for layer in report.layers for c in layer.choices)
        loss = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        results.append((loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert relative_error(loss_b, loss_a) < 1e-3
    assert grads_a.keys() == grads_b.keys()
    worst = max(relative_error(grads_b[n], grads_a[n]) for n in grads_a)
    assert worst < 5e-3, worst  # the recompute reruns the same kernels on the same inputs (atomics aside)


def test_conditional_generation_text_loss_on_gpu():
    """Qwen3.5 checkpoints load as Qwen3_5ForConditionalGeneration: the patched image-text model (fused loss and
    every kernel that takes fp32) against its eager self, fp32, loss and every parameter gradient. The reference
    is fusepatch's eager forward, not transformers' own: with a causal-conv1d build that lacks fp32 (the H200's
    bf16-only wheel) transformers' fast path raises "not implemented for type 'Float'" (measured there)."""
    from fusepatch.tools.tiny import tiny_image_text_model

    base = tiny_image_text_model(**MINI, vocab_size=1024)
    reference, model = eager(copy.deepcopy(base).cuda()), copy.deepcopy(base).cuda()
    report = fusepatch.apply(model)
    head = next(layer for layer in report.layers if layer.layer == "Qwen3_5ForConditionalGeneration")
    require(type("V", (), {"ok": head.choices[0].fused, "reason": head.choices[0].reason_text()})(), "fused loss")
    ids = torch.randint(0, 1024, (2, 301), device="cuda")
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    out.loss.backward()
    assert out.logits is None
    errors = {"loss": relative_error(out.loss, expected.loss)}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    errors |= {n: relative_error(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None}
    record("qwen3_5 ForConditionalGeneration fp32", errors)
    # The decay parameters' gradients sum over every token with cancellation: the fp32 loss's tf32 dots (fla)
    # reach them amplified (measured on the H200 at 4afa2d1: dt_bias 0.023, A_log 0.014; every other gradient
    # within 1e-2), as the bf16 model bounds of conftest.py allow for them too.
    bad = {k: v for k, v in errors.items() if not v <= (5e-2 if k.endswith(("A_log", "dt_bias")) else 1e-2)}
    assert not bad and len(errors) == len(ref_grads) + 1, bad


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_forward_of_a_plain_batch_waits_for_nothing(model_type):
    """Labels and nothing else: no call in the patched hybrid forward waits for the GPU (neither transformers'
    packed-rows check nor fusepatch's boundary search runs, layers/support/positions.py), so a training loop queues the next
    step behind the optimizer (the 27B-shaped step idled 6.4 ms in its first 10 ms on the H200, the H200 run of 2026-11-30). With
    the caller's own positions the checks run and wait: the guard sees real waits."""
    plain, own = forward_syncs(model_type)
    assert plain is None, plain
    assert own is not None and "synchroniz" in own, own
