"""A cache handed to the Gated DeltaNet layers: filled by the fused path, continued from exactly, and a kernel
fusepatch refused kept out of transformers' own dispatch.

Qwen3.5 configs default to ``use_cache=True``, so a plain training loop hands every linear-attention layer a cache.
The fused forward must run then (a stand-in delta-rule candidate records its calls: the GPU path on the CPU), fill the
cache with the states transformers' own forward would (fp64, same weights), and a continuation from that cache
(several tokens, one token) must give transformers' logits. Where a call still runs transformers' forward, a kernel
the self-test refused must not run inside it: a NaN kernel stands where transformers' dispatch would put fla's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect

import pytest
import torch
from helpers import HYBRID

import fusepatch
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.tools.tiny import tiny_model

HYBRIDS = HYBRID
MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")  # transformers' grouped-GEMM experts take no fp64: fp32 there
TOL = dict(rtol=1e-6, atol=1e-7)  # the layers compute the delta rule in fp32 (as transformers' torch code does)
TOL32 = dict(rtol=2e-5, atol=2e-6)
DTYPES = ("bfloat16", "float16", "float32", "float64")


def _stand_in(monkeypatch, op_name: str, body) -> list[dict]:
    """The op's only candidate: ``body(reference)`` on the CPU, recording the keyword arguments of each call the
    model makes (not its self-test's, which run on inputs of their own)."""
    op = OPS[op_name]
    calls: list[dict] = []

    def load():
        inner = body(op.reference)

        def standin(*args, **kwargs):
            if not any(frame.function == "_compare_case" for frame in inspect.stack(0)[1:6]):
                calls.append(kwargs)
            return inner(*args, **kwargs)

        return standin

    candidate = Candidate("cpu-standin", "pip", (), load, inputs=InputRule(devices=("cpu",), dtypes=DTYPES))
    monkeypatch.setitem(OPS, op_name, dataclasses.replace(op, candidates=(candidate,)))
    selftest.clear_cache()
    return calls


def _pair(model_type: str):
    reference = tiny_model(model_type)
    reference = reference if model_type in MOE_TYPES else reference.double()
    patched = copy.deepcopy(reference)
    fusepatch.apply(patched)
    return reference, patched


def _states(cache) -> list[torch.Tensor]:
    found = []
    for layer in cache.layers:
        if getattr(layer, "recurrent_states", None) is not None and layer.recurrent_states[0] is not None:
            found += [layer.conv_states[0], layer.recurrent_states[0]]
    assert found, "no linear-attention states in the cache"
    return found


def _assert_same_cache(cache, expected, tol: dict) -> None:
    assert cache.get_seq_length() == expected.get_seq_length()
    for index, (got, want) in enumerate(zip(_states(cache), _states(expected), strict=True)):
        torch.testing.assert_close(got, want, **tol, msg=f"cache state {index}")


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_training_with_the_default_cache_runs_fused_and_fills_it(monkeypatch, caplog, model_type):
    """``use_cache`` left as the config has it (True): the fused delta rule runs, asked for its final states; the
    loss, every gradient and the cache equal transformers'; a continuation from the cache (several tokens, then
    one) gives transformers' logits."""
    calls = _stand_in(monkeypatch, "gated_delta_rule", lambda reference: reference)
    reference, patched = _pair(model_type)
    tol = TOL32 if model_type in MOE_TYPES else TOL
    assert reference.config.use_cache
    ids = torch.randint(0, reference.config.vocab_size, (2, 23))
    reference.train(), patched.train()
    expected = reference(input_ids=ids, labels=ids)
    got = patched(input_ids=ids, labels=ids)
    assert calls and all(call.get("output_final_state") for call in calls), calls
    torch.testing.assert_close(got.loss, expected.loss, **tol)
    expected.loss.backward(), got.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4 if tol is TOL32 else 1e-5, atol=tol["atol"], msg=name)
    _assert_same_cache(got.past_key_values, expected.past_key_values, tol)
    assert not [
        r for r in caplog.records if "cached path" in r.getMessage() or "transformers' forward" in r.getMessage()
    ]
    assert fusepatch.report(patched).transformers_calls == ()

    reference.eval(), patched.eval()
    cache, expected_cache = got.past_key_values, expected.past_key_values
    with torch.no_grad():
        for length in (5, 1):  # a prefill continued, then a decode step
            more = torch.randint(0, reference.config.vocab_size, (2, length))
            want = reference(input_ids=more, past_key_values=expected_cache, use_cache=True)
            have = patched(input_ids=more, past_key_values=cache, use_cache=True)
            torch.testing.assert_close(have.logits, want.logits, **tol)
            _assert_same_cache(have.past_key_values, want.past_key_values, tol)
    assert calls[-1].get("initial_state") is not None  # the continuation started from the cached state


def test_left_padded_prefill_and_generation_match(monkeypatch):
    """Left padding (generation's): the padded prefill fills the cache as transformers does, and greedy decoding
    from it gives transformers' tokens and logits."""
    _stand_in(monkeypatch, "gated_delta_rule", lambda reference: reference)
    reference, patched = _pair("qwen3_5_text")
    reference.eval(), patched.eval()
    ids = torch.randint(1, reference.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(
        attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    want = reference.generate(ids, **kwargs)
    have = patched.generate(ids, **kwargs)
    assert torch.equal(have.sequences, want.sequences)
    for got, expected in zip(have.logits, want.logits, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_a_packed_row_keeps_its_last_documents_states(monkeypatch):
    """Packed documents (``cu_seq_lens_q``) with a cache: each layer keeps the state and conv inputs of the row's last
    document, the states that document alone gives, so a continuation does not see the documents before it."""
    _stand_in(monkeypatch, "gated_delta_rule", lambda reference: reference)
    _, patched = _pair("qwen3_5_text")
    patched.eval()
    from transformers import DynamicCache

    layer = patched.model.layers[0].linear_attn
    hidden = torch.randn(1, 20, patched.config.hidden_size, dtype=torch.float64)
    cu = torch.tensor([0, 17, 20], dtype=torch.int32)  # the last document shorter than the conv window
    packed, alone = DynamicCache(config=patched.config), DynamicCache(config=patched.config)
    with torch.no_grad():
        out = layer(hidden, packed, cu_seq_lens_q=cu)
        last = layer(hidden[:, 17:], alone)
    torch.testing.assert_close(out[:, 17:], last, **TOL)
    got, want = packed.layers[0], alone.layers[0]
    torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0], **TOL)
    torch.testing.assert_close(got.conv_states[0], want.conv_states[0], **TOL)


def _nan_dispatch(module, name: str):
    """transformers' dispatching function as it is where a package's kernel imports (its torch code kept as
    ``__wrapped__``), with a kernel that returns NaN in the package's place."""
    current = getattr(module, name)
    inner = getattr(current, "__wrapped__", None)
    if inner is None:  # the kernels package made it a module: its forward closes over transformers' function
        import inspect

        inner = inspect.getclosurevars(type(current).forward).nonlocals["func"].__wrapped__

    @functools.wraps(inner)
    def dispatch(*args, **kwargs):
        dispatch.calls += 1
        out, state = inner(*args, **kwargs)
        return out * float("nan"), state

    dispatch.calls = 0
    return dispatch


@pytest.fixture
def refused_delta_rule(monkeypatch):
    """fusepatch's delta-rule candidate returns NaN (its self-test refuses it: eager), and transformers' dispatch of
    the Qwen3.5 modeling module runs a NaN kernel too, as it would run an installed fla that fusepatch refused."""
    _stand_in(monkeypatch, "gated_delta_rule", lambda reference: lambda *a, **k: _nan(reference(*a, **k)))
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    dispatches = []
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        dispatch = _nan_dispatch(module, name)
        monkeypatch.setattr(module, name, dispatch)
        dispatches.append(dispatch)
    return module, dispatches


def _nan(out):
    return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")


def test_a_refused_kernel_runs_nowhere_in_a_default_training_step(refused_delta_rule):
    """The issue's case: fla's delta rule refused by the self-test (NaN), a training step with the config's cache:
    the loss is finite and the report says eager; neither fusepatch's nor transformers' dispatch ran the kernel."""
    _, dispatches = refused_delta_rule
    reference, patched = _pair("qwen3_5_text")
    patched.train()
    ids = torch.randint(0, patched.config.vocab_size, (2, 17))
    report = fusepatch.report(patched)
    chosen = {c.op: c for layer in report.layers for c in layer.choices}
    assert not chosen["gated_delta_rule"].fused
    assert "NaN" in chosen["gated_delta_rule"].reason_text()
    loss = patched(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    assert sum(d.calls for d in dispatches) == 0


def test_transformers_forward_keeps_a_refused_kernel_out_and_says_so(refused_delta_rule, caplog):
    """A call the fused path hands to transformers' forward (a cache recording past states, as speculative decoding
    uses) runs transformers' torch code for the refused op, not the NaN kernel in its dispatch; the log and the
    report say which calls ran there and what its dispatch ran; revert puts transformers' names back."""
    module, dispatches = refused_delta_rule
    reference, patched = _pair("qwen3_5_text")
    patched.eval()
    from transformers import DynamicCache

    ids = torch.randint(0, patched.config.vocab_size, (1, 11))
    cache = DynamicCache(config=patched.config)
    with torch.no_grad():
        patched(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                try:  # transformers >= 5.2x also keeps the last few tokens' states to roll back to
                    layer.activate_past_recording(recurrent_states_to_keep=2)
                except TypeError:
                    layer.activate_past_recording()
        out = patched(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()
    assert sum(d.calls for d in dispatches) == 0
    lines = fusepatch.report(patched).transformers_calls
    assert lines and all("records past states" in line for line in lines), lines
    said = [r.getMessage() for r in caplog.records if "transformers' forward" in r.getMessage()]
    assert len(said) == 1 and "refused by fusepatch" in said[0], said
    guarded = module.torch_chunk_gated_delta_rule
    assert guarded is not dispatches[0]  # a guard stands in front of transformers' dispatch while patched
    fusepatch.revert(patched)
    assert module.torch_chunk_gated_delta_rule is dispatches[0]
