"""The patched attention forward sends transformers' rotary call to the chosen kernel, in every family, and
leaves everything else (and the modeling module afterwards) as it was. On CPU a stand-in kernel (the reference,
counting its calls) takes the place of the Triton one; the kernel itself is tested in test_kernels.py."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch
from helpers import assert_released, grads, transformers_own

import fusepatch
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.ops.rotary import unsupported
from fusepatch.ops.rotary.reference import rotary_reference
from fusepatch.tools.tiny import FAMILIES, tiny_model

CALLS = []
BEFORE_CALL = []  # hooks a test runs inside the stand-in kernel


def _stand_in(q, k, cos, sin):
    for hook in BEFORE_CALL:
        hook()
    CALLS.append(tuple(q.shape))
    return rotary_reference(q, k, cos, sin)


@pytest.fixture
def rotary_on_cpu(monkeypatch):
    cpu = InputRule(devices=("cpu",), dtypes=("float32",), kernel="stand-in rotary")
    candidate = Candidate("stand-in", "pip", (), lambda: _stand_in, inputs=cpu)
    monkeypatch.setitem(OPS, "rotary", dataclasses.replace(OPS["rotary"], candidates=(candidate,)))
    selftest.clear_cache()
    CALLS.clear()
    yield
    selftest.clear_cache()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_patched_attention_uses_the_kernel_and_matches(rotary_on_cpu, model_type):
    reference, model = tiny_model(model_type), tiny_model(model_type)
    module = sys.modules[type(model.model.layers[-1]).__module__]
    transformers_function = transformers_own(module, "apply_rotary_pos_emb")
    report = fusepatch.apply(model)
    attention = [layer for layer in report.layers if layer.layer.endswith("Attention")]
    rotary = [c for layer in attention for c in layer.choices if c.op == "rotary"]
    assert attention and rotary and all(c.chosen == "stand-in" for c in rotary), attention
    ids = torch.randint(0, 512, (2, 23))
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    CALLS.clear()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    full_layers = sum(layer.count for layer in attention)
    assert len(CALLS) == full_layers  # one call per attention layer, each through the stand-in
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
    g_ref, g = grads(reference), grads(model)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # the modeling module's function is transformers' own again once the model is reverted
    fusepatch.revert(model)
    assert_released(module, "apply_rotary_pos_emb", transformers_function)


def test_the_binding_is_undone_when_the_forward_raises(rotary_on_cpu):
    from fusepatch.layers import attention as patched_attention
    from fusepatch.layers.support import bindings

    model = tiny_model("qwen3")
    module = sys.modules[type(model.model.layers[0]).__module__]
    original = transformers_own(module, "apply_rotary_pos_emb")
    fusepatch.apply(model)
    attention = model.model.layers[0].self_attn
    with pytest.raises(TypeError):  # no position embeddings: fails inside the forward, after the binding
        attention(hidden_states=torch.randn(1, 4, 64), position_embeddings=None, attention_mask=None)
    # this thread's choice is cleared: another model's call in the same module runs transformers' function
    assert bindings.active(patched_attention.ROTARY_SLOT) is None
    fusepatch.revert(model)
    assert_released(module, "apply_rotary_pos_emb", original)


def test_calls_the_kernel_cannot_reproduce_exactly_keep_transformers_function():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    cos = torch.randn(1, 5, 8)
    assert unsupported(q, k, cos, cos.clone()) is None
    assert "dtypes" in unsupported(q, k, cos.double(), cos.double())  # eager would promote to fp64
    assert "rotary dim" in unsupported(q, k, torch.randn(1, 5, 7), torch.randn(1, 5, 7))
    assert "require grad" in unsupported(q, k, cos.requires_grad_(True), cos)
    assert "shapes" in unsupported(q[0], k, cos, cos)


def test_rotary_self_test_compares_both_outputs(monkeypatch):
    """The self-test checks q's and k's rotation (two outputs): a kernel that gets k wrong is refused."""
    cpu = InputRule(devices=("cpu",), dtypes=("float32",))

    def wrong_k(q, k, cos, sin):
        rq, rk = rotary_reference(q, k, cos, sin)
        return rq, rk * 1.01

    op = OPS["rotary"]
    selftest.clear_cache()
    ok = selftest.run(
        op, Candidate("good", "pip", (), lambda: rotary_reference, inputs=cpu), rotary_reference, "cpu", "float32"
    )
    bad = selftest.run(op, Candidate("bad", "pip", (), lambda: wrong_k, inputs=cpu), wrong_k, "cpu", "float32")
    assert ok.ok and not bad.ok and "differs from the reference" in bad.reason
    selftest.clear_cache()


def test_threads_share_the_binding_and_each_gets_the_kernel(rotary_on_cpu):
    """nn.DataParallel runs replicas in threads. Thread A pauses inside its first rotary call (holding the
    binding); thread B enters its first attention layer then and pauses before its rotary call (at q_proj) until
    A's whole forward is done. B's rotary call must still reach the kernel (A's return must not undo a binding B
    is inside), and the modeling module's function is transformers' own once both models are reverted."""
    model_a, model_b = tiny_model("qwen3"), tiny_model("qwen3")
    module = sys.modules[type(model_a.model.layers[0]).__module__]
    transformers_function = transformers_own(module, "apply_rotary_pos_emb")
    fusepatch.apply(model_a)
    fusepatch.apply(model_b)
    layers = len(model_a.model.layers)
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()

    def pause_a_once():
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()
            assert b_inside.wait(60)

    def pause_b_before_rotary(*_):
        if not b_inside.is_set():
            b_inside.set()
            assert a_done.wait(60)

    BEFORE_CALL.append(pause_a_once)
    hook = model_b.model.layers[0].self_attn.q_proj.register_forward_pre_hook(pause_b_before_rotary)
    ids = torch.randint(0, 512, (1, 9))
    errors = []

    def run(model, done=None):
        try:
            with torch.no_grad():
                model(input_ids=ids)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    a = threading.Thread(target=run, args=(model_a, a_done), name="A")
    b = threading.Thread(target=run, args=(model_b,), name="B")
    try:
        a.start()
        assert a_inside.wait(60)
        b.start()
        b.join(60)
        a.join(60)
    finally:
        BEFORE_CALL.clear()
        hook.remove()
    assert not errors, errors
    calls = [shape for shape in CALLS if shape[0] == 1 and shape[2] == ids.shape[1]]  # not the self-test's
    assert len(calls) == 2 * layers  # every attention layer of both threads through the kernel
    fusepatch.revert(model_a)
    assert module.apply_rotary_pos_emb is not transformers_function  # model_b still holds it
    fusepatch.revert(model_b)
    assert_released(module, "apply_rotary_pos_emb", transformers_function)
