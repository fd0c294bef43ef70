"""The LM head's GEMMs in FP8 (``apply(model, lm_head_precision="fp8")``, op
``fp8_linear_cross_entropy``) on the CPU, where torch computes ``torch._scaled_mm`` with rowwise scales: the loss and
both gradients within FP8's error of fp32 and not bf16's (so the three GEMMs ran in FP8), the chunk loop's edges,
the op's self-test, the model's loss through it, the bf16 loss where the head's shape does not suit FP8 (said, with
the fix), and the argument's checks. The Triton cross-entropy kernel with these GEMMs on a GPU is
tests/gpu/test_fp8.py's."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import cpu_candidates, lm_batch

import fusepatch
from fusepatch.kernels import scale
from fusepatch.ops import linear_cross_entropy as lce
from fusepatch.ops.common import relative_error
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
from fusepatch.ops.fp8_linear_cross_entropy import scaled_mm
from fusepatch.tools.tiny import tiny_model

# FP8 GEMMs land 2.7% off fp32 on these inputs (each gradient; the loss 2e-4 to 1e-3), bf16 0.19%: the low bound
# shows FP8 ran, the high one is the self-test's floor
FP8_ERROR = (0.015, 0.05)


def torch_ce(logits, target, inverse, ignore_index: int, grad: bool) -> torch.Tensor:
    """``kernels/cross_entropy.cross_entropy_``'s contract in torch: per-token losses (0 where ignored) and, with
    ``grad``, ``(softmax - onehot) * inverse`` written over the logits (zeros where ignored)."""
    z = logits.float()
    lse = torch.logsumexp(z, 1)
    valid = target != ignore_index
    column = target.masked_fill(~valid, 0)  # an ignored label read as 0, as the kernel reads it (any ignore_index)
    loss = torch.where(valid, lse - z.gather(1, column[:, None]).squeeze(1), 0.0)
    if grad:
        g = torch.softmax(z, 1)
        g[torch.arange(len(target)), column] -= 1
        g *= torch.where(valid, inverse, 0.0)[:, None]
        logits.copy_(g)
    return loss


@pytest.fixture
def fp8_loss(monkeypatch):
    """The op's loop with the torch cross-entropy (the Triton one needs a GPU), and torch's scaling in place of
    the scaling kernel."""
    monkeypatch.setattr(scale, "scale_unless_one_", lambda t, f: t if f.item() == 1.0 else t.mul_(f.to(t.dtype)))
    return lce.loop(torch_ce, scaled_mm.FP8Gemms)


def _data(tokens=600, hidden=128, vocab=1024, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator) * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), generator=generator)
    y[::7] = -100
    return h.bfloat16(), w.bfloat16(), y


def _loss_and_grads(fn, h, w, y, scale_by=1.0, **kwargs):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(h, w, y, **kwargs)
    return (out, *torch.autograd.grad(out * scale_by, (h, w)))


@pytest.mark.parametrize("mib", [None, "1"], ids=["one-chunk", "two-chunks"])  # 1 MiB: chunks of 512 and 88 tokens
@pytest.mark.parametrize("num_items", [None, 611])
def test_fp8_loss_is_fp8_precise_loss_and_both_gradients(fp8_loss, monkeypatch, mib, num_items):
    """Loss, hidden-state and weight gradients against fp32: the weight gradient within FP8's error, far from
    bf16's; the hidden-state gradient, whose targets' term is exact (``FP8Gemms``), within 1% (0.4-0.5% here, bf16
    0.2-0.4%; that its GEMM is an FP8 one, ``test_fp8_loss_edges``); the loss within a tenth of FP8's error; a loss
    gradient other than 1 (gradient accumulation) scales both. (A block of the weight gradient left out or added
    twice lands far outside the band.)"""
    if mib is None:
        monkeypatch.delenv("FUSEPATCH_CE_LOGITS_MIB", raising=False)
    else:  # and the second chunk's weight gradient added in blocks of 300 vocabulary rows, the last one short
        monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", mib)
        monkeypatch.setattr(scaled_mm, "VOCAB_BLOCK", 300)
    fn = lce.loop(torch_ce, scaled_mm.FP8Gemms)  # the chunk budget is read when the function is made
    h, w, y = _data()
    items = {"num_items_in_batch": num_items}
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y, 0.3, **items)
    got = _loss_and_grads(fn, h, w, y, 0.3, **items)
    bf16 = _loss_and_grads(lce.loop(torch_ce), h, w, y, 0.3, **items)
    assert relative_error(got[0], want[0]) < FP8_ERROR[0] / 10
    errors = [relative_error(g, r) for g, r in zip(got[1:], want[1:])]
    bf16_errors = [relative_error(g, r) for g, r in zip(bf16[1:], want[1:])]
    assert all(e < 0.005 for e in bf16_errors), bf16_errors  # what bf16 GEMMs give
    assert errors[0] < 0.01 and FP8_ERROR[0] < errors[1] < FP8_ERROR[1], errors
    assert got[1].dtype == got[2].dtype == torch.bfloat16


def _scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """The factor ``got`` is ``want`` scaled by, fitted by least squares."""
    got, want = got.double(), want.double()
    return ((got * want).sum() / (want * want).sum()).item()


@pytest.mark.parametrize("tokens", [32, 33, 64, 600])
def test_fp8_loss_gradients_keep_the_denominators_scale(fp8_loss, tokens):
    """Each token's gradient is divided by the loss's denominator before it is rounded to FP8, to a value shared by
    every token's target entry (about -1 / denominator): rounded there, the whole gradient would come out scaled,
    by as much as FP8's relative step (4% at 54 labelled tokens). Both gradients keep the denominator's scale to
    within a few tenths of a percent, whatever the number of labels, and stay within FP8's error."""
    h, w, y = _data(tokens=tokens)
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y)
    got = _loss_and_grads(fp8_loss, h, w, y)
    scales = [_scale(g, r) for g, r in zip(got[1:], want[1:])]
    assert all(abs(s - 1) < 0.005 for s in scales), scales
    assert all(relative_error(g, r) < FP8_ERROR[1] for g, r in zip(got[1:], want[1:]))


def test_fp8_hidden_gradient_keeps_the_probabilities_at_a_large_vocabulary(fp8_loss):
    """At Qwen3.5's vocabulary (248,320) an untrained head predicts about 1 / 248,320 for every token; in a token's
    row of the logits' gradient its target's entry is about -1. Scaled to that -1, e4m3 rounds what lies under
    1 / 262,144 of it to zero and what lies a little above to twice its value: the probabilities' part of the
    hidden-state gradient (the head's rows weighted by them) lost a sixth of its mass, a bias along any direction the
    head's rows share (trained heads' rows tend to): 31% off along it here. With the target's entry left out of the
    FP8 rows and added exactly, both gradients stay within FP8's error, also along it (0.5% here, as bf16)."""
    generator = torch.Generator().manual_seed(1)
    tokens, hidden, vocab = 48, 64, 248320
    direction = torch.nn.functional.normalize(torch.randn(hidden, generator=generator), dim=0)
    w = (torch.randn(vocab, hidden, generator=generator) * 0.5 + direction) * hidden**-0.5
    h, y = torch.randn(tokens, hidden, generator=generator), torch.randint(0, vocab, (tokens,), generator=generator)
    y[::5] = -100
    h, w = h.bfloat16(), w.bfloat16()
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y)
    got = _loss_and_grads(fp8_loss, h, w, y)
    along = relative_error(got[1].double() @ direction.double(), want[1].double() @ direction.double())
    assert along < FP8_ERROR[1], along
    assert all(relative_error(g, r) < FP8_ERROR[1] for g, r in zip(got[1:], want[1:]))


def test_fp8_hidden_gradient_of_confident_targets(fp8_loss):
    """Targets predicted at about a half (a loss of 0.61): a token's gradient is mostly ``(p - 1)`` times its
    target's weight row. Applied exactly, the hidden-state gradient lands 4.0% off fp32 here, against 5.8% with the
    target's entry quantized in its row and 7.2% with its probability quantized and its ``-1`` apart (that row's FP8
    error weighed by ``p / (1 - p)``); bf16 0.9%. The logits' FP8 GEMM makes most of what remains (and puts the
    weight gradient 5.3% off here)."""
    generator = torch.Generator().manual_seed(2)
    tokens, hidden, vocab = 256, 64, 4096
    w = torch.randn(vocab, hidden, generator=generator) * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), generator=generator)
    h = torch.randn(tokens, hidden, generator=generator) + 10 * w[y] / w[y].norm(dim=1, keepdim=True) ** 2
    h, w = h.bfloat16(), w.bfloat16()
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y)
    assert 0.4 < float(want[0].detach()) < 0.8
    got = _loss_and_grads(fp8_loss, h, w, y)
    error = relative_error(got[1], want[1])
    assert error < FP8_ERROR[1], error


@pytest.mark.parametrize("ignore_index", [-1, 0, 1024], ids=["negative", "a-token", "past-the-vocabulary"])
def test_fp8_loss_takes_any_ignore_index(fp8_loss, ignore_index):
    """An ``ignore_index`` other than -100 (a vocabulary index, or one past the vocabulary as fp32's cross-entropy
    and the kernel take it): its rows ignored, the loss and both gradients as near fp32 as with -100."""
    h, w, y = _data()
    y[::7] = ignore_index
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y, ignore_index=ignore_index)
    got = _loss_and_grads(fp8_loss, h, w, y, ignore_index=ignore_index)
    assert relative_error(got[0], want[0]) < FP8_ERROR[0] / 10
    errors = [relative_error(g, r) for g, r in zip(got[1:], want[1:])]
    assert errors[0] < 0.01 and errors[1] < FP8_ERROR[1], errors


def test_fp8_loss_edges(fp8_loss, monkeypatch):
    """A frozen weight: the weight gradient's GEMM is skipped; no gradient wanted: the logits' GEMM alone; nothing
    labelled: NaN as transformers' mean, every gradient 0; no tokens: a zero weight gradient of the weight's shape;
    a head FP8 GEMMs cannot take raises with the shape."""
    calls = []
    plain = scaled_mm.fp8_mm
    monkeypatch.setattr(scaled_mm, "fp8_mm", lambda *args: calls.append(args[0].shape) or plain(*args))
    h, w, y = _data(tokens=64)
    hidden = h.clone().requires_grad_()
    (gh,) = torch.autograd.grad(fp8_loss(hidden, w, y), (hidden,))
    assert len(calls) == 2 and gh.abs().sum() > 0  # the logits and the hidden-state gradient
    calls.clear()
    with torch.no_grad():
        fp8_loss(h, w, y)
    assert len(calls) == 1
    nothing = torch.full_like(y, -100)
    out, gh, gw = _loss_and_grads(fp8_loss, h, w, nothing)
    assert out.isnan() and gh.abs().sum() == 0 and gw.abs().sum() == 0
    out, gh, gw = _loss_and_grads(fp8_loss, h[:0], w, y[:0])
    assert out.isnan() and gh.shape == (0, h.shape[1]) and gw.shape == w.shape and gw.abs().sum() == 0
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_loss(h, w[:1000], y.clamp_max(999))


def test_the_ops_self_test_passes_the_fp8_loss_and_refuses_a_wrong_one(fp8_loss, monkeypatch):
    """The op's self-test, run on the CPU against this loop: passed; with the hidden-state gradient's GEMM off by
    a tenth: refused."""
    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op, cpu = OPS["fp8_linear_cross_entropy"], InputRule(devices=("cpu",), dtypes=("bfloat16",))
    selftest.clear_cache()
    good = selftest.run(op, Candidate("good", "pip", (), lambda: fp8_loss, inputs=cpu), fp8_loss, "cpu", "bfloat16")
    wrong = scaled_mm.FP8Gemms.grad_hidden
    monkeypatch.setattr(
        scaled_mm.FP8Gemms, "grad_hidden", lambda self, g, *rows: (wrong(self, g, *rows), rows[-1].mul_(1.1))
    )
    bad_loss = lce.loop(torch_ce, scaled_mm.FP8Gemms)
    bad = selftest.run(op, Candidate("bad", "pip", (), lambda: bad_loss, inputs=cpu), bad_loss, "cpu", "bfloat16")
    selftest.clear_cache()
    assert good.ok, good.reason
    assert not bad.ok and "differs from the reference" in bad.reason


def _head_model(monkeypatch, fp8_loss, **overrides):
    """A bf16 Qwen3.5 whose losses and projections have CPU stand-ins of their FP8 and bf16 kernels; the list of
    their calls."""
    from fusepatch.layers.support import projections

    kernels = {
        "linear_cross_entropy": lce.linear_cross_entropy_chunked,
        "fp8_linear_cross_entropy": fp8_loss,
        "fp8_linear": fp8_linear,
    }
    calls = cpu_candidates(monkeypatch, kernels)
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    return tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256, **overrides).to(torch.bfloat16), calls


def _losses(calls: list) -> list[str]:
    return [op for op, _, _ in calls if op.endswith("cross_entropy")]


def test_a_model_trains_its_head_in_fp8_when_asked(monkeypatch, fp8_loss):
    """``lm_head_precision="fp8"``: the report names the FP8 loss's kernel, each step's loss runs through it (not the bf16
    loss), and the loss and the head's gradient stay within FP8's error of the same model with a bf16 head, yet
    differ from it; without the option the head's loss is the bf16 one."""
    base, calls = _head_model(monkeypatch, fp8_loss)
    plain, fp8 = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, precision="fp8", verbose=False)
    report = fusepatch.apply(fp8, precision="fp8", lm_head_precision="fp8", verbose=False)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert chosen["fp8_linear_cross_entropy"] == "cpu-standin", report.log_lines()
    batch = lm_batch(base, length=48)
    results = []
    for model in (plain, fp8):
        calls.clear()
        loss = model(**batch).loss
        loss.backward()
        results.append((loss, model.lm_head.weight.grad, _losses(calls)))
    assert results[0][2] == ["linear_cross_entropy"] and results[1][2] == ["fp8_linear_cross_entropy"]
    assert abs(results[1][0].item() - results[0][0].item()) / results[0][0].item() < 0.01
    error = relative_error(results[1][1], results[0][1])
    assert 1e-3 < error < 0.1, error


def test_a_head_fp8_cannot_take_keeps_the_bf16_loss_and_says_why(monkeypatch, fp8_loss, caplog):
    """A vocabulary that is not a multiple of 16: ``apply`` says the head keeps bf16 GEMMs, with the fix (pad the
    vocabulary), and the loss runs the bf16 op."""
    model, calls = _head_model(monkeypatch, fp8_loss, vocab_size=500)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.apply(model, precision="fp8", lm_head_precision="fp8", verbose=False)
    said = [r.getMessage() for r in caplog.records if "lm_head_precision='fp8'" in r.getMessage()]
    assert len(said) == 1 and "(500, 128)" in said[0] and "pad_to_multiple_of=16" in said[0], said
    calls.clear()
    model(**lm_batch(model, length=16)).loss.backward()
    assert _losses(calls) == ["linear_cross_entropy"]


def test_lm_head_precision_argument(monkeypatch, fp8_loss, caplog):
    """One of the precisions or None, any case; without ``precision`` the head alone runs in FP8 (the projections
    as they are); a model patched before keeps its head's loss, said with the fix."""
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="lm_head_precision expects None or one of 'fp8'"):
        fusepatch.apply(model, lm_head_precision="fp4")
    with pytest.raises(ValueError, match="lm_head_precision expects"):
        fusepatch.apply(model, lm_head_precision=True)
    fusepatch.apply(model, verbose=False)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.apply(model, lm_head_precision="FP8", verbose=False)
    assert any("the LM head keeps lm_head_precision=None" in r.getMessage() for r in caplog.records)
    alone, calls = _head_model(monkeypatch, fp8_loss)
    report = fusepatch.apply(alone, lm_head_precision="fp8", verbose=False)
    assert not any(c.op == "fp8_linear" for layer in report.layers for c in layer.choices)
    calls.clear()
    alone(**lm_batch(alone, length=16)).loss.backward()
    assert _losses(calls) == ["fp8_linear_cross_entropy"]


def test_a_second_backward_names_a_skip_that_reaches_the_fp8_loss(fp8_loss):
    """The loop takes one backward per forward; its error's ``FUSEPATCH_SKIP`` value leaves the FP8 loss no
    candidate but eager too (else the head's loss would run the same loop again and raise the same)."""
    from fusepatch.base.options import skip_pairs
    from fusepatch.ops import OPS

    h, w, y = _data(tokens=64)
    hidden = h.clone().requires_grad_()
    loss = fp8_loss(hidden, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward") as raised:
        loss.backward()
    value = str(raised.value).split("FUSEPATCH_SKIP=")[1].split()[0]
    candidates = {name: [c.name for c in op.candidates] for name, op in OPS.items()}
    skipped = skip_pairs(value, candidates)
    op = OPS["fp8_linear_cross_entropy"]
    assert all((op.name, c.name) in skipped for c in op.candidates), value


@pytest.mark.parametrize("mib", [None, "1"], ids=["one-chunk", "two-chunks"])
def test_an_fp16_weight_gradient_is_made_a_block_at_a_time(fp8_loss, monkeypatch, mib):
    """``_scaled_mm`` writes bf16: an fp16 head's weight gradient is written a block of vocabulary rows at a time,
    the first chunk's too, so no whole bf16 copy of it lives beside the fp16 one; within FP8's error of fp32."""
    if mib is not None:
        monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", mib)
    monkeypatch.setattr(scaled_mm, "VOCAB_BLOCK", 300)
    rows = []
    plain = scaled_mm.fp8_mm
    monkeypatch.setattr(
        scaled_mm, "fp8_mm", lambda *args: rows.append((*args[0].shape, args[2].shape[0])) or plain(*args)
    )
    fn = lce.loop(torch_ce, scaled_mm.FP8Gemms)
    h, w, y = _data()
    want = _loss_and_grads(lce.linear_cross_entropy_reference, h.float(), w.float(), y)
    got = _loss_and_grads(fn, h.half(), w.half(), y)
    # the weight gradient's GEMMs: by hidden features along the tokens (the hidden-state gradient's: the vocabulary)
    weight_gradient = [m for m, k, n in rows if n == h.shape[1] and k != w.shape[0]]
    assert weight_gradient and max(weight_gradient) <= 300, rows
    assert got[2].dtype == torch.float16
    errors = [relative_error(g.float(), r) for g, r in zip(got[1:], want[1:])]
    assert all(e < FP8_ERROR[1] for e in errors), errors


def test_a_hidden_size_fp8_cannot_take_is_not_told_to_pad_the_vocabulary(caplog):
    """A vocabulary in multiples of 16 but a hidden size not: padding the vocabulary would not help, so the fix
    said is to leave the option unset."""
    model = tiny_model("qwen3", hidden_size=72)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.apply(model, lm_head_precision="fp8", verbose=False)
    said = [r.getMessage() for r in caplog.records if "lm_head_precision='fp8'" in r.getMessage()]
    assert len(said) == 1 and "(512, 72)" in said[0], said
    assert "pad_to_multiple_of" not in said[0] and "lm_head_precision=None" in said[0], said


def test_the_fp8_loss_runs_where_the_bf16_loss_is_excluded(monkeypatch, fp8_loss):
    """``exclude="linear_cross_entropy"`` with ``lm_head_precision="fp8"``: the report chooses the FP8 loss's
    kernel, and the step runs it (the bf16 loss's eager choice does not send the call to transformers' forward)."""
    model, calls = _head_model(monkeypatch, fp8_loss)
    report = fusepatch.apply(model, lm_head_precision="fp8", exclude="linear_cross_entropy", verbose=False)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert chosen == {**chosen, "linear_cross_entropy": "eager", "fp8_linear_cross_entropy": "cpu-standin"}
    calls.clear()
    out = model(**lm_batch(model, length=16))
    out.loss.backward()
    assert _losses(calls) == ["fp8_linear_cross_entropy"] and out.logits is None


def test_a_head_another_library_computes_is_not_warned_about(monkeypatch, fp8_loss, caplog):
    """A head whose loss a trainer's fused head computes (a forward taking ``fused_lm_head``): fusepatch leaves it,
    so an FP8 shape it could not take is not said."""
    import types

    model, _ = _head_model(monkeypatch, fp8_loss, vocab_size=500)
    namespace = {"__name__": "my_trainer.head"}
    exec("def forward(self, *args, fused_lm_head=False, **kwargs):\n    return None\n", namespace)
    model.forward = types.MethodType(namespace["forward"], model)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        report = fusepatch.apply(model, lm_head_precision="fp8", verbose=False)
    head = next(layer for layer in report.layers if layer.layer == type(model).__name__)
    assert not head.patched
    assert not [r for r in caplog.records if "lm_head_precision='fp8'" in r.getMessage()]


def test_the_list_says_which_rows_only_an_option_selects():
    """``python -m fusepatch list``: a head's FP8 loss row and the FP8 projections say they apply when asked."""
    from helpers import in_process

    code, out, _ = in_process(["list", "--model-type", "qwen3", "--wide"])
    lines = [line for line in out.splitlines() if "Qwen3ForCausalLM" in line]
    assert code == 0 and len(lines) == 2, lines
    assert "(when asked: LM head GEMMs in FP8 (lm_head_precision='fp8'))" in lines[0]
    assert "when asked" not in lines[1]
