"""What ``apply`` leaves in the process and on the model: ``revert`` restores transformers' modules exactly, no call
rebinds their names, and a patched model copies, pickles and saves as a patched model."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import sys

import pytest
import torch
from helpers import ONE_OF_EACH, TESTS

import fusepatch
from fusepatch.tools.tiny import tiny_model

FAMILIES = ONE_OF_EACH


def _module_names() -> dict[tuple[str, str], object]:
    """Every module-level name of transformers' loaded modules, by identity."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers") and module is not None:
            for attr, value in list(vars(module).items()):
                found[(name, attr)] = value
    return found


def _changed(before: dict, after: dict) -> list:
    return sorted(key for key in before.keys() | after.keys() if before.get(key) is not after.get(key))


REVERT_SCRIPT = """
import sys, torch, fusepatch
from fusepatch.tools.tiny import tiny_model
sys.path[:0] = [{tests!r}, {here!r}]
from test_process_state import _changed, _module_names

for model_type in {families!r}:
    model = tiny_model(model_type).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]]).expand(2, 9)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # every lazy import transformers makes
    model(input_ids=ids, labels=ids, position_ids=packed, use_cache=False)
    before = _module_names()
    fusepatch.apply(model)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model(input_ids=ids, labels=ids, position_ids=packed, use_cache=False)
    assert _changed(before, _module_names()), "nothing bound: the test would prove nothing"
    fusepatch.revert(model)
    assert _changed(before, _module_names()) == [], (model_type, _changed(before, _module_names()))
print("restored")
"""


@pytest.mark.slow
def test_revert_restores_transformers_modules():
    """In a fresh interpreter (no patched model of another test alive): after ``revert`` every module-level name
    of transformers is the object it was before ``apply`` (a wrapped packed-rows check stayed behind)."""
    import subprocess

    script = REVERT_SCRIPT.format(tests=str(TESTS), here=str(TESTS / "engine"), families=FAMILIES)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "restored" in done.stdout, done.stderr[-3000:]


def test_calls_do_not_rebind_module_names(monkeypatch, chunked_on_cpu):
    """transformers' module-level names are bound once while patched, not set and reset around every call."""
    model = tiny_model("qwen3").train()
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model(input_ids=ids, labels=ids, use_cache=False)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    writes = []

    class Watch(type(module)):
        def __setattr__(self, name, value):
            writes.append(name)
            super().__setattr__(name, value)

    monkeypatch.setattr(module, "__class__", Watch)
    model(input_ids=ids, labels=ids, use_cache=False)
    assert writes == []


def test_revert_keeps_bindings_another_patched_model_holds(chunked_on_cpu):
    gc.collect()
    first, second = tiny_model("qwen3"), tiny_model("qwen3")
    fusepatch.apply(first), fusepatch.apply(second)
    ids = torch.randint(0, first.config.vocab_size, (1, 7))
    first(input_ids=ids), second(input_ids=ids)
    module = sys.modules[type(first.model.layers[0].self_attn).__module__]
    bound = module.apply_rotary_pos_emb
    fusepatch.revert(first)
    assert module.apply_rotary_pos_emb is bound  # the second still holds it
    fusepatch.revert(second)
    assert module.apply_rotary_pos_emb is not bound


def test_a_model_collected_without_revert_gives_transformers_names_back(chunked_on_cpu):
    """A patched model dropped without ``revert`` (a notebook's second model, a test's) leaves no wrapper in
    transformers' modules once the garbage collector takes it, while another patched model alive keeps its binding."""
    from helpers import transformers_own

    from fusepatch.layers.support import bindings

    first, second = tiny_model("qwen3"), tiny_model("qwen3")
    module = sys.modules[type(first.model.layers[0].self_attn).__module__]
    names = ("apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS")
    originals = {name: transformers_own(module, name) for name in names}
    if any(len(bindings._holders.get((module.__name__, name), ())) for name in names):
        pytest.skip("a patched model of another test is alive and holds these bindings")
    fusepatch.apply(first), fusepatch.apply(second)
    ids = torch.randint(0, first.config.vocab_size, (1, 7))
    first(input_ids=ids), second(input_ids=ids)
    bound = {name: getattr(module, name) for name in names}
    assert all(bound[name] is not originals[name] for name in names), "nothing bound: the test would prove nothing"
    del first
    gc.collect()
    assert all(getattr(module, name) is bound[name] for name in names)  # the second still holds them
    del second
    gc.collect()
    assert all(getattr(module, name) is originals[name] for name in names)


def test_a_holder_collected_while_bindings_are_busy_is_swept_after(monkeypatch):
    """The collector may run inside ``hold`` or ``release`` (any allocation there can start it), on the thread that
    holds their lock: the finalizer does not wait for the lock, and the name comes back once the lock is free."""
    import types

    from fusepatch.layers.support import bindings

    fake = types.ModuleType("fusepatch_test_fake_module")
    fake.target = original = object()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Owner:
        pass

    owners = [Owner(), Owner()]
    assert all([bindings.hold(owner, fake.__name__, "target", lambda found: ("wrapped", found)) for owner in owners])
    wrapper = fake.target
    assert wrapper == ("wrapped", original)
    owners.pop()
    assert fake.target is wrapper  # one holder left
    with bindings._locked():
        owners.pop()  # the last holder goes while the lock is taken: nothing can be restored yet
        assert fake.target is wrapper
    assert fake.target is original and (fake.__name__, "target") not in bindings._installed


def test_a_holder_collected_while_torch_compile_works_is_swept_after(monkeypatch):
    """The collector may run inside dynamo's own work on a frame, which guards the module-level names it read: a
    name put back under it failed the compile (a guard on the wrapper's closure found transformers' function). The
    name comes back at the next sweep after the compile (``apply`` and ``revert`` start with one)."""
    import types

    from torch._guards import TracingContext, tracing

    from fusepatch.layers.support import bindings

    fake = types.ModuleType("fusepatch_test_fake_compiled_module")
    fake.target = original = object()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Owner:
        pass

    owners = [Owner()]
    assert bindings.hold(owners[0], fake.__name__, "target", lambda found: ("wrapped", found))
    wrapper = fake.target
    with tracing(TracingContext(None)):
        owners.pop()
        gc.collect()
        assert fake.target is wrapper  # left as dynamo saw it
    bindings.sweep()
    assert fake.target is original and (fake.__name__, "target") not in bindings._installed


def test_hold_under_torch_compile_reads_no_weak_set_of_holders(monkeypatch):
    """Traced by torch.compile (a patched attention layer's forward calls ``hold``), a binding whose wrapper is in
    place is taken as held without reading its holders: dynamo guarded that weak set's members by position, and a
    member collected while it built the guards failed the compile (``IndexError`` in guard building). A name
    replaced since by someone else takes the usual path, which binds it again."""
    import types

    from fusepatch.layers.support import bindings

    fake = types.ModuleType("fusepatch_test_fake_traced_module")
    fake.target = object()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Owner:
        pass

    first, second = Owner(), Owner()
    assert bindings.hold(first, fake.__name__, "target", lambda found: ("wrapped", found))

    class Unreadable(dict):
        def get(self, *args):
            raise AssertionError("the holders were read while compiling")

    monkeypatch.setattr(bindings, "_holders", Unreadable(bindings._holders))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert bindings.hold(second, fake.__name__, "target", lambda found: ("wrapped", found))
    wrapper, fake.target = fake.target, object()  # replaced since by someone else: not taken as held
    with pytest.raises(AssertionError, match="holders were read"):
        bindings.hold(second, fake.__name__, "target", lambda found: ("wrapped", found))
    fake.target = wrapper
    monkeypatch.undo()
    bindings.release(first)


def _train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_deepcopy_is_patched_and_independent(model_type, chunked_on_cpu):
    """``copy.deepcopy`` of a patched model (EMA copies, TRL's reference model) works, and the copy is patched,
    runs on its own weights, and reverts alone (it raised ``cannot pickle 'mappingproxy'``)."""
    model = tiny_model(model_type).train()
    fusepatch.apply(model)
    twin = copy.deepcopy(model)
    assert fusepatch.report(twin).already_patched == fusepatch.report(model).already_patched > 0
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    loss, grads = _train_step(model, ids)
    twin_loss, twin_grads = _train_step(twin, ids)
    torch.testing.assert_close(twin_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(twin_grads[name], grad, msg=name)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(next(twin.parameters()), next(model.parameters()))
    for module in twin.modules():
        state = module.__dict__.get("_fusepatch")
        if state is not None:
            assert state.original.__self__ is module  # the copy's own forward, not the source's
    assert fusepatch.revert(twin) > 0
    assert fusepatch.report(model).already_patched > 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_pickle_and_torch_save_keep_the_patch(model_type, chunked_on_cpu):
    model = tiny_model(model_type).train()
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    loss, _ = _train_step(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    again = pickle.loads(pickle.dumps(model))
    for copy_ in (loaded, again):
        assert fusepatch.report(copy_).already_patched == fusepatch.report(model).already_patched
        copy_loss, _ = _train_step(copy_.train(), ids)
        torch.testing.assert_close(copy_loss, loss)
        assert fusepatch.revert(copy_) > 0
