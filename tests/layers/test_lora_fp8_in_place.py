"""peft LoRA over FP8 bases, the adapters' products added in place into the base's output: each way of running the
model computes what it computes with that output copied first (bit for bit: nothing else holds it), and what peft
computes over the same FP8 projections unpatched; the FP8 function runs (``cpu_candidates``, bf16 and fp16). A
forward wrapping the base's (an accelerate hook, which may keep the output it returns) gets a copy."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import cpu_candidates

import fusepatch
from fusepatch.layers import layer_graphs
from fusepatch.layers.fp8 import PROJECTIONS
from fusepatch.layers.support import lora, projections
from fusepatch.ops.common import relative_error
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
from fusepatch.tools.tiny import tiny_model

peft = pytest.importorskip("peft")

# against peft over the same FP8 projections: the adapters' sums rounded in another order (16-bit)
CLOSE = {"loss": 5e-3, "logits": 2e-2, "grad": 0.15}


def _model(family="qwen3", dtype=torch.bfloat16, adapters=("default",), **lora_kwargs):
    model = tiny_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2).to(dtype).train()
    conf = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) | lora_kwargs
    model = peft.get_peft_model(model, peft.LoraConfig(**conf), autocast_adapter_dtype=False)
    torch.manual_seed(3)
    for name in adapters[1:]:
        model.add_adapter(name, peft.LoraConfig(**(conf | {"r": 8})))
    if len(adapters) > 1:
        model.base_model.set_adapter(list(adapters))
    return model


def _fp8_bases(model):
    """peft's model unpatched, each FP8 projection's base computing with the FP8 function (the reference)."""
    for name, module in model.named_modules():
        if lora.is_lora(module) and name.split(".")[-1] in PROJECTIONS:
            base = module.base_layer
            seat = "_old_forward" if "_hf_hook" in base.__dict__ else "forward"  # under an accelerate hook: inside
            setattr(base, seat, functools.partial(lambda m, x: fp8_linear(x, m.weight, m.bias), base))
    return model


@pytest.fixture
def fp8_on_cpu(monkeypatch, chunked_on_cpu):
    ran = cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    return ran


def _three(model, monkeypatch, ran, **apply_kwargs):
    """(peft over FP8 bases unpatched, patched, patched with the base output copied before the adapters')."""
    ref = _fp8_bases(copy.deepcopy(model))
    patched = copy.deepcopy(model)
    fusepatch.apply(patched, precision="fp8", verbose=False, **apply_kwargs)
    copied = copy.deepcopy(model)
    fusepatch.apply(copied, precision="fp8", verbose=False, **apply_kwargs)
    return ref, patched, copied


def _copying(monkeypatch):
    unviewed = lora._unviewed
    monkeypatch.setattr(lora, "_unviewed", lambda out: unviewed(out).clone())


def _step(model, ids, seed=0, **forward):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids, use_cache=False, **forward)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), grads


def _compare(ref, got, exact=False):
    (loss, grads), (got_loss, got_grads) = ref, got
    assert got_grads.keys() == grads.keys() and grads
    if exact:
        assert torch.equal(got_loss, loss), (got_loss, loss)
        for n, g in grads.items():
            assert torch.equal(got_grads[n], g), n
        return
    assert abs(got_loss - loss) / loss < CLOSE["loss"], (got_loss, loss)
    errors = {n: relative_error(got_grads[n], g) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < CLOSE["grad"], (worst, errors[worst])


def _run_all(monkeypatch, ran, model, run, in_place=True, **apply_kwargs):
    """``run(model)`` on the three; asserts the FP8 function ran in the patched ones, and whether an FP8 base's
    output (viewed) took the adapters in place (``in_place``; None: not asked); returns their results."""
    ref, patched, copied = _three(model, monkeypatch, ran, **apply_kwargs)
    want = run(ref)
    before, unviewed, unwrapped = len(ran), lora._unviewed, []

    def counted(out):
        base = unviewed(out)
        unwrapped.append(base is not out)
        return base

    with monkeypatch.context() as m:
        m.setattr(lora, "_unviewed", counted)
        got = run(patched)
    assert len(ran) > before, "the FP8 function did not run"
    if in_place is not None:
        assert any(unwrapped) == in_place, unwrapped
    with monkeypatch.context() as m:
        _copying(m)
        again = run(copied)
    return want, got, again


def _ids(model, length=16):
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("dtype", "checkpointing"),
    [(torch.float16, None), (torch.bfloat16, True), (torch.float16, False)],
    ids=["plain-fp16", "reentrant-bf16", "non-reentrant-fp16"],
)
def test_a_step_matches(fp8_on_cpu, monkeypatch, dtype, checkpointing):
    model = _model(dtype=dtype)
    ids = _ids(model)

    def run(m):
        if checkpointing is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
            if checkpointing:
                m.enable_input_require_grads()
        return _step(m, ids)

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run)
    _compare(want, got)
    _compare(again, got, exact=True)


@pytest.mark.parametrize(
    "case",
    ["several-adapters", "dropout", "rslora", "bias", "input-grads", "dora"],
)
def test_a_variant_matches(fp8_on_cpu, monkeypatch, case):
    kwargs, family = {}, "qwen3"
    adapters = ("default", "second") if case == "several-adapters" else ("default",)
    if case == "dropout":
        kwargs["lora_dropout"] = 0.3
    if case == "rslora":
        kwargs["use_rslora"] = True
    if case == "dora":
        kwargs["use_dora"] = True
    if case == "bias":
        family = "qwen2"  # q, k, v with a bias
    model = _model(family, adapters=adapters, **kwargs)
    ids = _ids(model)

    def run(m):
        if case == "input-grads":
            m.enable_input_require_grads()
        return _step(m, ids, seed=5)

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run, in_place=case != "dora")  # DoRA: peft's
    _compare(want, got)
    _compare(again, got, exact=True)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_forward_without_grad_matches(fp8_on_cpu, monkeypatch, mode):
    model = _model()
    ids = _ids(model)

    def run(m):
        with getattr(torch, mode)():
            return m(input_ids=ids, use_cache=False).logits.float()

    # (inference tensors keep no view bases: the output is written in place as it is)
    want, got, again = _run_all(
        monkeypatch, fp8_on_cpu, model, run, in_place=None if mode == "inference_mode" else True
    )
    assert relative_error(got, want) < CLOSE["logits"]
    assert torch.equal(got, again)


def test_generation_with_cache_matches(fp8_on_cpu, monkeypatch):
    model = _model()
    ids = _ids(model, 8)

    def run(m):
        m.eval()
        out = m.generate(
            input_ids=ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        return out.sequences, torch.stack(out.logits).float()

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run)
    assert relative_error(got[1], want[1]) < CLOSE["logits"]
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])


@pytest.mark.parametrize("where", ["lora", "base_layer", "mlp"])
def test_a_hook_writing_the_output_in_place(fp8_on_cpu, monkeypatch, where):
    model = _model()
    ids = _ids(model)

    def hook(module, args, out):
        (out[0] if isinstance(out, tuple) else out).mul_(1.5)

    def run(m):
        layer = m.base_model.model.model.layers[0]
        target = {
            "lora": layer.mlp.up_proj,
            "base_layer": layer.mlp.up_proj.base_layer,
            "mlp": layer.mlp,
            "self_attn": layer.self_attn,
        }[where]
        target.register_forward_hook(hook)
        return _step(m, ids)

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run)
    _compare(want, got)
    _compare(again, got, exact=True)


def test_layer_graphs_match(fp8_on_cpu, monkeypatch):
    monkeypatch.setattr(layer_graphs, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layer_graphs, "GRAPH", layer_graphs._Rerun)
    monkeypatch.setattr(layer_graphs, "WARM_CALLS", 1)
    model = _model()
    ids = _ids(model)

    def run(m):
        for _ in range(3):  # a steady step, the capture, a replay
            result = _step(m, ids)
        return result

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run, cuda_graphs=True)
    _compare(want, got)
    _compare(again, got, exact=True)


def test_autocast_over_an_fp32_model_matches(fp8_on_cpu, monkeypatch):
    model = _model(dtype=torch.float32)
    ids = _ids(model)

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(m, ids)

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run)
    _compare(want, got)
    _compare(again, got, exact=True)


def test_an_accelerate_hook_on_a_base_layer(fp8_on_cpu, monkeypatch):
    hooks = pytest.importorskip("accelerate.hooks")

    class Scale(hooks.ModelHook):
        def post_forward(self, module, output):
            return output.mul_(1.5)

    model = _model()
    ids = _ids(model)

    def run(m):
        hooks.add_hook_to_module(m.base_model.model.model.layers[0].mlp.up_proj.base_layer, Scale())
        return _step(m, ids)

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run)
    _compare(want, got)
    _compare(again, got, exact=True)


@pytest.mark.parametrize("before", [False, True], ids=["hooked-after-apply", "hooked-before-apply"])
def test_an_accelerate_hook_keeping_a_base_output_keeps_the_base_output(fp8_on_cpu, monkeypatch, before):
    """A hook that keeps the base layer's output (activation capture) sees what it saw unpatched: the base's output,
    without the adapters' products added to it afterwards."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Keep(hooks.ModelHook):
        def post_forward(self, module, output):
            self.kept = output
            return output

    def base(m):
        return m.base_model.model.model.layers[0].mlp.up_proj.base_layer

    model = _model()
    if before:
        hooks.add_hook_to_module(base(model), Keep())
    ids = _ids(model)
    kept = []

    def run(m):
        if not before:
            hooks.add_hook_to_module(base(m), Keep())
        result = _step(m, ids)
        kept.append(base(m)._hf_hook.kept.detach().float().clone())
        return result

    want, got, again = _run_all(monkeypatch, fp8_on_cpu, model, run, in_place=None)
    _compare(want, got)
    _compare(again, got, exact=True)
    assert relative_error(kept[1], kept[0]) < CLOSE["logits"], relative_error(kept[1], kept[0])


@pytest.mark.parametrize("before", [False, True], ids=["offloaded-after-apply", "offloaded-before-apply"])
def test_accelerate_cpu_offload_matches(fp8_on_cpu, before):
    """``cpu_offload`` hooks every module with weights, the adapters' A and B too, whose weights are on the meta
    device outside their hook's forward: those adapters run through peft, the FP8 bases inside their hooks."""
    accelerate = pytest.importorskip("accelerate")
    model = _model()
    ids = _ids(model)
    ref = _fp8_bases(copy.deepcopy(model))
    patched = copy.deepcopy(model)
    if before:
        accelerate.cpu_offload(patched, execution_device=torch.device("cpu"))
    fusepatch.apply(patched, precision="fp8", verbose=False)
    if not before:
        accelerate.cpu_offload(patched, execution_device=torch.device("cpu"))
    ran = len(fp8_on_cpu)
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits.float()
        got = patched(input_ids=ids, use_cache=False).logits.float()
    assert len(fp8_on_cpu) > ran, "the FP8 function did not run"
    assert relative_error(got, want) < CLOSE["logits"], relative_error(got, want)
