"""The Trainer's mixed precision on a real GPU: fp32 weights, ``bf16=True`` (accelerate's autocast), fusepatch
applied by the callback after accelerate wrapped the model. The fused kernels then see fp32 weights beside bf16
activations (norm and conv weights, A_log, dt_bias), which no self-test draws: the run must train, choose bf16
kernels, and give the first step's loss of the eager model under the same autocast.

The reference is fusepatch's eager path (every op on its reference, the same arithmetic as transformers'), not
the unpatched model: on the H200 the unpatched qwen3_5 model crashed in transformers' own fast path (its
causal-conv1d call with the fp32 conv weight under autocast, on the bf16-only wheel: "causal_conv1d_fwd
bf16-only build: not implemented for type 'Float'") before the fused run began."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MINI, eager, record

import fusepatch
from fusepatch.tools.tiny import tiny_model

pytestmark = pytest.mark.gpu


class _Rows(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 12, length: int = 257):
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, vocab, (length,), generator=generator) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train(model, tmp_path, callback) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        bf16=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(model.config.vocab_size))
    if callback is not None:
        fusepatch.attach(trainer, callback)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_trainer_bf16_over_fp32_weights(model_type, tmp_path):
    base = tiny_model(model_type, **MINI)  # fp32 weights
    reference = _train(eager(copy.deepcopy(base).cuda()), tmp_path / "reference", None)
    callback = fusepatch.FusePatchCallback(profile=False)
    fused = _train(copy.deepcopy(base).cuda(), tmp_path / "fused", callback)
    chosen = {c.op: c.chosen for layer in callback.report.layers for c in layer.choices}
    record(f"trainer bf16 over fp32 {model_type}", {"reference": reference, "fused": fused, "chosen": chosen})
    assert callback.report.dtype == "bfloat16", callback.report.dtype
    assert chosen.get("linear_cross_entropy") not in (None, "eager"), chosen
    assert len(fused) == 3 and all(torch.isfinite(torch.tensor(fused)))
    assert abs(fused[0] - reference[0]) / reference[0] < 2e-2, (reference, fused)
