"""The fused linear cross-entropy: the chunked implementation against the eager reference, and the CausalLM
forward that uses it (on CPU by letting the GPU-only candidate accept CPU tensors for the test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import grads

import fusepatch
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.ops import linear_cross_entropy as lce
from fusepatch.tools.tiny import tiny_image_text_model, tiny_model


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


@pytest.mark.parametrize("ignore_index", [-1, 0, 777], ids=["negative", "a-token", "past-the-vocabulary"])
def test_chunked_takes_any_ignore_index(ignore_index):
    """An ``ignore_index`` other than -100, one past the vocabulary too (fp32's cross-entropy and the kernels take
    it): the ignored rows' labels are read as 0, never as an index into the logits."""
    h, w, y = _data()
    y[::5] = ignore_index
    ref = lce.linear_cross_entropy_reference(h, w, y, ignore_index=ignore_index)
    out = lce.linear_cross_entropy_chunked(h, w, y, ignore_index=ignore_index)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _nothing_labelled_as_transformers(fn, h, w, y) -> None:
    """No label to predict: NaN, as transformers' mean over no tokens (``F.cross_entropy``) gives, and every
    gradient 0 as there; with ``num_items_in_batch`` the sum over no tokens, 0."""
    y = torch.full_like(y, -100)
    expected = torch.nn.functional.cross_entropy((h @ w.t()).float(), y)
    out = fn(h, w, y)
    assert expected.isnan() and out.isnan(), (out, expected)
    gh, gw = torch.autograd.grad(out, (h, w))
    assert gh.abs().sum() == 0 and gw.abs().sum() == 0
    assert fn(h, w, y, num_items_in_batch=torch.tensor(7)).item() == 0.0
    assert lce.linear_cross_entropy_reference(h, w, y).isnan()


def test_chunked_without_gradients_and_all_ignored():
    h, w, y = _data()
    with torch.no_grad():
        torch.testing.assert_close(
            lce.linear_cross_entropy_chunked(h, w, y), lce.linear_cross_entropy_reference(h, w, y)
        )
    _nothing_labelled_as_transformers(lce.linear_cross_entropy_chunked, h, w, y)


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


def _stand_in_fla(monkeypatch, **functions) -> None:
    """An importable ``fla.modules.fused_cross_entropy.ops`` holding the functions given (fla's own need a GPU)."""
    import sys
    import types

    package = types.ModuleType("fla.modules.fused_cross_entropy")
    ops = types.ModuleType("fla.modules.fused_cross_entropy.ops")
    for name, function in functions.items():
        setattr(ops, name, function)
    package.ops = ops
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.fused_cross_entropy", package)
    monkeypatch.setitem(sys.modules, "fla.modules.fused_cross_entropy.ops", ops)


class StandInKernels:
    """fla's two cross-entropy kernels' contract in torch, recording each call's rows and dloss: the forward
    returns (per-token loss, 0 for ignored labels; z-loss; log-sum-exp; classes; first class), the backward
    writes ``(softmax - onehot) * dloss`` over the logits in place, 0 for ignored labels. Each chunk's logits
    must be freed before the next chunk's are made (one chunk's logits at a time is the memory bound)."""

    def __init__(self):
        self.rows: list[int] = []
        self.dloss: list[float] = []
        self.previous = None  # the last chunk's logits, weakly: it must be gone when the next chunk starts

    def cross_entropy_fwd(self, logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                          logit_softcapping=None, ignore_index=-100, process_group=None):  # fmt: skip
        import weakref

        self.previous = weakref.ref(logits)
        self.rows.append(logits.shape[0])
        wide = logits.double()
        lse = wide.logsumexp(-1)
        valid = target != ignore_index
        picked = wide.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
        loss = torch.where(valid, lse - picked, 0.0).float()
        return loss, torch.zeros_like(loss), lse.float(), logits.shape[1], 0

    def cross_entropy_bwd(self, logits, target, lse, dloss, label_smoothing=0.0, logit_scale=1.0,
                          lse_square_scale=0.0, logit_softcapping=None, ignore_index=-100, total_classes=None,
                          class_start_idx=0, inplace_backward=False):  # fmt: skip
        assert inplace_backward and dloss.shape == target.shape
        self.dloss.append(float(dloss[0]))
        probs = (logits.double() - lse.double()[:, None]).exp()
        probs[torch.arange(len(target)), target.clamp_min(0)] -= 1.0
        probs *= torch.where(target != ignore_index, dloss.double(), 0.0)[:, None]
        logits.copy_(probs)
        return logits


def _scale_in_torch(tensor, factor):
    """fusepatch's scaling kernel's contract (Triton; tested in the interpreter in test_kernels.py)."""
    return tensor if factor.item() == 1.0 else tensor.mul_(factor.to(tensor.dtype))


def _fla_loop(monkeypatch, mib: int | str | None = None):
    from fusepatch.kernels import scale

    monkeypatch.setattr(scale, "scale_unless_one_", _scale_in_torch)
    kernels = StandInKernels()
    plain_mm = torch.mm

    def mm(a, b, **kwargs):  # a new chunk's logits GEMM: the last chunk's logits must be gone by now
        if b.shape[-1] == 777 and kernels.previous is not None:
            assert kernels.previous() is None, "two chunks' logits alive at once"
        return plain_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    _stand_in_fla(monkeypatch, cross_entropy_fwd=kernels.cross_entropy_fwd, cross_entropy_bwd=kernels.cross_entropy_bwd)
    if mib is None:
        monkeypatch.delenv("FUSEPATCH_CE_LOGITS_MIB", raising=False)
    else:
        monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", str(mib))
    return next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla").load(), kernels


@pytest.mark.parametrize("num_items", [None, 97])
@pytest.mark.parametrize("mib", [None, 1], ids=["one-chunk", "two-chunks"])
def test_fla_loop_matches_the_reference(monkeypatch, mib, num_items):
    """fusepatch's chunk loop around fla's kernels (stand-ins with their contract): loss and both gradients equal
    the eager reference with one chunk and with two (1 MiB / (777 x 4 bytes) -> 256-token chunks: 256, 45), each token's gradient divided inside the kernel by the labels not ignored or by the Trainer's
    ``num_items_in_batch``, and a loss gradient other than 1 (gradient accumulation) scaling both; one chunk's
    logits alive at a time (the next chunk's logits GEMM finds the last one's freed)."""
    fn, kernels = _fla_loop(monkeypatch, mib)
    h, w, y = _data(dtype=torch.float32)  # fla's kernels: fp32 losses, the GEMMs in the inputs' dtype
    y[::3] = -100
    got = fn(h, w, y, num_items_in_batch=num_items)
    want = lce.linear_cross_entropy_reference(h, w, y, num_items_in_batch=num_items)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for scale in (1.0, 0.3):
        got = fn(h, w, y, num_items_in_batch=num_items)
        got_grads = torch.autograd.grad(got * scale, (h, w))
        want_grads = torch.autograd.grad(
            lce.linear_cross_entropy_reference(h, w, y, num_items_in_batch=num_items) * scale, (h, w)
        )
        for a, b in zip(got_grads, want_grads):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert kernels.rows[:2] == ([301, 301] if mib is None else [256, 45])
    divisor = num_items or int((y != -100).sum())
    assert kernels.dloss[0] == pytest.approx(1 / divisor)


def test_fla_loop_edge_cases(monkeypatch):
    """No labels to predict (NaN as transformers' loss, gradients 0: the kernel zeroes the ignored rows rather
    than scale them by 1 / 0), no tokens at all (NaN, and a zero weight gradient of the weight's shape), no
    gradients wanted (no backward kernel runs), bf16 (gradients in the weight's dtype: the GEMMs stay on tensor
    cores), and a second backward through one forward (refused, naming the fix: the first one scaled the stored
    gradients in place)."""
    fn, kernels = _fla_loop(monkeypatch)
    h, w, y = _data(dtype=torch.float32)
    _nothing_labelled_as_transformers(fn, h, w, y)
    y[:] = -100
    empty = torch.zeros(0, h.shape[1], requires_grad=True)
    out = fn(empty, w, y[:0])
    gh, gw = torch.autograd.grad(out, (empty, w))
    assert out.isnan() and gh.shape == (0, h.shape[1]) and gw.shape == w.shape and gw.abs().sum() == 0
    calls = len(kernels.dloss)
    with torch.no_grad():
        torch.testing.assert_close(fn(h, w, y), lce.linear_cross_entropy_reference(h, w, y), equal_nan=True)
    assert len(kernels.dloss) == calls
    hb, wb, yb = _data(dtype=torch.bfloat16)
    out = fn(hb, wb, yb)
    gh, gw = torch.autograd.grad(out, (hb, wb), retain_graph=True)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(out, lce.linear_cross_entropy_reference(hb, wb, yb), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="FUSEPATCH_SKIP=linear_cross_entropy/fla,linear_cross_entropy/triton"):
        torch.autograd.grad(out * 2, (hb, wb))


def test_labels_not_one_per_row_raise_as_the_reference_does(monkeypatch):
    """Labels that are not one per row of the hidden states raise the ValueError the reference's ``cross_entropy``
    raises, in every candidate, naming both shapes: the loops read labels by the rows' index (past their end, or
    leaving rows unread)."""
    fla_loop, _ = _fla_loop(monkeypatch)
    h, w, y = _data(tokens=40, dtype=torch.float32)
    for labels in (y[:-3], torch.cat([y, y[:2]]), y[:, None]):
        if labels.numel() != len(y):  # what transformers' flattening cross_entropy says: the type to raise
            with pytest.raises(ValueError):
                torch.nn.functional.cross_entropy(h @ w.t(), labels.reshape(-1))
        for fn in (lce.linear_cross_entropy_reference, lce.linear_cross_entropy_chunked, fla_loop):
            for num_items in (None, 11):
                with pytest.raises(ValueError, match="labels of shape") as raised:
                    fn(h, w, labels, num_items_in_batch=num_items)
                assert str(tuple(labels.shape)) in str(raised.value) and str(tuple(h.shape)) in str(raised.value)


def test_fla_chunk_budget_sets_the_chunk_length(monkeypatch):
    """FUSEPATCH_CE_LOGITS_MIB bounds one chunk's logits: at the 27B shape (4096 tokens, vocab 248320, bf16),
    1024 MiB (the default: the loss holds the peak) gives two 2048-token chunks, 2048 MiB one, where fla's own
    default makes 8; an unset variable is the default."""
    assert lce.DEFAULT_LOGITS_MIB == 1024 and lce.fla_chunk_tokens(248320, 2, 2048 * 2**20) == 4096
    assert lce.fla_chunk_tokens(248320, 2, 1024 * 2**20) == 2048
    monkeypatch.delenv("FUSEPATCH_CE_LOGITS_MIB", raising=False)
    assert lce.fla_chunk_budget() == 1024 * 2**20
    assert lce.fla_num_chunks(4096, 248320, 2, 1024 * 2**20) == 2
    assert lce.fla_num_chunks(4096, 248320, 2, 256 * 2**20) == 8
    assert lce.fla_num_chunks(4096, 248320, 2, 64 * 2**20) == 32  # 128-token chunks
    assert lce.fla_num_chunks(5, 248320, 2, 4 * 2**30) == 1
    assert lce.fla_chunk_tokens(248320, 2, 1) == 1
    monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", "lots")
    with pytest.raises(ValueError, match="whole number of MiB"):
        _fla_loop(monkeypatch, "lots")
    with pytest.raises(ValueError, match="positive number"):
        _fla_loop(monkeypatch, 0)


def test_fla_adapter_names_the_fix_when_fla_changes_its_kernels(monkeypatch):
    """fusepatch calls fla's cross-entropy kernels' Python functions directly: an fla whose function lost a
    parameter fusepatch passes, or lost the function, fails to load naming the fix (a failed load is a fallback
    with its reason)."""
    kernels = StandInKernels()

    def cross_entropy_bwd(logits, target, lse, dloss, ignore_index=-100):
        raise AssertionError("not called")

    _stand_in_fla(monkeypatch, cross_entropy_fwd=kernels.cross_entropy_fwd, cross_entropy_bwd=cross_entropy_bwd)
    candidate = next(c for c in OPS["linear_cross_entropy"].candidates if c.name == "fla")
    with pytest.raises(ImportError, match="cross_entropy_bwd lacks .*inplace_backward.*FUSEPATCH_SKIP"):
        candidate.load()
    _stand_in_fla(monkeypatch, cross_entropy_bwd=kernels.cross_entropy_bwd)
    with pytest.raises(ImportError, match="cross_entropy_fwd lacks \\['itself'\\]"):
        candidate.load()


def test_conditional_generation_forward_uses_the_fused_loss(chunked_on_cpu):
    """Qwen3.5 checkpoints load as Qwen3_5ForConditionalGeneration: its text loss goes through the fused loss,
    whatever arguments and output class the installed transformers gives that forward."""
    _fused_loss_matches_the_unpatched_model(tiny_image_text_model(), tiny_image_text_model(), length=29, ignored=4)


def _record_count_order(layers, monkeypatch) -> list[str]:
    """A list that records, in order, layers 0 and 1 starting and the labelled-row count being queued."""
    from fusepatch.layers.support import labelled_rows

    order = []
    layers[0].register_forward_pre_hook(lambda *_: order.append("layer 0"))
    layers[1].register_forward_pre_hook(lambda *_: order.append("layer 1"))
    start = labelled_rows.LabelledRows.start

    def spy(self):
        order.append("count")
        start(self)

    monkeypatch.setattr(labelled_rows.LabelledRows, "start", spy)
    return order


def test_conditional_generation_counts_after_the_first_text_layer(chunked_on_cpu, monkeypatch):
    """The multimodal wrapper queues the labelled-row count as the causal LM does: once the text stack's layer 0 is
    queued, once a forward, the hook gone afterwards."""
    model = tiny_image_text_model()
    fusepatch.apply(model)
    layers = model.model.language_model.layers
    order = _record_count_order(layers, monkeypatch)
    hooks_before = len(layers[0]._forward_hooks)
    ids = torch.randint(0, 100, (2, 17))
    model(input_ids=ids, labels=ids).loss.backward()
    assert order[:3] == ["layer 0", "count", "layer 1"], order
    assert len(layers[0]._forward_hooks) == hooks_before


def test_labelled_rows_selects_the_labelled_rows_in_order(monkeypatch):
    """``LabelledRows``: the labelled rows of hidden and labels, in their order, when at least ``MIN_DROPPED`` of
    the rows are ignored; everything untouched below that, when nothing is labelled, and while compiling. The
    loss over the selected rows and its gradient equal the loss over all rows."""
    from fusepatch.layers.support import labelled_rows
    from fusepatch.layers.support.labelled_rows import LabelledRows

    h, w, y = _data(tokens=64)  # every 5th label ignored: 13 of 64
    rows = LabelledRows(y.view(2, 32))
    assert rows.kept() == 51
    flat, labels = rows.select(h)
    keep = (y != -100).nonzero().flatten()
    assert torch.equal(labels, y[keep]) and torch.equal(flat, h[keep])
    full = lce.linear_cross_entropy_reference(h, w, y)
    part = lce.linear_cross_entropy_reference(flat, w, labels)
    torch.testing.assert_close(part, full, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(part, (h, w)), torch.autograd.grad(full, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    few = y.clone()
    few[few == -100] = 1
    few[0] = -100  # 1 of 64 ignored: below MIN_DROPPED, not worth a copy
    rows = LabelledRows(few)
    assert rows.kept() is None and rows.select(h)[0] is h
    rows = LabelledRows(torch.full_like(y, -100))  # nothing labelled: the loss is 0 over all rows, as before
    assert rows.kept() is None and rows.select(h)[0] is h
    monkeypatch.setattr(labelled_rows.torch.compiler, "is_compiling", lambda: True)
    rows = LabelledRows(y)  # a traced graph keeps every row (no data-dependent shapes)
    assert rows.kept() is None and rows.select(h)[0] is h


def test_causal_lm_loss_runs_on_the_labelled_rows_only(chunked_on_cpu, monkeypatch):
    """A prompt-masked batch: the patched model's loss op gets the labelled rows only, and loss and every
    gradient match the unpatched model on the same labels (``_fused_loss_matches_the_unpatched_model``)."""
    seen = []
    op = OPS["linear_cross_entropy"]
    chunked = op.candidates[0]

    def load():
        fn = chunked.load()

        def spy(hidden, weight, labels, **kwargs):
            seen.append(hidden.shape[0])
            return fn(hidden, weight, labels, **kwargs)

        return spy

    monkeypatch.setitem(
        OPS, "linear_cross_entropy", dataclasses.replace(op, candidates=(dataclasses.replace(chunked, load=load),))
    )
    selftest.clear_cache()
    _fused_loss_matches_the_unpatched_model(tiny_model("qwen3"), tiny_model("qwen3"), length=33, ignored=20)
    # 2 rows of 33: 19 prompt labels and the last position ignored in each, 26 rows left; the self-test's own
    # calls (fresh random inputs) come first
    assert 26 in seen and 66 not in seen[-3:], seen


def test_labelled_rows_are_counted_after_the_first_decoder_layer(chunked_on_cpu, monkeypatch):
    """The count is queued once layer 0's forward is (the GPU then has work ahead of the host; a synced step's
    GPU waited on each of its launches before the forward), once a forward, and the hook is gone afterwards, also
    when the forward raises. A ``LabelledRows`` nobody started counts when the loss reads it."""
    from fusepatch.layers.support import labelled_rows

    model = tiny_model("qwen3")
    fusepatch.apply(model)
    layers = model.model.layers
    order = _record_count_order(layers, monkeypatch)
    hooks_before = len(layers[0]._forward_hooks)
    ids = torch.randint(0, 100, (2, 17))
    model(input_ids=ids, labels=ids).loss.backward()
    assert order[:3] == ["layer 0", "count", "layer 1"], order
    assert order.count("count") == 2  # the hook's start, and kept()'s call, which finds it started
    assert len(layers[0]._forward_hooks) == hooks_before

    def fail(*_):
        raise RuntimeError("a layer failed")

    handle = layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a layer failed"):
        model(input_ids=ids, labels=ids)
    handle.remove()
    assert len(layers[0]._forward_hooks) == hooks_before

    rows = labelled_rows.LabelledRows(ids, shift=True, start=False)
    assert rows.kept() == 32 and rows._started  # counted on reading: 2 rows of 16 labelled positions

    # a layer whose hooks run traced (layer.compile()): the hook leaves the count to the loss, outside the trace
    from fusepatch.layers.causal_lm import _count_after_first_layer

    rows = labelled_rows.LabelledRows(ids, shift=True, start=False)
    handle = _count_after_first_layer(model.model, rows)
    hook = layers[0]._forward_hooks[handle.id]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    hook(layers[0], (), None)
    assert not rows._started
    # and a traced causal-LM forward registers no hook at all (its count is off)
    rows = labelled_rows.LabelledRows(ids, shift=True, start=False)
    assert _count_after_first_layer(model.model, rows) is None and rows._started and rows._count is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    handle.remove()
    assert len(layers[0]._forward_hooks) == hooks_before


class _WeightShapedGemms(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products whose result has the lm_head weight's shape (its gradient's GEMMs)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default, torch.ops.aten.mm.out):
            if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
                self.count += 1
        return out


@pytest.mark.parametrize("path", ["chunked", "fla-loop"])
def test_a_frozen_lm_head_gets_no_weight_gradient_gemm(monkeypatch, path):
    """LoRA freezes the lm_head: the fused loss computes the hidden-state gradient alone (a vocab x hidden x
    tokens GEMM and a vocab x hidden buffer less per step), equal to the reference's; a trainable head gets both."""
    if path == "chunked":
        monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 777 * 64)
        fn, dtype = lce.linear_cross_entropy_chunked, torch.float64
    else:
        (fn, _), dtype = _fla_loop(monkeypatch, 1), torch.float32
    h, w, y = _data(dtype=dtype)
    w.requires_grad_(False)
    with _WeightShapedGemms(w.shape) as frozen:
        out = fn(h, w, y)
        (gh,) = torch.autograd.grad(out * 0.5, (h,))
    (want,) = torch.autograd.grad(lce.linear_cross_entropy_reference(h, w, y) * 0.5, (h,))
    torch.testing.assert_close(gh, want, rtol=1e-5, atol=1e-7)
    assert frozen.count == 0
    w.requires_grad_(True)
    with _WeightShapedGemms(w.shape) as trainable:
        torch.autograd.grad(fn(h, w, y), (h, w))
    assert trainable.count > 0  # the counter sees the weight gradient's GEMMs where they run
