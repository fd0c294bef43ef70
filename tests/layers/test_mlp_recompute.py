"""The SwiGLU MLP's down projection with its input recomputed in the backward (``FUSEPATCH_MLP_RECOMPUTE=1``),
on the CPU (the path runs where ``projections.DEVICES`` allows; these tests add "cpu"): the same output and
gradients as the usual path, the product no longer kept, and the usual path wherever it steps aside."""

from __future__ import annotations

import pytest
import torch
from helpers import HYBRID, NOT_HYBRID, assert_same_training, lm_batch, loss_and_grads, training_model

import fusepatch
from fusepatch.layers import mlp_recompute
from fusepatch.layers.support import projections
from fusepatch.ops.swiglu.reference import swiglu_reference
from fusepatch.tools.tiny import FAMILIES


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")
    ran = []
    real = mlp_recompute._RecomputedDown.apply
    monkeypatch.setattr(mlp_recompute._RecomputedDown, "apply", lambda *a: ran.append(1) or real(*a))
    return ran


def _inputs(residual: bool, dtype=torch.float64):
    torch.manual_seed(0)
    down = torch.nn.Linear(10, 6, bias=False, dtype=dtype)
    gate, up = (torch.randn(3, 5, 10, dtype=dtype, requires_grad=True) for _ in range(2))
    res = torch.randn(3, 5, 6, dtype=dtype, requires_grad=True) if residual else None
    return down, gate, up, res


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_recomputed_down_equals_the_usual_path(on, residual):
    """Output and the gradients of gate, up, the down weight and the residual equal ``[residual +]
    down(swiglu(gate, up))`` through autograd (fp64), and torch's gradcheck passes through the recompute."""
    down, gate, up, res = _inputs(residual)
    out = mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True)
    assert on == [1]
    expected = down(swiglu_reference(gate, up)) + (res if residual else 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    cot = torch.randn_like(out)
    leaves = [gate, up, down.weight] + ([res] if residual else [])
    got = torch.autograd.grad(out, leaves, cot)
    want = torch.autograd.grad(expected, leaves, cot)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(
        lambda g, u, w, *r: mlp_recompute._RecomputedDown.apply(g, u, w, r[0] if r else None, swiglu_reference),
        (gate, up, down.weight, *([res] if residual else [])),
    )


def test_the_product_is_not_kept(on):
    """What the forward keeps for the backward: the usual path keeps the product (the down GEMM's input) beside
    gate and up; the recomputed one keeps gate, up and the weight only."""
    down, gate, up, res = _inputs(True)

    def kept(fn) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes)

    usual = kept(lambda: projections.linear_plus(down, swiglu_reference(gate, up), res))
    recomputed = kept(lambda: mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True))
    product = gate.numel()
    assert recomputed == 2 * gate.numel() + down.weight.numel()
    assert usual >= recomputed + product, (usual, recomputed, product)


def test_the_usual_path_runs_when_off_or_not_plain(monkeypatch, on):
    """Off (the default), without a gradient being recorded, a biased, hooked or autocast down projection, or a
    residual of another dtype: None, and the caller runs the usual path."""
    down, gate, up, res = _inputs(True)
    assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=False) is None
    with torch.no_grad():
        assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True) is None
    assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res.float(), enabled=True) is None
    biased = torch.nn.Linear(10, 6, dtype=torch.float64)
    assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, biased, res, enabled=True) is None
    handle = down.register_forward_hook(lambda *a: None)
    assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True) is None
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True) is None
    assert on == []


def test_on_for_the_models_patched_while_the_environment_says_so(monkeypatch):
    """The switch is the environment's ``FUSEPATCH_MLP_RECOMPUTE`` when ``apply`` runs (it was read once, at
    import): off unset and for "0", on for "1" and "true", for the models patched then; a value that is not a
    switch's is an error of ``apply``."""
    from fusepatch.tools.tiny import tiny_model

    for value, expected in ((None, False), ("0", False), ("1", True), ("true", True)):
        if value is None:
            monkeypatch.delenv("FUSEPATCH_MLP_RECOMPUTE", raising=False)
        else:
            monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", value)
        model = tiny_model("qwen3")
        fusepatch.apply(model)
        assert model.model.layers[0].mlp._fusepatch.mlp_recompute is expected, value
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "maybe")
    with pytest.raises(ValueError, match="FUSEPATCH_MLP_RECOMPUTE"):
        fusepatch.apply(tiny_model("qwen3"))


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - {"qwen3_moe"}))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_models_train_the_same_with_the_product_recomputed(on, calls, caplog, model_type, checkpointing):
    """Every family with a SwiGLU MLP module (dense, or an MoE block's shared expert): loss, logits and every
    gradient of the patched model with the recompute on equal the unpatched model's, plain and under activation
    checkpointing, and every such MLP ran through it (twice a step under checkpointing: the forward and the
    backward's recompute). The fused decoder forward runs (``calls``: the add-norms' CPU stand-ins), so the dense
    MLPs take the residual into their down projection, as on the GPU."""
    model = training_model(model_type, checkpointing)
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    fusepatch.apply(model)
    assert "FUSEPATCH_MLP_RECOMPUTE=1" in caplog.text  # apply says the path is on
    on.clear()  # the self-tests at apply run their own calls
    got = loss_and_grads(model, **batch)
    dense = sum(1 for m in model.modules() if type(m).__name__.endswith("MLP"))  # MoE shared experts too
    assert dense and len(on) == (2 if checkpointing else 1) * dense, (len(on), dense)
    assert_same_training(expected, got, exact=False)


def test_a_down_projection_that_keeps_its_input_is_said_once(monkeypatch, on, caplog):
    """Switched on over FP8 projections (their own GEMMs keep their input): the step runs the usual path, and
    the first training step says why the input is kept, once, with the fix; an evaluation says nothing."""
    import logging

    from helpers import cpu_candidates

    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
    from fusepatch.tools.tiny import tiny_model

    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    fusepatch.apply(model, precision="fp8", verbose=False)
    batch = lm_batch(model, length=16)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        with torch.no_grad():
            model(**batch)
        assert not [r for r in caplog.records if "keeps its input" in r.getMessage()]
        for _ in range(2):
            model(**batch).loss.backward()
    said = [r.getMessage() for r in caplog.records if "keeps its input" in r.getMessage()]
    assert len(said) == 1 and "FP8" in said[0] and "gradient_checkpointing_enable" in said[0], said
    assert on == []


def test_a_compiled_layer_says_the_compile_keeps_the_input(monkeypatch, on, caplog):
    """While torch.compile traces the layer the recompute steps aside (it runs outside a trace); the reason said
    is the compile's, not a guess about the projection."""
    import logging

    down, gate, up, res = _inputs(True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert mlp_recompute.recomputed_down(swiglu_reference, gate, up, down, res, enabled=True) is None
    said = [r.getMessage() for r in caplog.records if "keeps its input" in r.getMessage()]
    assert len(said) == 1 and "torch.compile traces the layer" in said[0], said


@pytest.mark.parametrize(
    ("model_type", "base", "targets", "autocast"),
    [
        *((family, base, "all-linear", False) for family in (HYBRID[0], NOT_HYBRID[0]) for base in ("bf16", "fp8")),
        (NOT_HYBRID[0], "bf16", ["down_proj"], False),  # the first layer's gate and up take no gradient
        (NOT_HYBRID[0], "bf16", "all-linear", True),  # fp32 weights, an fp32 residual stream, bf16 autocast
    ],
)
def test_lora_down_projections_recompute_the_product(monkeypatch, calls, model_type, base, targets, autocast):
    """peft LoRA over a bf16 or an FP8 base: with the switch on, the fused LoRA path keeps the MLP's gate and up
    (which the SwiGLU op keeps anyway) instead of the down projection's input, and computes the product again in
    the backward. The step's loss, logits and every gradient equal the step with the switch off bit for bit, and
    the forward keeps one product (tokens x intermediate, bf16) less a layer: under autocast too (the residual,
    fp32 there, added after the fused GEMMs), and only in the layers whose gate and up take a gradient (with LoRA
    on the down projections alone, not the first: there they would be kept only for the recompute)."""
    import copy

    from helpers import cpu_candidates
    from peft import LoraConfig, get_peft_model

    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
    from fusepatch.tools.tiny import tiny_model

    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    if base == "fp8":
        cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = tiny_model(model_type, hidden_size=128, intermediate_size=256).train()
    model = get_peft_model(model if autocast else model.to(torch.bfloat16), config, autocast_adapter_dtype=False)
    twin = copy.deepcopy(model)
    precision = "fp8" if base == "fp8" else None
    monkeypatch.delenv("FUSEPATCH_MLP_RECOMPUTE", raising=False)
    fusepatch.apply(model, precision=precision, verbose=False)
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")
    fusepatch.apply(twin, precision=precision, verbose=False)
    batch = lm_batch(model, length=32)

    def kept_and_step(m) -> tuple[int, tuple]:
        # the distinct storages the forward saves for a backward, held here so that none is freed and its memory
        # reused by another during the forward (a layer's inner autograd graph saves and frees some)
        storages: dict[int, torch.UntypedStorage] = {}

        def pack(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage
            return t

        m.zero_grad(set_to_none=True)
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            out = m(**batch)
        kept = sum(storage.nbytes() for storage in storages.values())
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        return kept, (out.loss.detach(), out.logits.detach(), grads)

    usual_bytes, usual = kept_and_step(model)
    recomputed_bytes, recomputed = kept_and_step(twin)
    assert_same_training(usual, recomputed, exact=True)
    tokens, layers = batch["input_ids"].numel(), model.config.num_hidden_layers
    recomputing = layers if targets == "all-linear" else layers - 1
    assert usual_bytes - recomputed_bytes == recomputing * tokens * 256 * 2


def test_lora_down_recompute_under_activation_checkpointing(monkeypatch, calls):
    """Under transformers' non-reentrant activation checkpointing the fused LoRA path's recompute runs again in
    the backward's recompute of the layer: the same loss, logits and gradients as without the switch, bit for
    bit."""
    import copy

    from peft import LoraConfig, get_peft_model

    from fusepatch.tools.tiny import tiny_model

    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = tiny_model(NOT_HYBRID[0], hidden_size=128, intermediate_size=256).to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, config, autocast_adapter_dtype=False)
    twin = copy.deepcopy(model)
    monkeypatch.delenv("FUSEPATCH_MLP_RECOMPUTE", raising=False)
    fusepatch.apply(model, verbose=False)
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")
    fusepatch.apply(twin, verbose=False)
    batch = lm_batch(model, length=32)
    from fusepatch.layers.support import lora

    recomputing = []
    real = lora.project
    monkeypatch.setattr(lora, "project", lambda *a, **k: recomputing.append(k.get("recompute")) or real(*a, **k))
    expected = loss_and_grads(model, **batch)
    recomputing.clear()
    got = loss_and_grads(twin, **batch)
    assert_same_training(expected, got, exact=True)
    # each layer's down projection, in the forward and again in the backward's recompute of the layer
    assert sum(r is not None for r in recomputing) == 2 * model.config.num_hidden_layers, recomputing
