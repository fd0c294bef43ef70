"""The fused linear cross-entropy: the chunked implementation against the eager reference, and the CausalLM
forward that uses it (on CPU by letting the GPU-only candidate accept CPU tensors for the test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import grads

import fusepatch
from fusepatch import selftest
from fusepatch.ops import OPS
from fusepatch.ops import linear_cross_entropy as lce
from fusepatch.requirements import InputRule
from fusepatch.tiny import tiny_image_text_model, tiny_model


def _data(tokens=301, hidden=48, vocab=777, dtype=torch.float64):
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, dtype=dtype) * hidden**-0.5).requires_grad_(True)
    y = torch.randint(0, vocab, (tokens,))
    y[::5] = -100
    return h, w, y


@pytest.mark.parametrize("num_items", [None, 123])
def test_chunked_matches_the_reference_with_many_chunks(monkeypatch, num_items):
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 777 * 64)  # 64 tokens a chunk: 5 chunks, the last one short
    h, w, y = _data()
    ref = lce.linear_cross_entropy_reference(h, w, y, num_items_in_batch=num_items)
    g_ref = torch.autograd.grad(ref * 0.7, (h, w))
    out = lce.linear_cross_entropy_chunked(h, w, y, num_items_in_batch=num_items)
    g_out = torch.autograd.grad(out * 0.7, (h, w))  # a scaled loss (gradient accumulation) scales the gradients
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_chunked_without_gradients_and_all_ignored():
    h, w, y = _data()
    with torch.no_grad():
        torch.testing.assert_close(
            lce.linear_cross_entropy_chunked(h, w, y), lce.linear_cross_entropy_reference(h, w, y)
        )
    y_ignored = torch.full_like(y, -100)
    out = lce.linear_cross_entropy_chunked(h, w, y_ignored)
    assert out.item() == 0.0
    gh, gw = torch.autograd.grad(out, (h, w))
    assert gh.abs().sum() == 0 and gw.abs().sum() == 0


@pytest.fixture
def chunked_on_cpu(monkeypatch):
    op = OPS["linear_cross_entropy"]
    chunked = next(c for c in op.candidates if c.name == "torch-chunked")
    cpu = dataclasses.replace(chunked, inputs=InputRule(devices=("cpu", "cuda"), kernel="chunked CE"))
    monkeypatch.setitem(OPS, "linear_cross_entropy", dataclasses.replace(op, candidates=(cpu,)))
    selftest.clear_cache()


def _fused_loss_matches_the_unpatched_model(reference, model, *, length: int, ignored: int) -> None:
    """Patch ``model`` (chunked loss on CPU): the fused loss is chosen for its head; the output (same class, loss
    first, no logits), every gradient, logits on request, the Trainer's ``num_items_in_batch`` and the
    no-labels path match the unpatched ``reference``."""
    ids = torch.randint(0, 512, (2, length))
    labels = ids.clone()
    labels[:, :ignored] = -100
    expected = reference(input_ids=ids, labels=labels)
    expected.loss.backward()
    report = fusepatch.apply(model)
    head = next(layer for layer in report.layers if layer.layer == type(model).__name__)
    assert head.choices[0].chosen == "torch-chunked"
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert type(out) is type(expected) and out.logits is None and out[0] is out.loss  # logits never materialised
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    g_ref, g = grads(reference), grads(model)
    assert set(g) == set(g_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-3, atol=1e-6, msg=name)
    with_logits = model(input_ids=ids, labels=labels, return_logits=True)
    torch.testing.assert_close(with_logits.logits, expected.logits, rtol=1e-4, atol=1e-5)
    items = torch.tensor(77)  # the Trainer's gradient-accumulation normaliser
    torch.testing.assert_close(
        model(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
        reference(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
        rtol=1e-5,
        atol=1e-6,
    )
    assert model(input_ids=ids).logits.shape == (2, length, 512)  # no labels: the original forward


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_causal_lm_forward_uses_the_fused_loss(chunked_on_cpu, model_type):
    _fused_loss_matches_the_unpatched_model(tiny_model(model_type), tiny_model(model_type), length=33, ignored=5)


def test_causal_lm_forward_falls_back_on_cpu_without_the_override():
    model = tiny_model("qwen3")
    report = fusepatch.apply(model)
    head = next(layer for layer in report.layers if layer.layer == "Qwen3ForCausalLM")
    assert head.choices[0].chosen == "eager" and "tensors are on cpu" in head.choices[0].reason_text()
    ids = torch.randint(0, 512, (1, 9))
    assert model(input_ids=ids, labels=ids).logits is not None  # the original forward ran


def _stand_in_fla(monkeypatch, fused_linear_cross_entropy_fwd) -> None:
    """An importable ``fla.modules.fused_linear_cross_entropy.ops`` whose forward function is the one given."""
    import sys
    import types

    package = types.ModuleType("fla.modules.fused_linear_cross_entropy")
    ops = types.ModuleType("fla.modules.fused_linear_cross_entropy.ops")
    ops.fused_linear_cross_entropy_fwd = fused_linear_cross_entropy_fwd
    package.ops = ops
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.fused_linear_cross_entropy", package)
    monkeypatch.setitem(sys.modules, "fla.modules.fused_linear_cross_entropy.ops", ops)


def _fla_contract(x, target, weight, ignore_index, reduction="sum"):
    """What fla's forward returns: the loss summed ("sum") or over the labels not ignored, at least 1 ("mean"),
    and its input and weight gradients (no bias)."""
    x, weight = x.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = torch.nn.functional.cross_entropy(
            (x @ weight.t()).float(), target, ignore_index=ignore_index, reduction="sum"
        )
        if reduction == "mean":
            loss = loss / target.ne(ignore_index).sum().clamp_min(1)
        dx, dw = torch.autograd.grad(loss, (x, weight))
    return loss.detach(), dx, dw, None


@pytest.mark.parametrize("has_switch", [True, False], ids=["fla>=0.5-signature", "older-signature"])
def test_fla_adapter_keeps_weight_grad_gemms_in_the_weight_dtype(monkeypatch, has_switch):
    """fla's default fp32 weight-gradient accumulation runs fp32 GEMMs (measured on the H200: 254 ms against
    58.6 ms at the 27B shape); the adapter turns it off for half-precision weights, on for fp32 ones, and
    passes nothing to an fla whose function has no such switch. A stand-in fla records the calls."""
    calls = []

    if has_switch:

        def fused_linear_cross_entropy_fwd(x, target, weight, bias=None, ignore_index=-100, num_chunks=8,
                                           reduction="mean", accumulate_grad_in_fp32=True):  # fmt: skip
            calls.append(accumulate_grad_in_fp32)
            return _fla_contract(x, target, weight, ignore_index, reduction)
    else:

        def fused_linear_cross_entropy_fwd(x, target, weight, bias=None, ignore_index=-100, num_chunks=8,
                                           reduction="mean"):  # fmt: skip
            calls.append(None)
            return _fla_contract(x, target, weight, ignore_index, reduction)

    _stand_in_fla(monkeypatch, fused_linear_cross_entropy_fwd)
    fn = next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla").load()
    for dtype in (torch.bfloat16, torch.float32):
        h, w, y = _data(dtype=dtype)
        torch.testing.assert_close(fn(h, w, y), lce.linear_cross_entropy_reference(h, w, y))
    assert calls == ([False, True] if has_switch else [None, None])


def test_fla_adapter_lets_fla_divide_unless_the_trainer_gives_the_count(monkeypatch):
    """Without ``num_items_in_batch`` the adapter asks fla for its "mean" (the same divisor as transformers':
    labels not ignored, at least 1), so the gradients fla writes are final and the loss's backward multiplies
    by 1 (skipped); with it, fla sums and the adapter divides by the Trainer's count. Both equal the reference."""
    seen = []

    def fused_linear_cross_entropy_fwd(x, target, weight, bias=None, ignore_index=-100, num_chunks=8, reduction="mean"):
        seen.append(reduction)
        return _fla_contract(x, target, weight, ignore_index, reduction)

    _stand_in_fla(monkeypatch, fused_linear_cross_entropy_fwd)
    fn = next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla").load()
    h, w, y = _data(dtype=torch.float32)
    y[::3] = -100
    torch.testing.assert_close(fn(h, w, y), lce.linear_cross_entropy_reference(h, w, y))
    y[:] = -100  # nothing to predict: the divisor is 1, not 0
    torch.testing.assert_close(fn(h, w, y), lce.linear_cross_entropy_reference(h, w, y))
    h, w, y = _data(dtype=torch.float32)
    got = fn(h, w, y, num_items_in_batch=97)
    torch.testing.assert_close(got, lce.linear_cross_entropy_reference(h, w, y, num_items_in_batch=97))
    assert seen == ["mean", "mean", "sum"]


def test_fla_adapter_names_the_fix_when_fla_changes_its_forward(monkeypatch):
    """fusepatch calls fla's forward function directly (its own backward replaces fla's): an fla whose function
    lost a parameter fusepatch passes fails to load, naming the fix (a failed load is a fallback with its reason)."""

    def fused_linear_cross_entropy_fwd(x, target, weight, ignore_index=-100):
        raise AssertionError("not called")

    _stand_in_fla(monkeypatch, fused_linear_cross_entropy_fwd)
    with pytest.raises(ImportError, match="FUSEPATCH_SKIP=linear_cross_entropy/fla"):
        next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla").load()


def test_conditional_generation_forward_uses_the_fused_loss(chunked_on_cpu):
    """Qwen3.5 checkpoints load as Qwen3_5ForConditionalGeneration: its text loss goes through the fused loss,
    whatever arguments and output class the installed transformers gives that forward."""
    _fused_loss_matches_the_unpatched_model(tiny_image_text_model(), tiny_image_text_model(), length=29, ignored=4)


def test_fla_chunk_budget_sets_num_chunks(monkeypatch):
    """FUSEPATCH_CE_LOGITS_MIB bounds one chunk's logits: at the 27B shape (4096 tokens, vocab 248320, bf16),
    1024 MiB (the default) gives 2048-token chunks (2 chunks) where fla's own default makes 8."""
    assert lce.fla_num_chunks(4096, 248320, 2, 1024 * 2**20) == 2
    assert lce.fla_num_chunks(4096, 248320, 2, 256 * 2**20) == 8
    assert lce.fla_num_chunks(4096, 248320, 2, 64 * 2**20) == 32  # 128-token chunks
    assert lce.fla_num_chunks(5, 248320, 2, 4 * 2**30) == 1

    calls = []

    def fused_linear_cross_entropy_fwd(x, target, weight, bias=None, ignore_index=-100, num_chunks=8, reduction="mean"):
        calls.append(num_chunks)
        return _fla_contract(x, target, weight, ignore_index, reduction)

    _stand_in_fla(monkeypatch, fused_linear_cross_entropy_fwd)
    candidate = next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla")
    h, w, y = _data(tokens=301, vocab=777)
    monkeypatch.delenv("FUSEPATCH_CE_LOGITS_MIB", raising=False)
    candidate.load()(h, w, y)  # default 1024 MiB: all 301 tokens in one chunk
    monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", "1")  # 1 MiB / (777 x 8 bytes) -> 128-token chunks -> 3 chunks
    candidate.load()(h, w, y)
    assert calls == [1, 3]
    monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", "lots")
    with pytest.raises(ValueError, match="whole number of MiB"):
        candidate.load()
