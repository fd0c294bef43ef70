"""peft LoRA linears fused with their base GEMM (fusepatch.layers.support.lora), on the CPU in fp64.

The fused path runs where ``projections.DEVICES`` allows (CUDA); these tests add "cpu". Every comparison is
against peft's own modules on the same weights and inputs: outputs, the input gradient and every parameter
gradient, with dropout drawing peft's masks from the same generator state.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import lm_batch

import fusepatch
from fusepatch.layers.support import lora, projections
from fusepatch.tools.tiny import tiny_model

peft = pytest.importorskip("peft")

FP64 = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture
def fused(monkeypatch):
    """The fused path on the CPU; the list of layouts it computed (one per call)."""
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    ran = []
    plain = lora._LoraLinears.apply
    monkeypatch.setattr(lora._LoraLinears, "apply", lambda *a: ran.append(a[2]) or plain(*a))
    return ran


class _Projections(torch.nn.Module):
    """Several linears of one input, as a layer holds them (peft wraps them in place)."""

    def __init__(self, sizes: tuple[int, ...], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.names = [f"p{i}" for i in range(len(sizes))]
        for name, size in zip(self.names, sizes):
            setattr(self, name, torch.nn.Linear(8, size, bias=bias, dtype=dtype))

    def linears(self) -> tuple[torch.nn.Module, ...]:
        return tuple(getattr(self, name) for name in self.names)


def _wrapped(sizes=(5, 7, 3), bias=False, dropout=0.0, dtype=torch.float64, adapters=("default",), **config):
    torch.manual_seed(0)
    module = _Projections(sizes, bias, dtype)
    ranks = config.pop("ranks", (4,) * len(adapters))
    alphas = config.pop("alphas", (8,) * len(adapters))
    conf = dict(target_modules=module.names, lora_dropout=dropout, init_lora_weights=False, **config)
    model = peft.get_peft_model(module, peft.LoraConfig(r=ranks[0], lora_alpha=alphas[0], **conf), adapters[0])
    for name, r, alpha in zip(adapters[1:], ranks[1:], alphas[1:]):
        model.add_adapter(name, peft.LoraConfig(r=r, lora_alpha=alpha, **conf))
    model.base_model.set_adapter(list(adapters))
    for layer in model.base_model.model.linears():  # peft freezes inactive adapters only; make every one train
        for p in layer.parameters():
            p.requires_grad_(p is not layer.base_layer.weight or bias)
    return model


def _run(linears, x, cotangents, call, residual=None):
    """Outputs and the gradients of x, the residual and every trainable parameter, through ``call``."""
    x = x.detach().requires_grad_(True)
    res = None if residual is None else residual.detach().requires_grad_(True)
    outs = call(x, res)
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents) if c is not None)
    params = [p for linear in linears for p in linear.parameters() if p.requires_grad]
    inputs = [x] + ([res] if res is not None else []) + params
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [o.detach() for o in outs], grads


def _assert_same(got, expected):
    for a, b in zip(got[0], expected[0]):
        torch.testing.assert_close(a, b, **FP64)
    assert len(got[1]) == len(expected[1])
    for i, (a, b) in enumerate(zip(got[1], expected[1])):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(a, b, **FP64, msg=f"gradient {i}")


@pytest.mark.parametrize(
    "case",
    [
        dict(sizes=(5,)),
        dict(sizes=(5, 7, 3)),
        dict(sizes=(5, 7), bias=True),
        dict(sizes=(5, 7), adapters=("a", "b"), ranks=(4, 2), alphas=(8, 3)),
        dict(sizes=(5, 7), use_rslora=True),
        dict(sizes=(5, 7, 3), dropout=0.25),
        dict(sizes=(5, 7), dropout=0.5, adapters=("a", "b"), ranks=(3, 2), alphas=(6, 2)),
    ],
    ids=["one", "three", "bias", "two-adapters", "rslora", "dropout", "dropout-two-adapters"],
)
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "one-unused"])
def test_fused_projections_equal_peft(fused, case, unused):
    """Outputs, the input gradient and every adapter's (and bias's) gradient equal peft's modules', for one or
    several projections of one input, one or two adapters of different ranks and scalings, rsLoRA, dropout
    (same generator state, same masks) and an output whose gradient never comes."""
    model = _wrapped(**case)
    linears = model.base_model.model.linears()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    cotangents = [torch.randn(2, 6, linear.out_features, dtype=torch.float64) for linear in linears]
    if unused and len(linears) > 1:
        cotangents[1] = None
    model.train()
    torch.manual_seed(7)
    expected = _run(linears, x, cotangents, lambda x, _: [linear(x) for linear in linears])
    torch.manual_seed(7)
    got = _run(linears, x, cotangents, lambda x, _: projections.project(x, *linears))
    assert len(fused) == 1 and fused[0][0][1], fused  # the fused path ran, with adapters
    _assert_same(got, expected)


def test_residual_and_single_linear_equal_peft(fused):
    """``linear_plus`` (the MLP's down projection plus the residual) and ``apply_linear`` (o_proj, out_proj)
    on a LoRA linear: peft's sum and gradients, the residual's gradient included."""
    model = _wrapped(sizes=(5,))
    (linear,) = model.base_model.model.linears()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    residual = torch.randn(3, 4, 5, dtype=torch.float64)
    cot = [torch.randn(3, 4, 5, dtype=torch.float64)]
    expected = _run([linear], x, cot, lambda x, r: [r + linear(x)], residual)
    got = _run([linear], x, cot, lambda x, r: [projections.linear_plus(linear, x, r)], residual)
    _assert_same(got, expected)
    expected = _run([linear], x, cot, lambda x, _: [linear(x)])
    got = _run([linear], x, cot, lambda x, _: [projections.apply_linear(linear, x)])
    _assert_same(got, expected)
    assert len(fused) == 2


def test_merged_disabled_and_hooked_adapters_run_through_peft(fused):
    """Merged or disabled adapters, and a hook on a LoRA linear, are peft's to run: the modules are called."""
    model = _wrapped(sizes=(5, 7))
    linears = model.base_model.model.linears()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        with model.disable_adapter():
            for out, linear in zip(projections.project(x, *linears), linears):
                torch.testing.assert_close(out, linear.base_layer(x), **FP64)
        model.merge_adapter()
        merged = [linear(x) for linear in linears]
        for out, ref in zip(projections.project(x, *linears), merged):
            torch.testing.assert_close(out, ref, **FP64)
        model.unmerge_adapter()
    seen = []
    handle = linears[0].register_forward_hook(lambda *a: seen.append(1))
    projections.project(x, *linears)
    handle.remove()
    assert seen == [1] and fused == []
    projections.project(x, *linears)
    assert len(fused) == 1  # and without any of those, fused again


@pytest.mark.parametrize("where", ["lora_A", "lora_B", "lora_linear"])
def test_a_forward_set_on_an_adapter_or_lora_linear_runs_through_peft(fused, where):
    """A forward set on the instance of an adapter's A or B, or of the LoRA linear, runs: accelerate's offload
    hook (``cpu_offload``) keeps the weights on the meta device outside its forward, which the fused GEMMs would
    read instead."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = _wrapped(sizes=(5, 7))
    linears = model.base_model.model.linears()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    target = linears[0] if where == "lora_linear" else getattr(linears[0], where)["default"]
    if where == "lora_linear":
        target.forward = lambda x, forward=target.forward: forward(x) * 2  # a user's wrapper
    else:
        weights = {"weight": target.weight.detach().clone()}
        hooks.add_hook_to_module(target, hooks.AlignDevicesHook("cpu", offload=True, weights_map=weights))
        assert target.weight.device.type == "meta"
    with torch.no_grad():
        expected = [linear(x) for linear in linears]
        for out, ref in zip(projections.project(x, *linears), expected):
            torch.testing.assert_close(out, ref, **FP64)
    assert fused == []


def test_fp32_adapters_over_bf16_without_autocast_run_as_autocast_would(fused, caplog):
    """peft's default keeps fp32 adapters over a bf16 base (``autocast_adapter_dtype``) and, without autocast,
    computes them in fp32 (slow FFMA GEMMs on a GPU). The fused path runs their GEMMs in bf16, as autocast would:
    said once at INFO; outputs and every gradient as close to peft's fp32 adapters as peft's own autocast run is
    (measured here, times 2); the adapters' gradients in fp32."""
    model = _wrapped(sizes=(48, 40), dtype=torch.bfloat16)
    linears = model.base_model.model.linears()
    assert linears[0].lora_A["default"].weight.dtype == torch.float32
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 8, generator=generator).to(torch.bfloat16)
    cotangents = [torch.randn(4, 16, n, generator=generator).to(torch.bfloat16) for n in (48, 40)]
    peft_fp32 = _run(linears, x, cotangents, lambda x, _: [linear(x) for linear in linears])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peft_autocast = _run(linears, x, cotangents, lambda x, _: [linear(x) for linear in linears])
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        got = _run(linears, x, cotangents, lambda x, _: projections.project(x, *linears))
        projections.project(x, *linears)
    assert len(fused) == 2
    said = [r.getMessage() for r in caplog.records if "peft LoRA adapters" in r.getMessage()]
    assert len(said) == 1 and "float32 over bfloat16" in said[0] and "as autocast" in said[0], said

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    for name, ours, autocast, exact in zip(
        [f"out{i}" for i in range(2)] + ["x"] + [f"grad{i}" for i in range(len(got[1]) - 1)],
        [*got[0], *got[1]],
        [*peft_autocast[0], *peft_autocast[1]],
        [*peft_fp32[0], *peft_fp32[1]],
    ):
        assert ours.dtype == exact.dtype, name  # adapter gradients fp32, activations bf16
        assert error(ours, exact) <= 2 * error(autocast, exact) + 1e-3, (name, error(ours, exact))


def test_other_lora_layer_kinds_fall_back_saying_why(fused, caplog):
    """A peft LoRA layer of another kind (QLoRA's ``Linear4bit`` is one: its base GEMM is bitsandbytes') runs
    through its own forward, and the reason is said once."""
    model = _wrapped(sizes=(5,))
    (linear,) = model.base_model.model.linears()

    class Linear4bitLike(type(linear)):  # a LoRA layer class that is not lora.Linear itself
        pass

    linear.__class__ = Linear4bitLike
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        out = projections.apply_linear(linear, x)
    torch.testing.assert_close(out, linear(x), **FP64)
    said = [r.getMessage() for r in caplog.records if "peft LoRA" in r.getMessage()]
    assert len(said) == 1 and "Linear4bitLike" in said[0] and "own GEMM" in said[0], said
    assert fused == []


def _lora_model(model_type: str, dropout: float = 0.0):
    torch.manual_seed(0)
    model = tiny_model(model_type).double()
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def _loss_and_grads(model, batch, seed=3):
    model.train()
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_patched_lora_model_equals_peft(monkeypatch, fused, model_type, dropout):
    """A LoRA model (every linear adapted) patched by fusepatch: its attention, linear-attention and MLP
    projections go through the fused path. Loss, logits and every adapter gradient equal the same patched model
    calling peft's modules (fp64: only the LoRA arithmetic differs), and peft's model unpatched within the
    CPU tolerances of every patched-model test (transformers' norms compute in fp32 whatever the dtype)."""
    from helpers import assert_same_training

    alone = _lora_model(model_type, dropout)
    batch = lm_batch(alone)
    expected_alone = _loss_and_grads(alone, batch)
    model = _lora_model(model_type, dropout)
    fusepatch.apply(model)
    monkeypatch.setattr(projections, "DEVICES", ("cuda",))  # peft's modules inside fusepatch's layers
    expected = _loss_and_grads(model, batch)
    assert fused == []
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    got = _loss_and_grads(model, batch)
    assert fused, "the fused LoRA path never ran"
    # every adapted linear that fusepatch's layers call: all of Qwen3.5's; Qwen3's MLPs (its attention forward
    # is transformers' own, which calls peft's modules)
    adapted = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    expected_count = len(adapted) if model_type == "qwen3_5_text" else sum(".mlp." in n for n in adapted)
    assert sum(len(layout) for layout in fused) == expected_count > 0, (fused, adapted)
    torch.testing.assert_close(got[0], expected[0], **FP64)
    torch.testing.assert_close(got[1], expected[1], **FP64)
    assert set(got[2]) == set(expected[2])
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, **FP64, msg=name)
    assert_same_training(expected_alone, got)


def test_apply_reports_lora_linears_and_says_why_others_are_not_fused(caplog):
    """``apply`` counts the peft LoRA linears it can fuse, and says for the others why not: peft's default (fp32
    adapters over a bf16 model) is fusable, with or without autocast; DoRA adapters are named with their reason."""
    torch.manual_seed(0)
    model = peft.get_peft_model(
        tiny_model("qwen3_5_text").to(torch.bfloat16),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    adapted = sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear))
    report = fusepatch.apply(model)
    assert report.lora == {"linears": adapted, "fusable": adapted, "unfused": {}} and adapted > 0
    fusepatch.revert(model)
    report = fusepatch.apply(model, compute_dtype=torch.bfloat16)
    assert report.lora == {"linears": adapted, "fusable": adapted, "unfused": {}}
    torch.manual_seed(0)
    dora = peft.get_peft_model(
        tiny_model("qwen3_5_text").to(torch.bfloat16),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True),
    )
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        report = fusepatch.apply(dora)
    assert report.lora["linears"] == adapted and report.lora["fusable"] == 0
    ((line, count),) = report.lora["unfused"].items()
    assert count == adapted and "LoRA variant" in line, line
    said = [r.getMessage() for r in caplog.records]
    assert any(f"0 of {adapted} peft LoRA linears" in m for m in said)
    assert report.to_dict()["lora"] == report.lora
