"""peft LoRA fused with the base GEMMs (layers/support/lora.py) in bf16 on a real GPU: a patched LoRA mini model
against the same model through peft's own modules, both against the fp32 model.

Bound: the fused model's error against fp32 (loss, logits, every adapter gradient) is at most the mini-model
bound of conftest.py (FACTOR x the error of the same bf16 model calling peft's modules, plus FLOOR). The fused
sum rounds once where peft rounds the base output, the LoRA product and the sum apart; the two bf16 paths then
differ by rounding noise, which the Gated DeltaNet's gates amplify in the gradients of ``in_proj_a``/``in_proj_b``'s
adapters (0.054 against 0.079 in one bf16 run of this comparison on the CPU), as they do for every fused op."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu
peft = pytest.importorskip("peft")


def _within(got: dict, peft_path: dict, reference: dict) -> dict:
    from conftest import FACTOR, FLOOR

    from fusepatch.ops.common import relative_error

    worse = {}
    for name, ref in reference.items():
        bound = FACTOR * relative_error(peft_path[name], ref) + FLOOR
        error = relative_error(got[name], ref)
        if error > bound:
            worse[name] = (round(error, 5), round(bound, 5))
    return worse


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_fused_lora_mini_model_within_peft_bf16_error(monkeypatch, model_type, precision):
    """bf16 weights and adapters (``autocast_adapter_dtype=False``), or fp32 weights under bf16 autocast (the
    Trainer's ``bf16=True``): the fused path runs for every adapted linear fusepatch's layers call, and stays as
    close to fp32 as peft's own path."""
    import torch
    from conftest import MINI, eager, outputs

    import fusepatch
    from fusepatch.layers.support import lora, projections
    from fusepatch.tools.tiny import tiny_model

    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    base = peft.get_peft_model(tiny_model(model_type, **MINI), config, autocast_adapter_dtype=False)
    ids = torch.randint(0, base.config.vocab_size, (2, 301), device="cuda")

    def trainable(result: dict) -> dict:
        return {k: v for k, v in result.items() if k in ("loss", "logits") or "lora_" in k}

    reference = trainable(outputs(eager(copy.deepcopy(base).cuda()), ids))  # fp32, every op on its reference
    model = copy.deepcopy(base).cuda()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    fusepatch.apply(model, compute_dtype=torch.bfloat16)
    ran = []
    plain = lora._LoraLinears.apply
    monkeypatch.setattr(lora._LoraLinears, "apply", lambda *a: ran.append(len(a[2])) or plain(*a))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
        fused = trainable(outputs(model, ids))
        assert ran, "the fused LoRA path never ran"
        monkeypatch.setattr(projections, "DEVICES", ())  # the same model through peft's modules
        ran.clear()
        peft_path = trainable(outputs(model, ids))
        assert not ran
    assert set(fused) == set(reference) and any("lora_A" in k for k in fused)
    worse = _within(fused, peft_path, reference)
    assert not worse, worse
