"""Qwen3.5 / Qwen3-Next gated attention through fusepatch's forward, on CPU.

No fused kernel runs on a CPU, so a stand-in candidate (the eager reference, recording what it was given) plays
the fused output gate: the layer then takes fusepatch's gated forward (q/k/v through the shared-input
projections, the gate half of ``q_proj`` left in place), which must equal the layer transformers ships: loss,
logits and every parameter gradient, with eager and sdpa attention, under activation checkpointing, on both
supported transformers releases (CI runs the oldest and the newest). Calls with a cache keep transformers'
forward. The kernel itself is checked in the interpreter (test_kernels.py) and on the GPU (tests/gpu).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import HYBRID, assert_same_training, lm_batch, loss_and_grads, training_model

import fusepatch
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.layers import attention
from fusepatch.layers.support import projections
from fusepatch.ops import OPS
from fusepatch.tools.tiny import tiny_model

GATED = HYBRID  # the families with gated attention


@pytest.fixture
def gates(monkeypatch):
    """The attention_gate op gets a CPU stand-in; returns the (shape, stride, contiguous) of each gate it got."""
    seen: list[tuple] = []
    op = OPS["attention_gate"]

    def load():
        def standin(attn, gate):
            seen.append((tuple(gate.shape), gate.stride(), gate.is_contiguous()))
            return op.reference(attn, gate)

        return standin

    candidate = Candidate("cpu-standin", "pip", (), load, inputs=InputRule(devices=("cpu",)))
    monkeypatch.setitem(OPS, "attention_gate", dataclasses.replace(op, candidates=(candidate,)))
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    selftest.clear_cache()
    yield seen
    selftest.clear_cache()


def _full_attention_layers(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_norm"))


def _in_model(seen: list[tuple]) -> list[tuple]:
    return [call for call in seen if call[0][:2] == (2, 29)]  # the self-test calls it on its own inputs too


@pytest.mark.parametrize("model_type", GATED)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_gated_attention_forward_equals_the_layer_transformers_ships(model_type, implementation, checkpointing, gates):
    model = training_model(model_type, checkpointing, attn_implementation=implementation)
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    shared = []
    plain_apply = projections._SharedInputLinears.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(projections._SharedInputLinears, "apply", lambda *a: shared.append(a[1]) or plain_apply(*a))
        report = fusepatch.apply(model)
        got = loss_and_grads(model, **batch)
    chosen = {c.op: c.chosen for layer in report.layers if layer.layer.endswith("Attention") for c in layer.choices}
    assert chosen["attention_gate"] == "cpu-standin"
    layers = _full_attention_layers(model)
    passes = 2 if checkpointing else 1
    ran = _in_model(gates)
    assert len(ran) == passes * layers, f"the gate ran {len(ran)} times for {layers} full-attention layers"
    config = model.config
    heads, dim = config.num_attention_heads, config.head_dim
    for shape, stride, contiguous in ran:
        # the gate half of q_proj's output, as a view: its heads 2 x head_dim apart, no copy made
        assert shape == (2, 29, heads, dim) and stride[-2:] == (2 * dim, 1) and not contiguous
    assert shared.count(3) == passes * layers, "q/k/v through the shared-input projections in each gated layer"
    assert_same_training(expected, got)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_cached_generation_through_the_gated_forward(model_type, gates):
    """Generation: the gated forward updates the cache as the release's forward does (5.17 and later pass
    different arguments) and generates the same tokens."""
    model = tiny_model(model_type).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    fusepatch.apply(model)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)
    lengths = [shape[1] for shape, _, _ in gates if shape[0] == 1]
    layers = _full_attention_layers(model)
    assert lengths == [12] * layers + [1] * 5 * layers, lengths  # the prompt, then one token a step


def test_a_gated_call_needs_named_arguments_and_a_double_width_q_proj():
    model = tiny_model("qwen3_5_text")
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5Attention")
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    cos_sin = (torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    assert attention._gated_call(layer, (hidden, cos_sin, None), {}) is not None
    assert attention._gated_call(layer, (), {"hidden_states": hidden, "position_embeddings": cos_sin}) is not None
    assert attention._gated_call(layer, (hidden, cos_sin, None, None, object()), {}) is None
    assert attention._gated_call(layer, (hidden,), {}) is None
    layer.q_proj = torch.nn.Linear(model.config.hidden_size, 8)
    assert attention._gated_call(layer, (hidden, cos_sin, None), {}) is None


def test_mixed_dtypes_take_transformers_arithmetic():
    """An attention output and a gate of different dtypes (no kernel pairs them) are multiplied as transformers
    does, with torch's promotion; the op is not asked."""

    class Dispatch:
        def __call__(self, *args):
            raise AssertionError("the op must not be called for mixed dtypes")

    layer = type("Layer", (), {"_fusepatch": type("State", (), {"ops": {"attention_gate": Dispatch()}})()})()
    attn = torch.randn(2, 5, 8)
    gate = torch.randn(2, 5, 2, 4, dtype=torch.float64)
    out = attention._gate(layer, attn, gate)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, attn * torch.sigmoid(gate.reshape(2, 5, 8)))
