"""accelerate's mixed-precision wrapper, which ``apply`` replaces with the fused forward, taken off afterwards by
``accelerator.unwrap_model(model, keep_fp32_wrapper=False)``."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import lm_batch

import fusepatch
from fusepatch.engine.patch import _Bound
from fusepatch.tools.tiny import tiny_model

accelerate_utils = pytest.importorskip("accelerate.utils")


def _loss(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _prepare(model):
    """accelerate's mixed-precision wrapper as accelerate 1.16's ``Accelerator.prepare_model`` sets it (no Accelerator:
    no process-wide state): the forward kept as ``_original_forward``, the wrapper as the forward; returns it."""
    model._original_forward = model.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = types.MethodType(accelerate_utils.convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    return model.forward


def test_unwrapping_accelerates_mixed_precision_after_apply(fused_on_cpu):
    """``accelerator.unwrap_model(model, keep_fp32_wrapper=False)`` takes the mixed-precision wrapper off: after
    ``apply`` replaced it, the model still runs (fused)."""
    model = tiny_model("qwen3", seed=0, num_hidden_layers=1).train()
    batch = lm_batch(model, batch=2, length=13)
    want = _loss(model, batch)
    _prepare(model)
    fusepatch.apply(model, verbose=False)
    plain = accelerate_utils.extract_model_from_parallel(model, keep_fp32_wrapper=False)  # unwrap_model's
    torch.testing.assert_close(_loss(plain, batch), want, rtol=1e-5, atol=1e-6)
    assert isinstance(plain.__dict__["forward"], _Bound)
    fusepatch.revert(plain)  # unwrapped while patched: the model's own forward, no wrapper
    assert "forward" not in plain.__dict__ and "_original_forward" not in plain.__dict__
    torch.testing.assert_close(_loss(plain, batch), want, rtol=1e-5, atol=1e-6)


def test_revert_gives_the_mixed_precision_wrapper_back_as_it_was(fused_on_cpu):
    """Patched and reverted without unwrapping: the wrapper and the forward it kept, as accelerate left them."""
    model = tiny_model("qwen3", seed=0, num_hidden_layers=1).train()
    wrapper = _prepare(model)
    fusepatch.apply(model, verbose=False)
    assert isinstance(model.__dict__["_original_forward"], _Bound)
    fusepatch.revert(model)
    assert model.__dict__["forward"] is wrapper
    kept = model.__dict__["_original_forward"]
    assert kept.__self__ is model and kept.__func__ is type(model).forward


def test_revert_says_it_removes_a_wrapper_set_after_apply(fused_on_cpu, caplog):
    """``Accelerator.prepare`` after ``apply`` wraps the fused forward in autocast; ``revert`` cannot keep the wrapper
    (it calls the fused function), so it goes, and the warning names what the model loses and the fix."""
    model = tiny_model("qwen3", seed=0, num_hidden_layers=1).train()
    batch = lm_batch(model, batch=2, length=13)
    want = _loss(model, batch)
    fusepatch.apply(model, verbose=False)
    _prepare(model)
    with caplog.at_level("WARNING", logger="fusepatch"):
        fusepatch.revert(model)
    said = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "forward was set after apply" in said and "call accelerator.prepare after fusepatch.revert" in said
    assert "forward" not in model.__dict__
    torch.testing.assert_close(_loss(model, batch), want, rtol=1e-5, atol=1e-6)


def test_unwrapping_a_wrapper_set_after_apply_then_revert_says_nothing(fused_on_cpu, caplog):
    """``Accelerator.prepare`` after ``apply``, then ``unwrap_model(keep_fp32_wrapper=False)``: the forward left is
    the fused function bound to the model, nothing of another hand's; ``revert`` takes it back without a warning."""
    model = tiny_model("qwen3", seed=0, num_hidden_layers=1).train()
    batch = lm_batch(model, batch=2, length=13)
    want = _loss(model, batch)
    fusepatch.apply(model, verbose=False)
    _prepare(model)
    plain = accelerate_utils.extract_model_from_parallel(model, keep_fp32_wrapper=False)
    with caplog.at_level("WARNING", logger="fusepatch"):
        fusepatch.revert(plain)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "forward" not in plain.__dict__
    torch.testing.assert_close(_loss(plain, batch), want, rtol=1e-5, atol=1e-6)
