"""accelerate's mixed-precision wrapper, which ``apply`` replaces with the fused forward, taken off afterwards by
``accelerator.unwrap_model(model, keep_fp32_wrapper=False)``."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import cpu_candidates, lm_batch

import fusepatch
from fusepatch.engine import selftest
from fusepatch.engine.patch import _Bound
from fusepatch.layers.support import projections
from fusepatch.ops import OPS
from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_chunked
from fusepatch.tools.tiny import tiny_model

accelerate_utils = pytest.importorskip("accelerate.utils")


@pytest.fixture
def fused_on_cpu(monkeypatch):
    cpu_candidates(monkeypatch, {name: op.reference for name, op in OPS.items() if name != "fp8_linear"})
    cpu_candidates(monkeypatch, {"linear_cross_entropy": linear_cross_entropy_chunked}, name="torch-chunked")
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    yield
    selftest.clear_cache()


def _loss(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


@pytest.mark.xfail(
    strict=True,
    raises=TypeError,
    reason="unwrap_model binds the fused forward that replaced the wrapper to the model again: the model is passed "
    "twice (got multiple values for argument 'input_ids')",
)
def test_unwrapping_accelerates_mixed_precision_after_apply(fused_on_cpu):
    """``accelerator.unwrap_model(model, keep_fp32_wrapper=False)`` takes the mixed-precision wrapper off: after
    ``apply`` replaced it, the model still runs (fused)."""
    model = tiny_model("qwen3", seed=0, num_hidden_layers=1).train()
    batch = lm_batch(model, batch=2, length=13)
    want = _loss(model, batch)
    # the wrapper as accelerate 1.16's Accelerator.prepare_model builds it (no Accelerator: no process-wide state)
    model._original_forward = model.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = types.MethodType(accelerate_utils.convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    fusepatch.apply(model, verbose=False)
    plain = accelerate_utils.extract_model_from_parallel(model, keep_fp32_wrapper=False)  # unwrap_model's
    torch.testing.assert_close(_loss(plain, batch), want, rtol=1e-5, atol=1e-6)
    assert isinstance(plain.__dict__["forward"], _Bound)
