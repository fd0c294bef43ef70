"""The foreign module-level names rows declare (``Row.bindings``): installed once by ``apply``, released by
``revert`` and by the next ``apply`` or ``revert`` after a model is dropped, and inert outside a patched layer."""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import threading
import types

import pytest
import torch
from helpers import FAMILIES, HYBRID, cpu_candidates

import fusepatch
from fusepatch.base.row import Binding
from fusepatch.base.state import ProcessState, current, fresh
from fusepatch.layers import attention
from fusepatch.layers.support import bindings
from fusepatch.ops import OPS
from fusepatch.tools.tiny import tiny_model

PAIR = (next(f for f in FAMILIES if f not in HYBRID), HYBRID[0])  # attention names; the GDN guards too
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
WRAPPED_OPS = ("rotary", "varlen_attention")  # the ops the attention names' wrappers call


@pytest.fixture
def stand_ins(monkeypatch):
    """CPU stand-ins for the ops the wrappers call (their references), so that the wrappers have work to do on the
    CPU; returns the list of their calls."""
    yield cpu_candidates(monkeypatch, {name: OPS[name].reference for name in WRAPPED_OPS})
    from fusepatch.engine import selftest

    selftest.clear_cache()


def _declared(model) -> dict[tuple[str, str], list[torch.nn.Module]]:
    """(module, name) -> the patched modules of ``model`` whose rows declare it."""
    found: dict[tuple[str, str], list[torch.nn.Module]] = {}
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        for binding in state.row.bindings if state is not None else ():
            found.setdefault((binding.module, binding.name), []).append(module)
    return found


def _now(keys) -> dict[tuple[str, str], object]:
    return {key: getattr(sys.modules[key[0]], key[1]) for key in keys}


def _calls(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits of a plain call, a packed one and (for the hybrid models) one that fills a cache."""
    with torch.no_grad():
        out = {
            "plain": model(input_ids=ids, use_cache=False).logits,
            "packed": model(input_ids=ids, position_ids=PACKED, use_cache=False).logits,
        }
        if getattr(model.config, "layer_types", None):  # transformers' GDN forward, through the guarded names
            out["cache"] = model(input_ids=ids, use_cache=True).logits
    return out


@pytest.mark.parametrize("model_type", PAIR)
def test_apply_installs_the_declared_names_and_revert_puts_them_back(model_type):
    model = tiny_model(model_type, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    assert current().bindings == {}
    fusepatch.apply(model)
    declared = _declared(model)
    assert {name for _, name in declared} >= {attention.ROTARY, attention.INTERFACES, "find_packed_sequence_indices"}
    ledger = current().bindings
    assert set(ledger) == set(declared)
    originals = {key: installed.original for key, installed in ledger.items()}
    for key, holders in declared.items():  # in place at apply, before any forward
        assert getattr(sys.modules[key[0]], key[1]) is ledger[key].wrapper is not originals[key]
        assert set(ledger[key].holders) == set(holders)
    installed = _now(declared)
    _calls(model, ids)
    assert all(_now(declared)[key] is installed[key] for key in declared)  # the calls bind nothing
    fusepatch.revert(model)
    assert current().bindings == {}
    assert all(now is originals[key] for key, now in _now(declared).items())


@pytest.mark.parametrize("model_type", PAIR)
def test_an_unpatched_twin_computes_exactly_as_transformers(model_type, stand_ins):
    """Another model of the same classes in the process, called while the wrappers are installed, gets
    transformers' objects' results bit for bit and reaches none of fusepatch's ops; the patched one does."""
    model = tiny_model(model_type, attn_implementation="sdpa")
    twin = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    before = _calls(twin, ids)
    fusepatch.apply(model)
    assert current().bindings
    stand_ins.clear()
    _calls(model, ids)
    assert set(WRAPPED_OPS) <= {op for op, *_ in stand_ins}  # the wrappers work inside its layers
    stand_ins.clear()
    after = _calls(twin, ids)
    assert stand_ins == []
    for call, logits in before.items():
        assert torch.equal(after[call], logits), call
    fusepatch.revert(model)


def test_revert_of_one_of_two_patched_models_keeps_the_names_the_other_holds(stand_ins):
    first, second = tiny_model("qwen3", attn_implementation="sdpa"), tiny_model("qwen3", attn_implementation="sdpa")
    ids = torch.randint(0, first.config.vocab_size, (1, 9))
    fusepatch.apply(first), fusepatch.apply(second)
    declared = _declared(second)
    wrappers = _now(declared)
    originals = {key: current().bindings[key].original for key in declared}
    fusepatch.revert(first)
    assert all(_now(declared)[key] is wrappers[key] for key in declared)
    assert all(set(current().bindings[key].holders) == set(declared[key]) for key in declared)
    stand_ins.clear()
    _calls(second, ids)
    assert set(WRAPPED_OPS) <= {op for op, *_ in stand_ins}
    fusepatch.revert(second)
    assert all(_now(declared)[key] is originals[key] for key in declared) and current().bindings == {}


def test_a_model_dropped_without_revert_is_released_at_the_next_apply_or_revert():
    """No finalizer: the ledger holds its modules weakly, and the next ``apply`` or ``revert`` in the process puts
    back what nobody holds. Until then the wrappers stay, inert (no thread is inside a layer of that model)."""
    dropped = tiny_model("qwen3")
    fusepatch.apply(dropped)
    declared = list(_declared(dropped))
    originals = {key: current().bindings[key].original for key in declared}
    wrappers = _now(declared)
    del dropped
    gc.collect()  # a patched module is in a reference cycle with its patch state
    assert all(len(current().bindings[key].holders) == 0 for key in declared)
    assert all(_now(declared)[key] is wrappers[key] for key in declared)  # left until the next apply or revert
    model = tiny_model("qwen3")
    fusepatch.apply(model)  # swept first, then installed anew for this model alone
    assert all(_now(declared)[key] is not wrappers[key] for key in declared)
    assert all(set(current().bindings[key].holders) == set(_declared(model)[key]) for key in declared)
    other = tiny_model("qwen3")
    fusepatch.apply(other)
    del other
    gc.collect()
    fusepatch.revert(model)  # the release sweeps the dropped one's holders too
    assert all(_now(declared)[key] is originals[key] for key in declared) and current().bindings == {}
    last = tiny_model("qwen3")
    fusepatch.apply(last)
    del last
    gc.collect()
    fusepatch.revert(tiny_model("qwen2"))  # a revert of a model that holds none of them sweeps as well
    assert all(_now(declared)[key] is originals[key] for key in declared) and current().bindings == {}


def test_copies_hold_the_names_they_run_with(stand_ins):
    """``copy.deepcopy`` and a pickle round trip of a patched model hold its names: reverting the source leaves them
    patched and fused, and the last revert puts transformers' objects back."""
    model = tiny_model("qwen3", attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    fusepatch.apply(model)
    declared = list(_declared(model))
    originals = {key: current().bindings[key].original for key in declared}
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    fusepatch.revert(model)
    for twin in copies:
        assert all(_now(declared)[key] is current().bindings[key].wrapper for key in declared)
        stand_ins.clear()
        _calls(twin, ids)
        assert set(WRAPPED_OPS) <= {op for op, *_ in stand_ins}
        fusepatch.revert(twin)
    assert all(_now(declared)[key] is originals[key] for key in declared) and current().bindings == {}


class _Fused:
    """A rotary dispatch that takes every call and says so."""

    def __init__(self) -> None:
        self.calls = 0

    def choice(self, *args):
        return types.SimpleNamespace(fused=True)

    def __call__(self, q, k, cos, sin):
        self.calls += 1
        return q * 0, k * 0


def test_a_wrapper_works_only_in_the_thread_inside_a_patched_layer():
    model = tiny_model("qwen3")
    fusepatch.apply(model)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = current().bindings[(module.__name__, attention.ROTARY)].original
    q, k, cos, sin = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    expected = original(q, k, cos, sin)
    fused, seen = _Fused(), {}

    def other_thread():
        seen["other"] = module.apply_rotary_pos_emb(q, k, cos, sin)

    with bindings.inside({attention.ROTARY_SLOT: fused}):
        seen["inside"] = module.apply_rotary_pos_emb(q, k, cos, sin)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(30)
    seen["after"] = module.apply_rotary_pos_emb(q, k, cos, sin)
    assert fused.calls == 1 and not seen["inside"][0].any()  # this thread, inside: the dispatch
    for where in ("other", "after"):  # another thread, or outside: transformers' function
        torch.testing.assert_close(seen[where], expected, rtol=0, atol=0)
    fusepatch.revert(model)


def test_torch_compile_of_a_patched_model_installs_nothing():
    """Dynamo traces the patched forwards (the CPU, no fused kernel), which only enter the thread's context: the
    names and the ledger are the ones ``apply`` installed, the compiled model computes as the uncompiled one, and
    after ``revert`` the compiled model is transformers' again."""
    torch._dynamo.reset()
    model = tiny_model("qwen3", num_hidden_layers=1)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    fusepatch.apply(model)
    declared = list(_declared(model))
    installed, ledger = _now(declared), dict(current().bindings)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
        assert all(_now(declared)[key] is installed[key] for key in declared)
        assert all(current().bindings[key] is ledger[key] for key in declared)
        fusepatch.revert(model)
        assert current().bindings == {}
        torch.testing.assert_close(compiled(input_ids=ids).logits, reference(input_ids=ids).logits)
    torch._dynamo.reset()


@pytest.fixture
def fake_module(monkeypatch):
    fake = types.ModuleType("fusepatch_test_bindings_target")
    fake.target = object()
    fake.other = object()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return fake


class _Owner:
    pass


def _wrap(found):
    return ("wrapped", found)


def test_install_is_once_per_name_and_a_later_wrapper_stays_its_owners(fake_module):
    original = fake_module.target
    declared = (Binding(fake_module.__name__, "target", _wrap), Binding(fake_module.__name__, "missing", _wrap))
    first, second = _Owner(), _Owner()
    bindings.install(declared, first)
    wrapper = fake_module.target
    bindings.install(declared, second)
    bindings.install(declared, second)
    assert wrapper == ("wrapped", original) and fake_module.target is wrapper  # one wrapper, two holders
    assert not hasattr(fake_module, "missing") and set(current().bindings) == {(fake_module.__name__, "target")}
    bindings.release(first)
    assert fake_module.target is wrapper
    fake_module.target = theirs = object()  # someone replaced the wrapper since
    bindings.release(second)
    assert fake_module.target is theirs and current().bindings == {}


def test_a_fresh_state_leaves_the_modules_as_it_found_them(fake_module):
    """Bindings belong to the modules of the process: what a :func:`fresh` state installed goes back when it ends,
    over what the state around it installed, which stays."""
    original, owner = fake_module.target, _Owner()
    outer = (Binding(fake_module.__name__, "target", _wrap),)
    bindings.install(outer, owner)
    outer_wrapper = fake_module.target
    with fresh(ProcessState()) as state:
        bindings.install(outer + (Binding(fake_module.__name__, "other", _wrap),), _Owner())
        assert fake_module.target == ("wrapped", outer_wrapper) and len(state.bindings) == 2
    assert fake_module.target is outer_wrapper and not isinstance(fake_module.other, tuple) and state.bindings == {}
    bindings.release(owner)
    assert fake_module.target is original
