"""TRL's SFTTrainer with fusepatch, on CPU: its fused LM head computes the loss, fusepatch steps aside from the
head and says so, and the run trains as TRL's own does (packing, padding-free, assistant-only loss, PEFT)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_each_reason_once, fallback_reasons, sft_sample

import fusepatch
from fusepatch.tools.tiny import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data():
    return sft_sample(conversations=8)


def _train(data, tmp_path, *, model=None, model_type="qwen3", callbacks=(), peft=False, **config):
    dataset, tokenizer = data
    model = model if model is not None else tiny_model(model_type, vocab_size=len(tokenizer))
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        use_cpu=True,
        **{"max_length": 256, "bf16": False, **config},
    )
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=list(callbacks),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def _head(report: fusepatch.PatchReport):
    (head,) = [layer for layer in report.layers if layer.layer.endswith("ForCausalLM")]
    return head


CASES = {
    "packing": dict(packing=True),
    "padding-free": dict(padding_free=True, max_length=None),
    "assistant-only": dict(assistant_only_loss=True),
    # mixed precision: accelerate wraps TRL's head in autocast before the callback runs
    "bf16-autocast": dict(packing=True, bf16=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_callback_steps_aside_for_trls_fused_head(data, tmp_path, case):
    _, expected = _train(data, tmp_path / "trl", **CASES[case])
    callback = fusepatch.FusePatchCallback(profile=False)
    trainer, losses = _train(data, tmp_path / "fp", callbacks=[callback], **CASES[case])
    head = _head(callback.report)
    assert not head.patched and head.choices[0].chosen == "TRL's fused LM head"
    assert head.choices[0].source == "trainer" and "leaves the model's head to it" in head.choices[0].provides
    assert any(layer.patched for layer in callback.report.layers)  # the layers are fusepatch's
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_apply_before_the_trainer_reports_trls_head(data, tmp_path):
    _, expected = _train(data, tmp_path / "trl", packing=True)
    dataset, tokenizer = data
    model = tiny_model("qwen3", vocab_size=len(tokenizer))
    fusepatch.apply(model)
    _, losses = _train(data, tmp_path / "fp", model=model, packing=True)
    head = _head(fusepatch.report(model))
    assert head.choices[0].chosen == "TRL's fused LM head" and head.choices[0].source == "trainer"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_peft_lora_through_trl(data, tmp_path, monkeypatch):
    """``SFTTrainer(peft_config=...)`` with the callback: TRL's head keeps the loss, the LoRA linears of
    fusepatch's layers run fused (the CPU stands in for the GPU here: ``projections.DEVICES``), the report counts
    them all fusable, and the losses are TRL's own. (Under autocast: tests/layers/test_lora.py and the GPU tests.)"""
    from fusepatch.layers.support import lora, projections

    _, expected = _train(data, tmp_path / "trl", peft=True, packing=True)
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    ran = []
    plain = lora._LoraLinears.apply
    monkeypatch.setattr(lora._LoraLinears, "apply", lambda *a: ran.append(1) or plain(*a))
    callback = fusepatch.FusePatchCallback(profile=False)
    trainer, losses = _train(data, tmp_path / "fp", callbacks=[callback], peft=True, packing=True)
    assert _head(callback.report).choices[0].chosen == "TRL's fused LM head"
    assert any(layer.patched for layer in callback.report.layers)
    assert callback.report.lora["linears"] == callback.report.lora["fusable"] > 0 and ran
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_fp8_lora_through_trl(data, tmp_path, monkeypatch):
    """``SFTTrainer(peft_config=...)`` over a bf16 model with ``FusePatchCallback(apply_kwargs={"precision":
    "fp8"})``: every LoRA base runs its FP8 GEMMs (the real FP8 function on the CPU, as its kernel would on the
    GPU), quantized once for the whole run; peft's default fp32 adapters run in the fused path; the losses stay
    within FP8's error of TRL's own bf16 run."""
    from helpers import cpu_candidates

    from fusepatch.layers.support import projections
    from fusepatch.ops.fp8_linear import scaled_mm

    dataset, tokenizer = data
    bf16 = {"model": tiny_model("qwen3", vocab_size=len(tokenizer)).to(torch.bfloat16), "peft": True}
    _, expected = _train(data, tmp_path / "trl", **bf16)
    calls = cpu_candidates(monkeypatch, {"fp8_linear": scaled_mm.fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    quantized = []
    monkeypatch.setattr(scaled_mm, "prepare", lambda w: quantized.append(1) or scaled_mm.quantize_weight(w))
    callback = fusepatch.FusePatchCallback(profile=False, apply_kwargs={"precision": "fp8"})
    bf16["model"] = tiny_model("qwen3", vocab_size=len(tokenizer)).to(torch.bfloat16)
    trainer, losses = _train(data, tmp_path / "fp8", callbacks=[callback], **bf16)
    bases = [m for n, m in trainer.model.named_modules() if n.endswith("base_layer") and "_fusepatch" in m.__dict__]
    assert bases and callback.report.lora["linears"] == callback.report.lora["fusable"] > 0
    assert len(calls) > 3 * len(bases) and len(quantized) == len(bases)  # three steps, one quantization each
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) < 0.02, (losses, expected)


def test_packed_hybrid_model_trains_through_trl(data, tmp_path):
    """Qwen3.5 with packed rows: transformers alone refuses on a machine without causal-conv1d (its conv cannot
    keep documents apart); patched, the documents are kept apart and TRL's head computes the loss."""
    callback = fusepatch.FusePatchCallback(profile=False)
    _, losses = _train(
        data, tmp_path, model_type="qwen3_5_text", callbacks=[callback], padding_free=True, max_length=None
    )
    assert _head(callback.report).choices[0].chosen == "TRL's fused LM head"
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_run_says_each_fallback_reason_once(data, tmp_path, caplog):
    """An SFT run's log said one fallback reason 22 times in 45 lines (apply's lines, then each layer's again for
    each new dtype and packed call): each distinct reason is said once, with its fix."""
    callback = fusepatch.FusePatchCallback()
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        trainer, losses = _train(
            data,
            tmp_path,
            model_type="qwen3_5_text",
            callbacks=[callback],
            padding_free=True,
            max_length=None,
            bf16=True,
        )
    assert len(losses) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert_each_reason_once(warnings, fallback_reasons(trainer.model))


def test_a_synced_fp8_reference_model_computes_with_the_synced_weights(monkeypatch):
    """TRL's ``SyncRefModelCallback`` (``sync_ref_model=True``) mixes the policy into the frozen reference model
    through ``.data`` at the end of a step, which moves neither the weights' storage nor their version: the FP8
    reference's next call computes what a copy quantized afresh from the synced weights computes, exactly (a
    stale copy computes the reference from before the sync)."""
    import copy
    import types

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import cpu_candidates, lm_batch
    from transformers import TrainerControl, TrainerState

    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    policy = tiny_model("qwen3", hidden_size=128, intermediate_size=256, seed=1).to(torch.bfloat16)
    reference = tiny_model("qwen3", hidden_size=128, intermediate_size=256, seed=0).to(torch.bfloat16)
    reference.requires_grad_(False)
    fusepatch.apply(reference, precision="fp8", verbose=False)
    batch = lm_batch(reference, length=16)

    def logits(model):
        with torch.no_grad():  # as TRL computes the reference's log-probabilities
            return model(**batch).logits.float()

    before = logits(reference)
    # the two fields of TRL's configs (GRPO, RLOO, KTO, DPO) the callback reads
    args = types.SimpleNamespace(ref_model_sync_steps=1, ref_model_mixup_alpha=0.6)
    state = TrainerState(global_step=1)
    try:
        callback = trl.trainer.callbacks.SyncRefModelCallback(ref_model=reference, accelerator=Accelerator(cpu=True))
        callback.on_step_end(args, state, TrainerControl(), model=policy)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    synced = logits(reference)
    assert torch.equal(synced, logits(copy.deepcopy(reference)))
    assert not torch.equal(synced, before)
