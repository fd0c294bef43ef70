"""Whole models on a real GPU: a patched mini model of each hybrid family against its fp32 eager reference.

A bf16 model differs from its fp32 self by rounding alone, by a few percent in some gradients. So a fused
bf16 path is judged against the fp32 reference, beside the bf16 eager path: it passes when its error is no
larger than FACTOR times the eager path's error (plus a small floor for quantities eager gets almost exact).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import require

import fusepatch
from fusepatch.ops import OPS
from fusepatch.ops._common import relative_error
from fusepatch.tiny import tiny_model

pytestmark = pytest.mark.gpu
FACTOR = 3.0
FLOOR = 5e-3
HYBRID = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
GDN_OPS = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")


def _eager(model):
    fusepatch.apply(model, exclude=list(OPS))
    return model


def _models(model_type):
    base = tiny_model(model_type, **SHAPE)
    reference = _eager(copy.deepcopy(base).cuda())  # fp32, fusepatch's eager references (not fla)
    eager = _eager(copy.deepcopy(base).cuda().to(torch.bfloat16))
    fused = copy.deepcopy(base).cuda().to(torch.bfloat16)
    report = fusepatch.apply(fused)
    return reference, eager, fused, report


def _outputs(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.float(), out.logits.float(), grads


@pytest.mark.parametrize("model_type", HYBRID)
def test_mini_model_logits_loss_and_every_gradient(model_type):
    reference, eager, fused, report = _models(model_type)
    gdn = next(layer for layer in report.layers if layer.layer.endswith("GatedDeltaNet"))
    chosen = {c.op: c for c in gdn.choices}
    for op in GDN_OPS:
        require(type("V", (), {"ok": chosen[op].fused, "reason": chosen[op].reason_text()})(), f"{model_type} {op}")
    ids = torch.randint(0, reference.config.vocab_size, (2, 301), device="cuda")
    ref_loss, ref_logits, ref_grads = _outputs(reference, ids)
    e_loss, e_logits, e_grads = _outputs(eager, ids)
    f_loss, f_logits, f_grads = _outputs(fused, ids)
    assert f_grads.keys() == ref_grads.keys()
    failures = {}
    checks = {"loss": (f_loss, e_loss, ref_loss), "logits": (f_logits, e_logits, ref_logits)}
    checks.update({n: (f_grads[n], e_grads[n], ref_grads[n]) for n in ref_grads})
    for name, (f, e, r) in checks.items():
        fused_err, eager_err = relative_error(f, r), relative_error(e, r)
        if not fused_err <= FACTOR * eager_err + FLOOR:
            failures[name] = (round(fused_err, 5), round(eager_err, 5))
    assert not failures, f"fused vs eager error against fp32 (name: (fused, eager)): {failures}"


@pytest.mark.parametrize("model_type", HYBRID)
def test_packed_row_equals_documents_alone_on_gpu(model_type):
    model = tiny_model(model_type, **SHAPE).cuda().to(torch.bfloat16)
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


@pytest.mark.parametrize("model_type", ["qwen3_5_text"])
def test_thirty_training_steps_track_the_eager_loss_curve(model_type):
    base = tiny_model(model_type, **SHAPE)
    eager = _eager(copy.deepcopy(base).cuda().to(torch.bfloat16))
    fused = copy.deepcopy(base).cuda().to(torch.bfloat16)
    fusepatch.apply(fused)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 64, (4, 256), device="cuda", generator=generator) for _ in range(30)]
    curves = []
    for model in (eager, fused):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves.append(losses)
    eager_curve, fused_curve = curves
    assert eager_curve[-1] < eager_curve[0] - 0.5  # it learns (tokens drawn from a 64-token subset)
    gaps = [abs(a - b) / a for a, b in zip(eager_curve, fused_curve)]
    assert max(gaps) < 0.03, list(zip(eager_curve, fused_curve))


def test_generation_with_cache_matches_the_unpatched_model():
    model = tiny_model("qwen3_5_text", **SHAPE).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 50), device="cuda")
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    fusepatch.apply(model)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)
