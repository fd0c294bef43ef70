"""What ``apply`` leaves in the process and on the model: ``revert`` restores transformers' modules exactly, no call
rebinds their names, and a patched model copies, pickles and saves as a patched model."""

from __future__ import annotations

import copy
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
