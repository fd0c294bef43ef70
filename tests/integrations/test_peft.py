"""PEFT LoRA with fusepatch, either order: the loss and every trainable (adapter) gradient equal peft's alone."""

from __future__ import annotations

import pytest
import torch
from helpers import lm_batch

import fusepatch
from fusepatch.tools.tiny import tiny_model

peft = pytest.importorskip("peft")


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _step(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("order", ["apply-first", "peft-first"])
def test_lora_either_order_equals_peft_alone(model_type, order):
    torch.manual_seed(0)
    expected_model = _lora(tiny_model(model_type))
    batch = lm_batch(expected_model)
    expected_loss, expected = _step(expected_model, batch)
    torch.manual_seed(0)
    if order == "apply-first":
        model = tiny_model(model_type)
        fusepatch.apply(model)
        model = _lora(model)
    else:
        model = _lora(tiny_model(model_type))
        fusepatch.apply(model)
    assert fusepatch.report(model).patched > 0
    loss, grads = _step(model, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(expected) and any("lora_A" in n for n in grads)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
