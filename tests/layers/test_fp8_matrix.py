"""Every combination of peft LoRA, FP8 projections, the MLP recompute, CUDA graphs and activation checkpointing on a
tiny model, against the same model unpatched: logits, loss and every parameter's gradient. On the CPU the FP8
function runs as the op's kernel (``cpu_candidates``: the path a GPU takes, its frozen copies kept by the
dispatcher), the fused projection paths run on the CPU, and ``_Rerun`` stands in for a CUDA graph (a replay runs the
captured function again); graphs with checkpointing are refused with their reason. tests/gpu/test_fp8.py runs the
same matrix's numerics on the GPU."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from helpers import cpu_candidates

import fusepatch
from fusepatch.layers import layer_graphs
from fusepatch.layers.support import projections
from fusepatch.ops.common import relative_error
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
from fusepatch.tools.tiny import tiny_model

AXES = ("lora", "fp8", "recompute", "graphs", "checkpointing")
CASES = [dict(zip(AXES, flags)) for flags in itertools.product((False, True), repeat=len(AXES))]
STEPS_WITH_GRAPHS = 3  # a steady step (``WARM_CALLS`` set to 1), the capture, a replay

# FP8's error through a whole step (the bounds tests/ops/fp8_linear uses): the loss within 2%, the gradients' median
# relative error under 0.5 and none above 1.5; the logits within FP8's GEMM error. Without FP8: fp32's rounding.
FP8 = {"loss": 0.02, "logits": 0.05, "median": 0.5, "max": 1.5}
EXACT = {"loss": 1e-5, "logits": 1e-4, "median": 1e-4, "max": 1e-3}


def _name(case: dict) -> str:
    return "-".join(axis for axis in AXES if case[axis]) or "plain"


_BASES: dict[tuple, tuple] = {}  # per LoRA and dtype: the model unpatched, its batch and its step (made once)


def _base(lora: bool, dtype: torch.dtype = torch.float32) -> tuple:
    """The unpatched model, its batch and its step. FP8 cases are in bf16: in fp32 the FP8 function's self-test
    refuses it (FP8 is not within fp32's error), and the projections would run eager."""
    if (lora, dtype) not in _BASES:
        model = tiny_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1).to(dtype).train()
        if lora:
            peft = pytest.importorskip("peft")
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
            model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        _BASES[lora, dtype] = model, ids, _step(copy.deepcopy(model), ids, checkpointing=False)
    return _BASES[lora, dtype]


def _step(model, ids, checkpointing: bool, steps: int = 1):
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():  # (with labels a patched head computes the loss without the logits)
        logits = model(input_ids=ids, use_cache=False).logits
    return logits, out.loss.detach(), grads


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_the_combination_computes_what_the_unpatched_model_does(case, monkeypatch, chunked_on_cpu, caplog):
    seen = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear}) if case["fp8"] else []
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    monkeypatch.setattr(layer_graphs, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layer_graphs, "GRAPH", layer_graphs._Rerun)
    monkeypatch.setattr(layer_graphs, "WARM_CALLS", 1)
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1" if case["recompute"] else "0")
    base, ids, want = _base(case["lora"], torch.bfloat16 if case["fp8"] else torch.float32)
    model = copy.deepcopy(base)
    precision = "fp8" if case["fp8"] else None
    fusepatch.apply(model, precision=precision, cuda_graphs=case["graphs"], verbose=False)
    self_tests = len(seen)
    steps = STEPS_WITH_GRAPHS if case["graphs"] and not case["checkpointing"] else 1  # refused at the first call
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        logits, loss, grads = _step(model, ids, case["checkpointing"], steps)
    said = " | ".join(r.getMessage() for r in caplog.records)
    if case["graphs"] and case["checkpointing"]:
        assert layer_graphs.FIXES["checkpointing"] in said and "layers captured" not in said, said
    elif case["graphs"]:
        assert "1 decoder layers captured" in said, said
    fp8 = [m for m in model.modules() if "fp8_linear" in getattr(m.__dict__.get("_fusepatch"), "ops", {})]
    assert bool(fp8) == case["fp8"]
    assert (len(seen) > self_tests) == case["fp8"], "the FP8 function did not run"  # not its eager fallback
    bounds = FP8 if case["fp8"] else EXACT
    assert abs(loss - want[1]) / want[1] < bounds["loss"], (loss, want[1])
    assert relative_error(logits, want[0]) < bounds["logits"]
    assert grads.keys() == want[2].keys()
    errors = sorted(relative_error(g, want[2][n]) for n, g in grads.items())
    assert errors[len(errors) // 2] < bounds["median"] and errors[-1] < bounds["max"], errors


def test_lora_adds_to_an_fp8_base_output_in_place(monkeypatch, chunked_on_cpu):
    """Over an FP8 base, whose output its own function makes, LoRA's products go into that output through the GEMM's
    ``beta`` in place: no out-of-place ``addmm`` or clone, which copies the whole output first (a device-to-device
    copy of every projection's output, each forward and each recompute). The step matches the unpatched model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusepatch.layers.support import lora

    ran = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    base, ids, want = _base(True, torch.bfloat16)
    model = copy.deepcopy(base)
    fusepatch.apply(model, precision="fp8", verbose=False)
    self_tests, seen = len(ran), []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    forward = lora._LoraLinears.forward

    def counted(ctx, *args):
        with Ops():
            return forward(ctx, *args)

    monkeypatch.setattr(lora._LoraLinears, "forward", staticmethod(counted))
    logits, loss, grads = _step(model, ids, checkpointing=True)
    assert len(ran) > self_tests, "the FP8 function did not run"
    assert "aten.addmm_.default" in seen, sorted(set(seen))
    assert not {"aten.addmm.default", "aten.clone.default", "aten.copy_.default"} & set(seen), sorted(set(seen))
    assert abs(loss - want[1]) / want[1] < FP8["loss"] and relative_error(logits, want[0]) < FP8["logits"]
    errors = sorted(relative_error(g, want[2][n]) for n, g in grads.items())
    assert errors[len(errors) // 2] < FP8["median"] and errors[-1] < FP8["max"], errors
