"""A forward set on a module's instance before ``apply`` keeps running: accelerate's hook runs around the fused
forward (it calls ``_old_forward``, where the fused forward goes); any other is left running, its module unpatched
and named at WARNING with the fix; ``revert`` puts back the very objects. The fused paths run on the CPU with the
ops' references as candidates, as the GPU runs them with kernels."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import assert_same_step, lm_batch, step_loss_and_grads

import fusepatch
from fusepatch.engine.patch import _Bound
from fusepatch.tools.tiny import tiny_model

hooks = pytest.importorskip("accelerate.hooks")


def _model(family: str):
    over = {"num_hidden_layers": 2}
    if family == "qwen3_5_text":
        over["layer_types"] = ["linear_attention", "full_attention"]
    return tiny_model(family, seed=0, **over).train()


def _scaled(out):
    """``out`` with its first floating tensor times 1.5 (a module's output: a tensor, or a tuple starting with one)."""
    if isinstance(out, torch.Tensor):
        return out * 1.5
    if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
        return (out[0] * 1.5, *out[1:])
    return out  # the model's output: counted, left as it is


MODULES = [  # (family, module) each a row patches
    ("qwen3", "model.layers.0.post_attention_layernorm"),
    ("qwen3", "model.layers.0.mlp"),
    ("qwen3", "model.layers.1"),
    ("qwen3", "model.layers.0.self_attn"),
    ("qwen3", "model.norm"),
    ("qwen3_5_text", "model.layers.0.linear_attn"),
]


@pytest.mark.parametrize(("family", "name"), MODULES, ids=[f"{f}-{n}" for f, n in MODULES])
def test_a_forward_set_before_apply_still_runs(fused_on_cpu, caplog, family, name):
    """A user's forward on the instance (the module's own, scaled) runs after ``apply`` as before it: the module
    stays unpatched, said at WARNING with its path and the fix, and ``revert`` leaves that very forward."""
    results, calls = [], []
    for patched in (False, True):
        model = _model(family)
        module = model.get_submodule(name)
        own = module.forward

        def forward(*args, own=own, patched=patched, **kwargs):
            calls.append(patched)
            return _scaled(own(*args, **kwargs))

        module.forward = forward
        if patched:
            caplog.clear()
            report = fusepatch.apply(model, verbose=False)
            assert report.newly_patched > 0
            assert "_fusepatch" not in module.__dict__ and module.__dict__["forward"] is forward
        torch.manual_seed(1)
        results.append(step_loss_and_grads(model, lm_batch(model, batch=2, length=13)))
    assert calls.count(False) == calls.count(True) == 1
    assert_same_step(*results)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]
    assert len(warned) == 1 and "set that forward after fusepatch.apply" in warned[0], warned
    assert fusepatch.revert(model) > 0
    assert module.__dict__["forward"] is forward


class _Counting(hooks.ModelHook):
    """An accelerate hook that counts its calls and scales the module's output."""

    def __init__(self) -> None:
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs

    def post_forward(self, module, output):
        return _scaled(output)


HOOKED = [  # (family, module, whether the hook is added after apply)
    ("qwen3", "model.layers.0", False),
    ("qwen3", "model.layers.0.mlp", False),
    ("qwen3", "model.layers.0.post_attention_layernorm", False),
    ("qwen3", "model.layers.1.self_attn", False),
    ("qwen3", "", False),
    ("qwen3_5_text", "model.layers.0.linear_attn", False),
    ("qwen3", "model.layers.0.post_attention_layernorm", True),
]


@pytest.mark.parametrize(("family", "name", "after"), HOOKED, ids=[f"{f}-{n or 'model'}-{a}" for f, n, a in HOOKED])
def test_an_accelerate_hook_runs_around_the_fused_forward(fused_on_cpu, family, name, after):
    """``add_hook_to_module`` before ``apply``: the fused forward goes where the hook calls it (``_old_forward``),
    so the hook runs as it did unpatched; ``revert`` puts back the hook's forward and what it called, the same
    objects. A hook added after ``apply`` is not bypassed by a fused path either."""
    results, counts = [], []
    for patched in (False, True):
        model = _model(family)
        module = model.get_submodule(name)
        hook = _Counting()
        if patched and after:
            fusepatch.apply(model, verbose=False)
        hooks.add_hook_to_module(module, hook)
        hooked_forward, called = module.forward, module._old_forward
        if patched and not after:
            fusepatch.apply(model, verbose=False)
            assert module.forward is hooked_forward and isinstance(module._old_forward, _Bound)
        torch.manual_seed(1)
        results.append(step_loss_and_grads(model, lm_batch(model, batch=2, length=13)))
        counts.append(hook.calls)
    assert counts == [1, 1]
    assert_same_step(*results)
    fusepatch.revert(model)
    assert module.forward is hooked_forward and module._hf_hook is hook
    if not after:
        assert module._old_forward is called
    assert module._old_forward == type(module).forward.__get__(module)
    hooks.remove_hook_from_module(module)
    assert "_fusepatch" not in module.__dict__ and module.forward == type(module).forward.__get__(module)


def test_a_hook_removed_after_apply_leaves_the_fused_forward_and_revert_the_own_forward(fused_on_cpu):
    """``remove_hook_from_module`` after ``apply`` moves ``_old_forward`` (the fused forward) to ``forward``; the
    module stays patched, and ``revert`` leaves what the removal would have left unpatched."""
    model = _model("qwen3")
    mlp = model.model.layers[0].mlp
    hooks.add_hook_to_module(mlp, _Counting())
    called = mlp._old_forward
    fusepatch.apply(model, verbose=False)
    hooks.remove_hook_from_module(mlp)
    assert isinstance(mlp.forward, _Bound)
    model(**lm_batch(model, batch=1, length=7)).loss.backward()
    fusepatch.revert(model)
    assert mlp.__dict__["forward"] is called and "_old_forward" not in mlp.__dict__


def test_offloaded_layers_train_as_unpatched(fused_on_cpu):
    """accelerate's ``cpu_offload`` on a decoder layer: its weights are on the meta device, loaded by the hooks
    for each forward. Patched, the hooks still load them around the fused forwards (the layer's, its norms')."""
    results = []
    for patched in (False, True):
        model = _model("qwen3")
        accelerate = pytest.importorskip("accelerate")
        accelerate.cpu_offload(model.model.layers[1], execution_device=torch.device("cpu"))
        assert model.model.layers[1].mlp.down_proj.weight.device.type == "meta"
        if patched:
            fusepatch.apply(model, verbose=False)
            assert isinstance(model.model.layers[1]._old_forward, _Bound)
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            results.append(model(**lm_batch(model, batch=2, length=13)).loss)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_a_copy_keeps_the_hook_around_its_own_fused_forward(fused_on_cpu):
    """``copy.deepcopy`` of a patched model (EMA copies, TRL's reference model): the copy's hook calls the copy's
    fused forward, bound to the copy, and its ``revert`` puts back the copy's own forward."""
    model = _model("qwen3")
    layer = model.model.layers[0]
    hook = _Counting()
    hooks.add_hook_to_module(layer, hook)
    fusepatch.apply(model, verbose=False)
    twin = copy.deepcopy(model)
    copied = twin.model.layers[0]
    assert copied._old_forward.__self__ is copied and copied.forward.args == (copied,)
    twin(**lm_batch(twin, batch=1, length=7))
    assert copied._hf_hook.calls == 1 and hook.calls == 0
    fusepatch.revert(twin)
    assert copied._old_forward.__self__ is copied and copied._old_forward.__func__ is type(copied).forward


def test_a_forward_left_by_a_removed_hook_is_patched_and_pickles(fused_on_cpu):
    """``remove_hook_from_module`` leaves the module's own forward bound on its instance: that module is patched as
    any other, and a pickle round trip (``torch.save``) of the patched model reverts to the loaded module's own."""
    import io

    model = _model("qwen3")
    mlp = model.model.layers[0].mlp
    hooks.add_hook_to_module(mlp, _Counting())
    hooks.remove_hook_from_module(mlp)
    own = mlp.__dict__["forward"]
    fusepatch.apply(model, verbose=False)
    assert isinstance(mlp.forward, _Bound)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded(**lm_batch(loaded, batch=1, length=7)).loss.backward()
    fusepatch.revert(loaded)
    restored = loaded.model.layers[0].mlp.__dict__["forward"]
    assert restored == type(mlp).forward.__get__(loaded.model.layers[0].mlp)
    fusepatch.revert(model)
    assert mlp.__dict__["forward"] is own


def test_accelerates_mixed_precision_wrapper_is_replaced_and_said(fused_on_cpu, caplog):
    """``Accelerator.prepare``'s mixed-precision wrapper (built here as accelerate 1.16's ``prepare_model`` builds
    it) calls the class's forward function itself: the fused forward replaces it, as the Trainer's callback expects
    (it puts autocast back), said at INFO with the fix; ``revert`` restores the wrapper."""
    import types

    from accelerate.utils import convert_outputs_to_fp32

    model = _model("qwen3")
    model._original_forward = model.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = wrapper = types.MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    fusepatch.apply(model, verbose=False)
    assert isinstance(model.__dict__["forward"], _Bound)
    said = [r.getMessage() for r in caplog.records if "mixed-precision wrapper" in r.getMessage()]
    assert len(said) == 1 and "fix: call fusepatch.apply before accelerator.prepare" in said[0]
    fusepatch.revert(model)
    assert model.__dict__["forward"] is wrapper
