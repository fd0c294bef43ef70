"""FP8 projections (``apply(model, precision="fp8")``, op ``fp8_linear``) on the CPU, where torch computes
``torch._scaled_mm`` with rowwise scales too: the numerics of the GEMMs themselves (FP8's error, not bf16's, and
not a wrong scale's), which projections a model trains in FP8 and which it leaves, the fallback said where FP8
cannot run, the argument, the report and revert. The Triton quantization kernel and the H200's GEMMs are
tests/gpu/test_fp8.py's."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import HYBRID, MOE, NOT_HYBRID, ONE_OF_EACH, cpu_candidates, lm_batch

import fusepatch
from fusepatch.layers.fp8 import PROJECTIONS
from fusepatch.layers.support import projections
from fusepatch.ops.common import relative_error
from fusepatch.ops.fp8_linear.scaled_mm import FP8_MAX, fp8_linear, quantize_rows_reference
from fusepatch.tools.tiny import tiny_model

# FP8 (e4m3) GEMMs on random data land 3.7-3.8% off the fp32 product (bf16: 0.17%); measured on this CPU path and
# the H200 alike. The low bound shows FP8 really ran: a bf16 GEMM in its place would be far below it.
FP8_ERROR = (0.02, 0.05)


def _case(rows: int, inputs: int, outputs: int, bias: bool = False, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) * inputs**-0.5
    b = torch.randn(outputs, generator=generator) if bias else None
    grad = torch.randn(rows, outputs, generator=generator)
    return x, weight, b, grad


def _run(fn, x, weight, bias, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return out, *(t.grad if t is not None else None for t in leaves)


@pytest.mark.parametrize("rows", [301, 512])  # 301: the weight gradient's tokens padded to a multiple of 16
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_gemms_are_fp8_precise_forward_and_backward(rows, bias):
    """Output, input gradient, weight gradient (and bias gradient, exact up to bf16) against fp32: each within
    FP8's measured error, and each far from bf16's, so the three GEMMs all ran in FP8."""
    x, weight, b, grad = _case(rows, 256, 96, bias)
    want = _run(torch.nn.functional.linear, x, weight, b, grad, torch.float32)
    got = _run(fp8_linear, x, weight, b, grad, torch.bfloat16)
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dx", "dw"), got, want)}
    assert all(FP8_ERROR[0] < e < FP8_ERROR[1] for e in errors.values()), errors
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.bfloat16
    if bias:
        assert relative_error(got[3], want[3]) < 1e-2


def test_every_fp8_gemm_accumulates_fast(monkeypatch):
    """The output, input-gradient and weight-gradient GEMMs, of a trained and of a frozen weight, all ask
    ``torch._scaled_mm`` for fast accumulation: the setting the step time and the 300-step loss curve were measured
    with (docs/fp8.md)."""
    seen = []
    scaled = torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return scaled(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    x, weight, _, grad = _case(64, 128, 32)
    _run(fp8_linear, x, weight, None, grad, torch.bfloat16)
    assert seen == [True] * 3
    seen.clear()
    frozen = weight.to(torch.bfloat16)  # no gradient: the input's alone
    leaf = x.to(torch.bfloat16).requires_grad_(True)
    fp8_linear(leaf, frozen).backward(grad.to(torch.bfloat16))
    assert seen == [True] * 2


def test_fp8_weight_gradient_in_the_master_weights_dtype():
    """bf16 activations over fp32 weights (autocast's case): the weight gradient comes back fp32, the input's bf16."""
    x, weight, _, grad = _case(64, 128, 32)
    x = x.to(torch.bfloat16).requires_grad_(True)
    weight = weight.requires_grad_(True)
    out = fp8_linear(x, weight)
    out.backward(grad.to(out.dtype))
    assert out.dtype == x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_rowwise_scales_are_powers_of_two_and_keep_each_row_in_range():
    """One row's outlier costs that row only: every row's largest value maps to FP8's top octave, a zero row
    stays zero with a finite scale, and dequantizing is exact scaling (power-of-two scales)."""
    x = torch.randn(4, 64)
    x[1] *= 1000.0
    x[2] = 0.0
    q, inverse = quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and inverse.shape == (4, 1)
    assert torch.all(torch.log2(inverse) == torch.round(torch.log2(inverse)))
    peaks = q.float().abs().amax(dim=1)
    assert torch.all(peaks[[0, 1, 3]] > FP8_MAX / 2) and torch.all(peaks <= FP8_MAX) and peaks[2] == 0
    assert torch.isfinite(inverse).all()
    back = q.float() * inverse
    for row in (0, 1, 3):
        assert relative_error(back[row], x[row]) < 0.04


def test_unaligned_weights_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(4, 40), torch.randn(24, 40))


def test_precision_argument():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="precision expects None or one of 'fp8'.*fix"):
        fusepatch.apply(model, precision="int8")
    assert not any(hasattr(m, "_fusepatch") for m in model.modules())
    assert fusepatch.apply(tiny_model("qwen3"), precision="FP8", verbose=False).newly_patched > 0


def _fp8_modules(model) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if getattr(m, "_fusepatch", None) is not None and "fp8_linear" in m._fusepatch.ops
    }


@pytest.mark.parametrize("model_type", ONE_OF_EACH)
def test_which_projections_train_in_fp8(model_type):
    """The decoder's projections, by name, and nothing else: no LM head, embeddings, gate projections of the
    Gated DeltaNet (one output per head) or router; without the argument, no projection at all."""
    model = tiny_model(model_type).to(torch.bfloat16)
    fusepatch.apply(model, verbose=False)
    assert not _fp8_modules(model)
    model = tiny_model(model_type).to(torch.bfloat16)
    fusepatch.apply(model, precision="fp8", verbose=False)
    patched = _fp8_modules(model)
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert set(patched) == {n for n in linears if n.rpartition(".")[2] in PROJECTIONS}
    left = {n.rpartition(".")[2] for n in linears - set(patched)}
    assert "lm_head" in left and not left & set(PROJECTIONS)
    if model_type in HYBRID:
        assert {"in_proj_a", "in_proj_b"} <= left or "in_proj_ba" in left


def test_on_the_cpu_fp8_falls_back_to_the_projection_as_it_was_and_says_so(caplog):
    """No FP8 tensor cores: the projections run as before (bit for bit the unpatched model's output), and the
    fallback is said with its reason and fix, without any logging set up by the user."""
    reference = tiny_model("qwen3_5_text").to(torch.bfloat16)
    model = copy.deepcopy(reference)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        report = fusepatch.apply(model, precision="fp8", verbose=False)
    choice = next(c for layer in report.layers for c in layer.choices if c.op == "fp8_linear")
    assert choice.chosen == "eager" and "CPU-only build" in choice.reason_text()
    assert any("fp8_linear" in r.getMessage() and "fix:" in r.getMessage() for r in caplog.records)
    batch = lm_batch(model)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)


def test_a_model_trains_with_fp8_gemms_and_reverts(monkeypatch):
    """The real FP8 function as the op's kernel on the CPU (it passes the op's self-test there): a tiny Qwen3.5
    model's loss and every projection's weight gradient stay within FP8's error of the bf16 model's, the fused
    projections (gate and up of one input) call the FP8 modules instead of reading their weights, and
    ``revert`` gives back the forwards."""
    calls = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    reference = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    model = copy.deepcopy(reference)
    report = fusepatch.apply(model, precision="fp8", verbose=False)
    choice = next(c for layer in report.layers for c in layer.choices if c.op == "fp8_linear")
    assert choice.chosen == "cpu-standin", choice
    fp8 = _fp8_modules(model)
    batch = lm_batch(model, length=48)
    calls.clear()
    loss = model(**batch).loss
    loss.backward()
    assert len(calls) == len(fp8)  # every FP8 projection ran once, the MLP's gate and up included
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 0.02
    ref_modules = dict(reference.named_modules())
    errors = {n: relative_error(m.weight.grad, ref_modules[n].weight.grad) for n, m in fp8.items()}
    assert all(e < 0.25 for e in errors.values()), errors  # FP8 through a whole model's backward
    assert max(errors.values()) > 1e-3  # and not bf16's path
    fusepatch.revert(model)
    assert not _fp8_modules(model) and all("forward" not in m.__dict__ for m in fp8.values())


def test_a_converted_linear_subclass_is_called_not_replaced():
    """A projection the user already converted (a subclass of nn.Linear, as torchao's Float8Linear is) keeps its
    class and forward; the fused MLP calls that module instead of reading its weight."""

    class Converted(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            Converted.calls += 1
            return super().forward(x)

    model = tiny_model("qwen3").to(torch.bfloat16)
    for layer in model.model.layers:
        old = layer.mlp.up_proj
        layer.mlp.up_proj = Converted(old.in_features, old.out_features, bias=False, dtype=torch.bfloat16)
    fusepatch.apply(model, precision="fp8", verbose=False)
    ups = [layer.mlp.up_proj for layer in model.model.layers]
    assert all(type(u) is Converted and "forward" not in u.__dict__ for u in ups)
    model(**lm_batch(model))
    assert Converted.calls == len(ups)


def test_fused_projections_call_an_instance_forward():
    """``plain_linears``: a linear with a forward of its own (an FP8 projection) is called, not read."""
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(2, 16)
    assert projections.plain_linears(x, (linear,)) == ("cpu" in projections.DEVICES)
    linear.forward = lambda t: t
    assert not projections.plain_linears(x, (linear,))


def test_the_trainer_callback_and_the_demo_take_the_precision(tmp_path, capsys):
    """``FusePatchCallback(apply_kwargs={"precision": "fp8"})`` patches the projections a Trainer trains, and
    ``python -m fusepatch demo --precision fp8`` runs with the FP8 rows (on the CPU: falling back, said)."""
    from helpers import cpu_trainer

    from fusepatch.integrations.trainer import FusePatchCallback
    from fusepatch.tools.cli import main

    trainer = cpu_trainer(tmp_path, [FusePatchCallback(apply_kwargs={"precision": "fp8"})], max_steps=1)
    trainer.train()
    assert _fp8_modules(trainer.model)
    assert main(["demo", "--precision", "fp8", "--steps", "1", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "fp8_linear" in out and "precision fp8: fell back (the fp8_linear row above says why)" in out
    assert "compute capability 8.9 or newer" in out  # what FP8 needs, beyond the CPU-only reason the row gives


def test_a_frozen_weight_reuses_its_fp8_copy_in_the_backward():
    """A weight that takes no gradient (LoRA's base): the forward's FP8 weight serves the input gradient too,
    its rowwise scales moved into the gradient (``_FP8FrozenLinear``); output and input gradient within FP8's
    error of fp32, the same as the trained weight's path, and no weight gradient."""
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight

    x, weight, _, grad = _case(301, 256, 96)
    want = _run(torch.nn.functional.linear, x, weight, None, grad, torch.float32)
    frozen = weight.to(torch.bfloat16)
    for given in (None, quantize_weight(frozen)):
        leaf = x.to(torch.bfloat16).requires_grad_(True)
        out = fp8_linear(leaf, frozen, prepared=given)
        out.backward(grad.to(out.dtype))
        errors = relative_error(out, want[0]), relative_error(leaf.grad, want[1])
        assert all(FP8_ERROR[0] < e < FP8_ERROR[1] for e in errors), errors
        assert frozen.grad is None and leaf.grad.dtype == torch.bfloat16


def _lora(model, rank=4):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


@pytest.mark.parametrize("order", ["peft-first", "fusepatch-first"])
def test_lora_over_an_fp8_base_quantizes_it_once_per_version(monkeypatch, order):
    """peft LoRA with ``precision="fp8"``, either order: every wrapped projection's base runs FP8 (held as
    ``q_proj.base_layer`` when peft wrapped first), inside the fused LoRA path, which gives what peft's own
    forward over the same FP8 bases gives (to bf16's rounding of the sums); the frozen base is quantized once and
    reused over steps until its weight changes in place. Against the bf16 LoRA model FP8 moves the loss by under
    2% and the adapters' gradients by FP8's error through a whole backward (rank-4 adapters of a random tiny
    model: 0.12-0.83 measured, the trained weights' path the same)."""
    from fusepatch.ops.fp8_linear import scaled_mm

    calls = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    quantized = []
    monkeypatch.setattr(scaled_mm, "prepare", lambda w: quantized.append(w) or scaled_mm.quantize_weight(w))
    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16)

    def build(precision, first=order, dtype=torch.bfloat16):
        torch.manual_seed(1)
        if first == "peft-first":
            model = _lora(copy.deepcopy(base).to(dtype))
            fusepatch.apply(model, precision=precision, verbose=False)
            return model
        inner = copy.deepcopy(base).to(dtype)
        fusepatch.apply(inner, precision=precision, verbose=False)
        return _lora(inner)

    def grads(model, batch):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    batch = lm_batch(base, length=48)
    bf16_loss, bf16_grads = grads(build(None), batch)
    peft_loss, peft_grads = grads(build("fp8", dtype=torch.float32), batch)  # peft's forward: the fused path is CUDA's
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    fused_loss, fused_grads = grads(build("fp8", dtype=torch.float32), batch)
    assert abs(fused_loss - peft_loss) < 1e-4
    same = {n: relative_error(g, peft_grads[n]) for n, g in fused_grads.items()}
    assert max(same.values()) < 1e-3, same  # the fused LoRA path is peft's sum over the same FP8 GEMMs
    quantized.clear()
    model = build("fp8")
    fp8 = _fp8_modules(model)
    assert fp8 and all(n.endswith("base_layer") for n in fp8)
    for _ in range(2):
        calls.clear()
        loss, got = grads(model, batch)
        assert len(calls) == len(fp8)  # every base ran through the FP8 op, the fused LoRA path's included
        assert len(quantized) == len(fp8)  # quantized at the first step only
    assert abs(loss - bf16_loss) / bf16_loss < 0.02
    errors = sorted(relative_error(g, bf16_grads[n]) for n, g in got.items())
    assert 1e-3 < errors[len(errors) // 2] < 0.5 and errors[-1] < 1.5, errors
    weight = next(iter(fp8.values())).weight
    with torch.no_grad():
        weight.mul_(2)  # an in-place update: a new version, quantized again
    model(**batch)
    assert len(quantized) == len(fp8) + 1


def _saving_a_dropped_model_raises_with_the_fix(model, weight, folder) -> None:
    """A whole model's checkpoint would hold no values for its dropped weights: ``torch.save`` of its state dict and
    ``save_pretrained`` raise with the fix (``revert`` first) instead of writing meta tensors or failing in torch's
    words; the state dict's entry keeps the weight's shape and dtype, and a copy of the entry, a detached one or
    loading it in the weight's place (``assign=True``) raises the same."""
    state = model.state_dict()
    entry = next(v for v in state.values() if v.shape == weight.shape and v.is_meta)
    assert entry.dtype == weight.dtype and "revert" in repr(entry)
    assert len(entry) == weight.shape[0]
    for save in (
        lambda: torch.save(state, folder / "state.pt"),
        lambda: model.save_pretrained(folder / "whole"),
        lambda: entry.clone(),
        lambda: entry.to("cpu"),
        lambda: torch.save({name: value.detach() for name, value in state.items()}, folder / "detached.pt"),
        lambda: model.load_state_dict(state, assign=True),  # a value-less parameter in the weight's place
    ):
        with pytest.raises(RuntimeError, match="drop_frozen_weights.*revert"):
            save()


def test_dropped_frozen_weights_train_the_same_and_revert_saying_so(monkeypatch, caplog, tmp_path):
    """``drop_frozen_weights=True``: after the first step every frozen FP8 base holds no values (half the
    memory of its bf16 weight stays, in FP8), the next steps compute exactly what the kept-weight model computes,
    peft's adapter state dict is unchanged, reading a dropped weight for values raises with the fix, and
    ``revert`` puts back FP8-rounded weights and says so. Without ``precision="fp8"`` the argument is refused."""
    from fusepatch.layers.fp8 import DROPPED, DroppedWeight

    peft = pytest.importorskip("peft")
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    originals = {n: p.detach().clone() for n, p in base.named_parameters()}
    models, losses = [], []
    for drop in (False, True):
        torch.manual_seed(1)
        model = _lora(copy.deepcopy(base))
        fusepatch.apply(model, precision="fp8", drop_frozen_weights=drop, verbose=False)
        batch = lm_batch(model, length=48)
        steps = []
        for _ in range(2):
            model.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            steps.append(loss.item())
        models.append(model)
        losses.append(steps)
    kept, dropped = models
    assert losses[0] == losses[1]
    for (name, p), (_, q) in zip(kept.named_parameters(), dropped.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    gone = [m for m in _fp8_modules(dropped).values() if isinstance(m.weight, DroppedWeight)]
    assert gone and len(gone) == len(_fp8_modules(dropped))
    assert all(m.weight.device.type == "cpu" and m.weight.shape == (m.out_features, m.in_features) for m in gone)
    assert "device=cpu" in repr(gone[0].weight) and "revert" in str(gone[0].weight)  # not the meta tensor's
    shown = fusepatch.report(dropped)
    assert shown.dropped_weights == len(gone) and f"{len(gone)} frozen weights kept in FP8 only" in str(shown)
    saved = peft.get_peft_model_state_dict(dropped)
    want = peft.get_peft_model_state_dict(kept)
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in saved)
    with pytest.raises(RuntimeError, match="drop_frozen_weights"):
        gone[0].weight.sum()
    _saving_a_dropped_model_raises_with_the_fix(dropped.base_model.model, gone[0].weight, tmp_path)
    gone[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="drop_frozen_weights"):
        dropped(**batch)
    gone[0].weight.requires_grad_(False)
    dropped.to("cpu")  # a move to where it is changes nothing
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.revert(dropped)
    said = [r.getMessage() for r in caplog.records if "rounded to FP8" in r.getMessage()]
    assert len(said) == 1 and f": {len(gone)} frozen weights" in said[0], said  # once, with the count
    for name, p in dropped.base_model.model.named_parameters():
        if name.endswith("base_layer.weight") and name.split(".")[-3] in PROJECTIONS:
            original = originals[name.replace(".base_layer", "")]
            assert not isinstance(p, DroppedWeight) and 0 < relative_error(p, original) < FP8_ERROR[1]
    assert "revert" in DROPPED
    with pytest.raises(ValueError, match='precision="fp8"'):
        fusepatch.apply(tiny_model("qwen3_5_text"), drop_frozen_weights=True)


def _fp8_model(monkeypatch, **config):
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    torch.manual_seed(0)
    model = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256, **config).to(torch.bfloat16)
    fusepatch.apply(model, precision="fp8", verbose=False)
    return model


def _step(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_activation_checkpointing_recomputes_the_same_fp8_forward(monkeypatch):
    """Checkpointed layers run their FP8 projections again in the backward: the recompute quantizes the same
    inputs to the same bits, so loss and every gradient equal the run without checkpointing exactly."""
    model = _fp8_model(monkeypatch)
    batch = lm_batch(model, length=48)
    plain = _step(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed = _step(model, batch)
    assert torch.equal(plain[0], checkpointed[0])
    assert plain[1].keys() == checkpointed[1].keys()
    assert all(torch.equal(plain[1][n], checkpointed[1][n]) for n in plain[1])


def test_torch_compile_traces_the_fp8_projections(monkeypatch):
    """``torch.compile`` over a model with FP8 projections: dynamo traces the autograd function (the frozen-weight
    cache is skipped while compiling), and the compiled step's loss and gradients match the eager FP8 step's to
    bf16 rounding (inductor may fuse the quantization's elementwise ops differently)."""
    from torch._dynamo.utils import counters

    model = _fp8_model(monkeypatch)
    batch = lm_batch(model, length=32)
    eager = _step(model, batch)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        got = _step(compiled, batch)
    finally:  # dynamo's caches and counters are the process's: the next test starts without them
        torch._dynamo.reset()
        counters.clear()
    assert abs(got[0].item() - eager[0].item()) < 1e-2
    worst = max(relative_error(got[1][n], eager[1][n]) for n in eager[1])
    assert worst < 0.05, worst


def _lora_fp8(monkeypatch, **apply_kwargs):
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    model = _lora(tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16))
    fusepatch.apply(model, precision="fp8", verbose=False, **apply_kwargs)
    return model


def _logits_and_afresh(model, batch):
    """The model's logits now; and its logits after ``revert`` and ``apply`` again (every FP8 copy made anew)."""

    def logits():
        return model(**batch).logits.float()

    def afresh():
        fusepatch.revert(model)
        fusepatch.apply(model, precision="fp8", verbose=False)
        return logits()

    return logits, afresh


def test_a_merge_through_data_requantizes_the_frozen_base(monkeypatch):
    """peft's ``merge`` adds the adapters into the base weight through ``.data`` (its version does not move):
    the kept FP8 copies are dropped, so the merged model computes exactly what a model patched afresh over the
    merged weights computes, and likewise after ``unmerge``; a stale copy would compute the base without its
    adapters."""
    model = _lora_fp8(monkeypatch)
    batch = lm_batch(model, length=32)

    logits, afresh = _logits_and_afresh(model, batch)

    with torch.no_grad():
        unmerged = logits()
        with model.disable_adapter():
            base = logits()
        model.merge_adapter()
        merged = logits()
        assert torch.equal(merged, afresh())
        model.unmerge_adapter()
        assert torch.equal(logits(), afresh())
    assert relative_error(base, unmerged) > 0.2  # the adapters matter: a stale base would be far off
    assert not torch.equal(merged, base)


@pytest.mark.parametrize("model_type", [*(f for f in NOT_HYBRID if f not in MOE), HYBRID[0]])
@pytest.mark.parametrize("order", ["peft-first", "fusepatch-first"])
def test_merges_outside_the_fused_layers_requantize_the_frozen_base(monkeypatch, model_type, order):
    """A merge is followed wherever the base is called from: the dense families' attention runs transformers' own
    forward (peft's forward calls the FP8 base), and ``merge_and_unload`` leaves the bare base. Each merged model
    computes what a model patched afresh over the merged weights computes; a stale FP8 copy would compute the
    base without its adapters (as far off as the adapters move the logits)."""
    peft = pytest.importorskip("peft")
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    model = tiny_model(model_type, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    if order == "fusepatch-first":
        fusepatch.apply(model, precision="fp8", verbose=False)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    if order == "peft-first":
        fusepatch.apply(model, precision="fp8", verbose=False)
    batch = lm_batch(model, length=32)
    logits, afresh = _logits_and_afresh(model, batch)
    with torch.no_grad():
        with model.disable_adapter():
            base = logits()
        unmerged = logits()
        model.merge_adapter()
        assert torch.equal(logits(), afresh())
        model.unmerge_adapter()
        assert torch.equal(logits(), afresh())
        merged = model.merge_and_unload()
        got = merged(**batch).logits.float()
        fusepatch.revert(merged)
        fusepatch.apply(merged, precision="fp8", verbose=False)
        assert torch.equal(got, merged(**batch).logits.float())
    assert relative_error(base, unmerged) > 0.2  # the adapters matter: a stale base would be far off


@pytest.mark.parametrize("order", ["peft-first", "fusepatch-first"])
def test_modules_to_save_train_their_copies_in_fp8(monkeypatch, order):
    """peft's ``modules_to_save`` trains a copy of a projection (``o_proj.modules_to_save.default``) beside the
    frozen original (``o_proj.original_module``): in either order both are the layer's ``o_proj`` and run FP8,
    and the trained copy gets its weight gradient."""
    peft = pytest.importorskip("peft")
    calls = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    torch.manual_seed(0)
    model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj", "down_proj"])
    if order == "fusepatch-first":
        fusepatch.apply(model, precision="fp8", verbose=False)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    if order == "peft-first":
        fusepatch.apply(model, precision="fp8", verbose=False)
    fp8 = _fp8_modules(model)
    layers = model.config.num_hidden_layers
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        for held in ("modules_to_save.default", "original_module"):
            assert sum(path.endswith(f"{name}.{held}") for path in fp8) == layers, (name, held)
    calls.clear()
    model(**lm_batch(model, length=32)).loss.backward()
    # every projection of every layer ran an FP8 GEMM: q, k, v and gate, up, and the copies of o and down
    assert sum(call[0] == "fp8_linear" for call in calls) == 7 * layers, calls
    copies = [m for path, m in fp8.items() if path.endswith("modules_to_save.default")]
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in copies)


@pytest.mark.parametrize("order", ["peft-first", "fusepatch-first"])
def test_dora_bases_keep_their_weights_when_dropping(monkeypatch, caplog, order):
    """DoRA reads its base weight at every step (its column norms): with ``drop_frozen_weights=True`` the bases
    under DoRA adapters keep their weights, said with their count, and the rest are dropped; the step matches the
    same model patched without dropping. Applied before ``get_peft_model``, applying again after it keeps them."""
    from fusepatch.layers.fp8 import DroppedWeight

    peft = pytest.importorskip("peft")
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    config = peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj", "down_proj"], init_lora_weights=False)

    def build(**apply_kwargs):
        torch.manual_seed(0)
        model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
        if order == "fusepatch-first":
            fusepatch.apply(model, precision="fp8", verbose=False, **apply_kwargs)
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        fusepatch.apply(model, precision="fp8", verbose=False, **apply_kwargs)
        return model

    kept = build()
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        dropped = build(drop_frozen_weights=True)
    batch = lm_batch(dropped, length=32)
    expected, got = _step(kept, batch), _step(dropped, batch)
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(expected[1][n], got[1][n]) for n in expected[1])
    layers = dropped.config.num_hidden_layers
    weights = {n: p for n, p in dropped.named_parameters() if n.endswith(".weight")}
    under_dora = [p for n, p in weights.items() if "base_layer" in n]
    assert len(under_dora) == 2 * layers and not any(isinstance(p, DroppedWeight) for p in under_dora)
    assert sum(isinstance(p, DroppedWeight) for p in dropped.parameters()) == 5 * layers  # k, v, o, gate, up
    said = [r.getMessage() for r in caplog.records if "DoRA" in r.getMessage()]
    assert said and f"{2 * layers} frozen FP8 projections keep their weight" in said[-1]


def test_dora_added_after_a_step_dropped_its_base_is_said_with_the_fix(monkeypatch, caplog):
    """Applied with ``drop_frozen_weights=True`` before DoRA adapters, the first step drops the base it calls
    before DoRA reads it and raises the drop's message, which names DoRA; applying again keeps the bases not yet
    dropped and names the dropped one with the fix (reload, adapters, then apply), rather than claiming it kept."""
    peft = pytest.importorskip("peft")
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    torch.manual_seed(0)
    model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    config = peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    with pytest.raises(RuntimeError, match="DoRA"):
        model(**lm_batch(model, length=16))
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    said = " | ".join(r.getMessage() for r in caplog.records if "DoRA" in r.getMessage())
    layers = model.config.num_hidden_layers  # the first layer's base was dropped; the step raised there
    assert f"{layers - 1} frozen FP8 projections keep their weight" in said, said
    assert "1 frozen projections under DoRA" in said and "reload the model" in said, said


def test_merges_refresh_the_copies_in_place(monkeypatch):
    """peft's merge and unmerge write the bases through ``.data``: each base keeps its FP8 copy, the same buffers
    and their generation (``ops/prepared.py``: CUDA graphs that read them stay valid), quantized again in
    place from the merged values; a merge of what is merged already changes nothing."""
    model = _lora_fp8(monkeypatch)
    batch = lm_batch(model, length=16)
    logits, afresh = _logits_and_afresh(model, batch)
    modules = list(_fp8_modules(model).values())

    def kept():
        dispatches = [m._fusepatch.ops["fp8_linear"] for m in modules]
        return [(id(d.kept(m.weight).handle), d.generation_of(m.weight)) for d, m in zip(dispatches, modules)]

    with torch.no_grad():
        logits()
        copies = kept()
        model.merge_adapter()
        merged = logits()
        model.merge_adapter()  # merged already
        assert torch.equal(logits(), merged)
        model.unmerge_adapter()
        unmerged = logits()
        assert kept() == copies
        assert not torch.equal(merged, unmerged)
        model.merge_adapter()
        assert torch.equal(logits(), afresh())


def test_an_inference_mode_evaluation_does_not_break_training(monkeypatch):
    """A frozen base first quantized under ``torch.inference_mode`` (an evaluation loop) is not kept: the next
    training step quantizes it again and saves it for its backward."""
    model = _lora_fp8(monkeypatch)
    batch = lm_batch(model, length=32)
    with torch.inference_mode():
        model(**batch)
    model(**batch).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n and p.requires_grad)


def test_dropping_waits_for_the_fp8_kernel(monkeypatch):
    """Where FP8 falls back (here: the CPU without a stand-in), ``drop_frozen_weights=True`` drops nothing: the
    fallback computes with the weights, step after step. A dropped model deep-copies and saves whole."""
    import io

    from fusepatch.layers.fp8 import DroppedWeight

    torch.manual_seed(0)
    model = _lora(tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16))
    fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    batch = lm_batch(model, length=32)
    for _ in range(2):
        model(**batch).loss.backward()
    assert not any(isinstance(p, DroppedWeight) for p in model.parameters())
    dropped = _lora_fp8(monkeypatch, drop_frozen_weights=True)
    dropped(**batch).loss.backward()
    saved = io.BytesIO()
    torch.save(dropped, saved)  # (plain pickle cannot hold torch's float8 tensors)
    saved.seek(0)
    copies = [copy.deepcopy(dropped), torch.load(saved, weights_only=False)]
    with torch.no_grad():
        expected = dropped(**batch).logits
    for other in copies:
        weights = [p for p in other.parameters() if isinstance(p, DroppedWeight)]
        assert weights and all(w.device.type == "cpu" for w in weights)
        with torch.no_grad():  # the FP8 copies came along: the copy computes what the model does
            assert torch.equal(other(**batch).logits, expected)


def test_an_fp8_projection_without_adapters_beside_a_lora_one_is_its_own_output(monkeypatch):
    """Gate (FP8, no adapter) and up (LoRA over FP8) of one input: the gate's output is its own tensor, not a
    view out of the fused function, so it may be changed in place as transformers' MLP would."""
    peft = pytest.importorskip("peft")
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj"], init_lora_weights=False)
    model = peft.get_peft_model(
        tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16), config
    )
    fusepatch.apply(model, precision="fp8", verbose=False)
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    gate, up = projections.project(x, mlp.gate_proj, mlp.up_proj)
    gate.mul_(2)
    (gate * up).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_nan_stays_nan_through_the_quantization():
    """A NaN in a row (or a column, for the transposed operands) makes the whole row's scale NaN in the PyTorch
    twin, which the Triton kernels follow (tests/gpu/test_fp8.py): FP8 never turns a NaN gradient finite."""
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_columns_reference

    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    q, inverse = quantize_rows_reference(x)
    assert torch.isnan(inverse[1]) and torch.isnan(q[1].float()).all()
    assert torch.isfinite(inverse[[0, 2, 3]]).all()
    q, inverse = quantize_columns_reference(x, 16)
    assert torch.isnan(inverse[3]) and torch.isnan(q[3, :4].float()).all()


def test_disabled_and_second_merged_adapters_requantize(monkeypatch):
    """Which adapters are merged is what the kept copy follows: the first call under ``disable_adapter()`` over
    merged adapters (peft's forward unmerges them) and a second adapter merged beside the first each compute what
    a model patched afresh computes; a new storage (``weight.data = ...``) is seen too."""
    peft = pytest.importorskip("peft")
    model = _lora_fp8(monkeypatch)
    model.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    batch = lm_batch(model, length=32)

    logits, afresh = _logits_and_afresh(model, batch)

    with torch.no_grad():
        model.merge_adapter(["default"])
        logits()
        with model.disable_adapter():
            first = logits()
            assert torch.equal(first, afresh())
        model.merge_adapter(["default"])
        logits()
        model.merge_adapter(["other"])
        assert torch.equal(logits(), afresh())
        model.unmerge_adapter()
        logits()
        linear = next(iter(_fp8_modules(model).values()))
        linear.weight.data = linear.weight.data * 2  # new storage, same version
        assert torch.equal(logits(), afresh())


def test_a_dropped_base_cannot_lose_its_copy_to_a_merge(monkeypatch, caplog):
    """Adapters merged before ``apply`` with ``drop_frozen_weights=True``: unmerging raises (the weight is gone),
    and the FP8 copy, all that is left, stays: the model still runs, deep-copies and reverts."""
    torch.manual_seed(0)
    model = _lora(tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16))
    model.merge_adapter()
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    batch = lm_batch(model, length=32)
    with torch.no_grad():
        before = model(**batch).logits
        with pytest.raises(RuntimeError, match="drop_frozen_weights"):
            model.unmerge_adapter()
        model(**batch)
    copy.deepcopy(model)
    fusepatch.revert(model)
    assert before.isfinite().all()


def test_nothing_dropped_where_fp8_falls_back_is_said_once(caplog):
    """``drop_frozen_weights=True`` where FP8 falls back (the CPU): said once, with where the reason is."""
    torch.manual_seed(0)
    model = _lora(tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256).to(torch.bfloat16))
    fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    batch = lm_batch(model, length=32)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        model(**batch)
        model(**batch)
    said = [r.getMessage() for r in caplog.records if "nothing is dropped" in r.getMessage()]
    assert len(said) == 1, said


def test_an_fp8_run_under_inference_mode_does_not_say_it_falls_back(monkeypatch, caplog):
    """With the FP8 kernel chosen, a first call under ``torch.inference_mode`` keeps no copy and drops nothing
    yet; that is no fallback, and nothing says so. The next training call drops the weights."""
    from fusepatch.layers.fp8 import DroppedWeight

    model = _lora_fp8(monkeypatch, drop_frozen_weights=True)
    batch = lm_batch(model, length=32)
    with caplog.at_level(logging.WARNING, logger="fusepatch"), torch.inference_mode():
        model(**batch)
    assert not [r for r in caplog.records if "nothing is dropped" in r.getMessage()]
    model(**batch)
    assert any(isinstance(p, DroppedWeight) for p in model.parameters())


def test_the_self_test_runs_without_the_callers_autocast(monkeypatch):
    """The first call under autocast chooses the kernel: its self-test's fp32 reference runs without autocast."""
    from fusepatch.engine import selftest

    seen = []
    plain = selftest.compare
    monkeypatch.setattr(
        selftest, "compare", lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or plain(*a, **k)
    )
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    torch.manual_seed(0)
    model = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=256)
    fusepatch.apply(model, precision="fp8", verbose=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**lm_batch(model, length=32))
    assert seen and not any(seen), seen


def test_unaligned_projections_are_named_at_apply_and_left(caplog):
    """Projections whose weight has a dimension that is not a multiple of 16 cannot run FP8 GEMMs: ``apply``
    leaves them unpatched (the report counts only the others) and names them, once, with the reason."""
    model = tiny_model("qwen3_5_text", hidden_size=128, intermediate_size=120).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        fusepatch.apply(model, precision="fp8", verbose=False)
    patched = _fp8_modules(model)
    mlp = {n for n, m in model.named_modules() if n.rpartition(".")[2] in ("gate_proj", "up_proj", "down_proj")}
    assert patched and not mlp & set(patched)
    said = [r.getMessage() for r in caplog.records if "not a multiple of 16" in r.getMessage()]
    assert len(said) == 1 and f"{len(mlp)} modules run as before" in said[0] and "mlp.gate_proj" in said[0], said
    assert "compute in the model's dtype; nothing to fix" in said[0]


GRAPHS_FIX = "cuda_graphs=True"


@pytest.mark.parametrize(
    "hidden, cuda_graphs, kernel, advised",
    [
        (128, False, True, True),  # a narrow model, FP8 running: the step waits for the host, said with the fix
        (128, True, True, False),  # graphs asked for: the advice is taken
        (2304, False, True, False),  # wider than the shapes where FP8 measured slower
        (128, False, False, False),  # FP8 fell back (the CPU): its own fallback line says so, nothing more
    ],
)
def test_fp8_on_a_narrow_model_without_graphs_says_to_graph_it(
    monkeypatch, caplog, hidden, cuda_graphs, kernel, advised
):
    """At the widths where FP8 projections measured slower than bf16 per step without CUDA graphs (a 2B-like
    model's), ``apply(precision="fp8")`` says so with the fix; not where graphs are asked for, the model is wider,
    or FP8 does not run at all."""
    if kernel:
        cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
        monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    model = tiny_model("qwen3_5_text", hidden_size=hidden, intermediate_size=256).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        report = fusepatch.apply(model, precision="fp8", cuda_graphs=cuda_graphs, verbose=False)
    assert any(c.op == "fp8_linear" and c.fused for _, c in report.fused_ops) == kernel
    said = [
        r.getMessage() for r in caplog.records if "precision='fp8'" in r.getMessage() and "narrow" in r.getMessage()
    ]
    assert len(said) == advised, said
    if advised:
        assert f"hidden size {hidden}" in said[0] and GRAPHS_FIX in said[0] and "Fix:" in said[0]


@pytest.mark.parametrize(
    "model_type, first",
    [
        ("qwen3_5_text", {"cuda_graphs": True}),  # graphed by an earlier apply: the layers keep their graphs
        ("qwen3_5_text", {"precision": "fp8"}),  # said by the apply that patched FP8: not again
        ("qwen3_moe", None),  # mixture-of-experts layers take no graphs: the fix would not apply
    ],
    ids=["graphed-before", "fp8-before", "moe"],
)
def test_the_narrow_model_advice_is_not_said_where_graphs_cannot_be_the_fix(monkeypatch, caplog, model_type, first):
    """``apply(precision="fp8")`` without ``cuda_graphs`` on a narrow model says nothing of graphs where its layers
    replay from graphs already (an earlier ``apply(cuda_graphs=True)``: they keep them), where an earlier apply said
    it, or where its layers cannot be graphed (mixture-of-experts routing): FP8 runs in all three."""
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    model = tiny_model(model_type, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    if first is not None:
        fusepatch.apply(model, verbose=False, **first)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        report = fusepatch.apply(model, precision="fp8", verbose=False)
    assert any(c.op == "fp8_linear" for _, c in report.fused_ops)
    said = [r.getMessage() for r in caplog.records if "narrow model" in r.getMessage()]
    assert not said, said
