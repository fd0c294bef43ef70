"""``apply(model, cuda_graphs=True)`` on a GPU: the decoder layers captured with their fused kernels and replayed,
forward and backward, compute the training steps the model computes without graphs (bf16 mini models, AdamW)."""

from __future__ import annotations

import copy
import logging

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

STEP_TOL = 2e-2  # relative: the same kernels replayed; the backward's atomics may order sums differently


def _steps(model, ids, steps: int) -> list[float]:
    """``steps`` AdamW steps as a plain training loop: the variable ``loss`` still holds the step before's loss
    (and its autograd graph) while the next forward runs, where the capture happens."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize(
    "model_type, lora, precision",
    [
        ("qwen3_5_text", False, None),
        ("qwen3", False, None),
        ("qwen3_5_text", True, None),
        ("qwen3_5_text", False, "fp8"),
        ("qwen3_5_text", True, "fp8"),
    ],
)
def test_graphed_layers_train_as_the_model_without_graphs(model_type, lora, precision, caplog):
    """Six steps with and without graphs (captured at the third): every loss and every parameter after them within
    ``STEP_TOL``; the graphs captured and in use at the end. ``lora``: peft LoRA r8 on every linear, bf16 adapters
    (a frozen embedding: the first layer's input needs no gradient). ``fp8``: the FP8 projections' quantization
    kernels and GEMMs captured with their layers (under LoRA, the frozen bases dropped to their FP8 copies)."""
    from conftest import MINI

    import fusepatch
    from fusepatch.layers import layer_graphs
    from fusepatch.ops.common import relative_error
    from fusepatch.tools.tiny import tiny_model

    caplog.set_level(logging.INFO, logger="fusepatch")
    base = tiny_model(model_type, **MINI).cuda().to(torch.bfloat16).train()
    if lora:
        import peft

        base = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear")).to(torch.bfloat16)
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    kwargs = {"precision": precision, "drop_frozen_weights": lora} if precision else {}
    fusepatch.apply(plain, **kwargs)
    report = fusepatch.apply(graphed, cuda_graphs=True, **kwargs)
    if precision:
        chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
        assert chosen["fp8_linear"] == "scaled-mm", report.log_lines()
    ids = torch.randint(0, base.config.vocab_size, (2, 256), device="cuda")
    want = _steps(plain, ids, 6)
    got = _steps(graphed, ids, 6)
    stack = graphed.get_base_model().model if lora else graphed.model
    holder = stack.layers[0].__dict__[layer_graphs.ATTRIBUTE][0]
    failed = [
        r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage() and r.levelno >= logging.WARNING
    ]
    assert holder.graphs and not holder.disabled, failed
    assert all(abs(g - w) <= STEP_TOL * abs(w) for g, w in zip(got, want)), (got, want)
    # dropped frozen bases are meta tensors in both models (their FP8 copies are what ran); the rest is compared
    want_state, got_state = plain.state_dict(), graphed.state_dict()
    assert [n for n, v in got_state.items() if v.is_meta] == [n for n, v in want_state.items() if v.is_meta]
    compared = [name for name, value in want_state.items() if not value.is_meta]
    assert any("lora_" in name for name in compared) if lora else len(compared) == len(want_state)
    for name in compared:
        assert relative_error(got_state[name].float(), want_state[name].float()) <= STEP_TOL, name
