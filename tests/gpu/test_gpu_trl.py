"""TRL's SFTTrainer on the GPU with fusepatch's callback: TRL's fused LM head computes the loss, fusepatch's
kernels run every layer (the head left to TRL, and reported so), and the run's losses are TRL's own run's."""

from __future__ import annotations

import pytest
import torch
from conftest import MINI, record
from helpers import sft_sample

import fusepatch
from fusepatch.tools.tiny import tiny_model

pytestmark = pytest.mark.gpu
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _train(tmp_path, callbacks=()):
    dataset, tokenizer = sft_sample()
    model = tiny_model("qwen3_5_text", vocab_size=len(tokenizer), dtype=torch.bfloat16, **MINI).cuda()
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", max_length=512, seed=0, data_seed=0, bf16=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=list(callbacks)
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trl_fused_head_with_fusepatch_layers_on_gpu(tmp_path):
    expected = _train(tmp_path / "trl")
    callback = fusepatch.FusePatchCallback(profile=False)
    losses = _train(tmp_path / "fp", [callback])
    report = callback.report
    (head,) = [layer for layer in report.layers if layer.layer.endswith("ForCausalLM")]
    assert head.choices[0].chosen == "TRL's fused LM head" and not head.patched
    fused = {c.op for _, c in report.fused_ops if c.source != "trainer"}
    assert {"gated_delta_rule", "swiglu"} <= fused, str(report)
    record("trl-gpu", {"trl": expected, "fusepatch": losses, "fused": sorted(fused)})
    assert len(losses) == len(expected) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=0)
