"""The decoder layer with the residual add fused into the post-attention norm, on CPU.

No fused kernel runs on a CPU, so a stand-in candidate (the eager reference, counting its calls) plays the fused
op: that makes the decoder take its fused forward, which must then equal the layer transformers ships (outputs
and every parameter gradient), under activation checkpointing, with packed rows, with a cache and under autocast,
on every family and on both supported transformers releases (CI runs the oldest and the newest).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ADD_OPS,
    HYBRID,
    HYBRID_PAIR,
    ONE_OF_EACH,
    assert_same_training,
    lm_batch,
    loss_and_grads,
    training_model,
)

import fusepatch
from fusepatch.tools.tiny import FAMILIES, tiny_model


def _in_model(calls: list[tuple]) -> list[tuple]:
    """The stand-in's calls from the model's layers (the self-test calls it too, on its own inputs)."""
    return [call for call in calls if call[2][:2] == (2, 29)]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fused_residual_forward_equals_the_layer_transformers_ships(model_type, calls):
    model = tiny_model(model_type).train()
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    report = fusepatch.apply(model, ops=ADD_OPS)
    decoder = next(layer for layer in report.layers if layer.layer.endswith("DecoderLayer"))
    assert [c.chosen for c in decoder.choices] == ["cpu-standin"]
    got = loss_and_grads(model, **batch)
    layers = model.config.num_hidden_layers
    ran = _in_model(calls)
    assert len(ran) == layers, f"the fused op ran {len(ran)} times for {layers} layers"
    wanted = "add_rms_norm_zero_centered" if model_type in HYBRID else "add_rms_norm"
    assert {name for name, _, _ in ran} == {wanted}
    # Only the add-norm op has a (stand-in) kernel, so the fused forward repeats transformers' arithmetic and
    # must agree bit for bit; in hybrid models the linear attention's eager path is fusepatch's chunked delta
    # rule, which agrees to fp32 rounding (test_patch.py).
    assert_same_training(expected, got, exact=model_type not in HYBRID)


@pytest.mark.parametrize("model_type", ONE_OF_EACH)
def test_fused_residual_forward_under_activation_checkpointing(model_type, calls):
    plain = tiny_model(model_type).train()
    checkpointed = tiny_model(model_type).train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = lm_batch(plain)
    expected = loss_and_grads(plain, **batch)
    fusepatch.apply(checkpointed, ops=ADD_OPS)
    got = loss_and_grads(checkpointed, **batch)
    layers = plain.config.num_hidden_layers
    assert len(_in_model(calls)) == 2 * layers, "forward + the backward's recompute, once per layer each"
    assert_same_training(expected, got, exact=model_type not in HYBRID)


@pytest.mark.parametrize("model_type", HYBRID)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_fused_residual_forward_with_packed_rows(model_type, checkpointing, calls):
    """Packed rows: every op patched (the linear attention needs its boundaries from the decoder layer, which
    now also runs the fused add); each document's loss equals the document alone."""
    model = training_model(model_type, checkpointing)
    fusepatch.apply(model)
    lengths = [19, 1, 33, 12]
    docs = [torch.randint(0, model.config.vocab_size, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[0]
    assert calls, "the fused forward must run for a packed batch"
    start = 0
    for doc in docs:
        alone = model(input_ids=doc[None], use_cache=False).logits[0]
        torch.testing.assert_close(logits[start : start + len(doc)], alone, rtol=1e-4, atol=1e-5)
        start += len(doc)


@pytest.mark.parametrize("model_type", ONE_OF_EACH)
def test_cached_generation_through_the_fused_forward(model_type, calls):
    model = tiny_model(model_type).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    fusepatch.apply(model, ops=ADD_OPS)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)
    assert calls, "generation must run the fused forward (the cache argument passed under its release's name)"


def test_mixed_dtypes_under_autocast_take_the_plain_add(calls):
    """Autocast over fp32 weights: the residual stream stays fp32 while the attention output is bf16, so the add
    promotes to fp32 in transformers' layer. The fused op needs one dtype: the layer keeps transformers' add."""
    model = tiny_model("qwen3").train()
    batch = lm_batch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(model, **batch)
    fusepatch.apply(model, ops=ADD_OPS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(model, **batch)
    assert not _in_model(calls), "no fused call on mixed dtypes"
    assert_same_training(expected, got, exact=True)


def test_without_a_fused_candidate_the_original_forward_runs(monkeypatch):
    """No fused add-norm for this device: the decoder's own forward runs (the layer's eager path is
    transformers' code, not a copy of it)."""
    model = tiny_model("qwen3").train()
    layer = model.model.layers[0]
    original = type(layer).forward
    entered = []

    def spy(self, *args, **kwargs):
        entered.append(True)
        return original(self, *args, **kwargs)

    fusepatch.apply(model)
    monkeypatch.setattr(type(layer), "forward", spy)
    layer._fusepatch.original = spy.__get__(layer)
    model(**lm_batch(model))
    assert entered


@pytest.mark.slow
def test_torch_compile_through_the_fused_forward(calls):
    """The fused decoder forward stays traceable: AOTAutograd traces it, forward and backward, as inductor would
    get it, and the loss and gradients are the uncompiled ones. (A model running fused kernels is kept outside
    dynamo, test_patch.py; here the stand-in kernels are traced as the plain torch code they are.)"""
    model = tiny_model("qwen3_5_text", **HYBRID_PAIR).train()
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    fusepatch.apply(model, ops=ADD_OPS)
    for module in model.modules():
        if hasattr(module, "_fusepatch"):
            module._fusepatch.traceable_on = "cpu"
    compiled = torch.compile(model, backend="aot_eager_decomp_partition")
    loss, logits, grads = loss_and_grads(compiled, **batch)
    got = (loss, logits, {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()})
    assert _in_model(calls), "the compiled model must run the fused op"
    assert_same_training(expected, got, exact=False)


def test_split_copy_of_the_conv_output():
    """The Gated DeltaNet layer's q/k/v on the GPU: contiguous copies of the conv output's channel ranges made
    by one ``split_with_sizes_copy`` (torch's fused CUDA kernel; the composite one here), whose backward is one
    ``cat``; an output left unused gets zeros. Checked against the views ``torch.split`` gives."""
    from fusepatch.layers.gated_deltanet import _SplitCopy, split_channels

    x = torch.randn(2, 7, 10, dtype=torch.float64, requires_grad=True)
    parts = _SplitCopy.apply(x, [3, 3, 4])
    assert all(p.is_contiguous() for p in parts)
    for got, want in zip(parts, torch.split(x, [3, 3, 4], dim=-1)):
        assert torch.equal(got, want)
    torch.autograd.gradcheck(lambda t: _SplitCopy.apply(t, [3, 3, 4]), (x,))
    q, _, v = _SplitCopy.apply(x, [3, 3, 4])
    (grad,) = torch.autograd.grad(q.sum() + 2 * v.sum(), x)
    assert torch.equal(grad[..., 3:6], torch.zeros_like(grad[..., 3:6])) and torch.equal(
        grad[..., 6:], 2 + 0 * grad[..., 6:]
    )
    assert all(p._base is x for p in split_channels(x, [3, 3, 4]))  # on the CPU: torch.split's views


def test_split_copy_tries_the_triton_split_and_says_once_when_it_fails(monkeypatch, caplog):
    """Where the Triton split runs it makes the copies; where it fails (a Triton that cannot build kernels here)
    the copy falls back to torch's op with one warning naming the fix, and does not try it again."""
    from fusepatch.layers import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "TRITON_SPLIT_DEVICES", ("cpu", "cuda"))
    x = torch.randn(2, 7, 10)
    want = torch.split(x, [3, 3, 4], dim=-1)
    used = []

    def working(t, sizes):
        used.append(tuple(sizes))
        return tuple(p.contiguous() for p in torch.split(t, sizes, dim=-1))

    monkeypatch.setattr(gated_deltanet, "_triton_split3", lambda: working)
    for got, expected in zip(gated_deltanet._SplitCopy.apply(x, [3, 3, 4]), want):
        assert torch.equal(got, expected)
    assert used == [(3, 3, 4)]
    gated_deltanet._SplitCopy.apply(x, [5, 5])  # two parts: torch's op
    assert used == [(3, 3, 4)]

    def broken(t, sizes):
        used.append("broken")
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(gated_deltanet, "_triton_split3", lambda: broken)
    with caplog.at_level("WARNING", logger="fusepatch"):
        for _ in range(2):
            for got, expected in zip(gated_deltanet._SplitCopy.apply(x, [3, 3, 4]), want):
                assert got.is_contiguous() and torch.equal(got, expected)
    assert used.count("broken") == 1, "tried once, then torch's op"
    warnings = [r.getMessage() for r in caplog.records if "Triton q/k/v split failed" in r.getMessage()]
    assert len(warnings) == 1 and "PTX assembly failed" in warnings[0] and "pip install triton" in warnings[0]


@pytest.mark.parametrize("model_type", HYBRID)
def test_gated_deltanet_with_split_copies_equals_the_unpatched_model(monkeypatch, model_type):
    """The linear-attention layer with q/k/v as split copies (the GPU path; on the CPU here): the patched model's
    loss, logits and every gradient equal the unpatched one's (the eager delta rule: fp32 rounding), and the
    copies were made once per linear-attention layer."""
    from fusepatch.layers import gated_deltanet

    made = []
    plain_split = gated_deltanet._SplitCopy.apply

    def counting(mixed, sizes):
        made.append(tuple(sizes))
        return plain_split(mixed, sizes)

    monkeypatch.setattr(gated_deltanet, "COPY_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(gated_deltanet._SplitCopy, "apply", counting)
    model = tiny_model(model_type).train()
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    fusepatch.apply(model)
    got = loss_and_grads(model, **batch)
    linear = sum(1 for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert linear and len(made) == linear
    assert_same_training(expected, got, exact=False)


def test_split_copies_step_aside_under_torch_compile(monkeypatch):
    """Under torch.compile the layer splits into views (the compiler fuses the copies itself; an autograd
    function writing through ``out=`` would break its graph): the compiled split equals the eager one."""
    from fusepatch.layers import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "COPY_DEVICES", ("cpu", "cuda"))
    seen = []
    plain = gated_deltanet._SplitCopy.apply
    monkeypatch.setattr(gated_deltanet._SplitCopy, "apply", lambda *a: seen.append(1) or plain(*a))

    def three(x):
        q, k, v = gated_deltanet.split_channels(x, [3, 3, 4])
        return q * 2 + k, v.sum(-1)

    x = torch.randn(2, 5, 10)
    expected = three(x)
    assert seen == [1]  # eager: the copy path
    torch._dynamo.reset()
    got = torch.compile(three, backend="eager", fullgraph=True)(x)
    assert seen == [1]  # compiled: views
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_shared_input_projections_and_residual_gemm_equal_the_unpatched_model(
    monkeypatch, model_type, checkpointing, calls
):
    """Every op patched, with the GPU-only projection paths run on the CPU (``projections.DEVICES``): the
    linear attention's four (Qwen3.5) or two (Qwen3-Next) input projections and every SwiGLU MLP's gate/up
    through one accumulated input gradient, the dense MLP's down projection adding the residual in its GEMM.
    Loss, logits and every gradient equal the unpatched model's, and each path ran where it should."""
    from fusepatch.layers.attention import gated_attention_forward
    from fusepatch.layers.simple import swiglu_mlp_forward
    from fusepatch.layers.support import projections

    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    shared, residual_gemms = [], []
    plain_apply, plain_plus = projections._SharedInputLinears.apply, projections.linear_plus
    monkeypatch.setattr(projections._SharedInputLinears, "apply", lambda *a: shared.append(a[1]) or plain_apply(*a))
    monkeypatch.setattr(projections, "linear_plus", lambda *a: residual_gemms.append(1) or plain_plus(*a))
    import fusepatch.layers.simple as simple

    monkeypatch.setattr(simple, "linear_plus", projections.linear_plus)
    model = training_model(model_type, checkpointing)
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    fusepatch.apply(model)
    got = loss_and_grads(model, **batch)
    passes = 2 if checkpointing else 1
    linear = sum(1 for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    patched = [m for m in model.modules() if getattr(getattr(m, "_fusepatch", None), "row", None) is not None]
    mlps = [m for m in patched if m._fusepatch.row.forward is swiglu_mlp_forward]
    dense = sum(1 for layer in model.model.layers if layer.mlp in mlps)
    # the gated attention's q/k/v (test_attention_gate.py)
    gated = sum(1 for m in patched if m._fusepatch.row.forward is gated_attention_forward)
    assert linear + len(mlps) or model_type == "qwen3_moe"  # the one family without a SwiGLU MLP module
    assert len(shared) == passes * (linear + len(mlps) + gated), (len(shared), linear, len(mlps), gated)
    assert len(residual_gemms) == passes * dense
    assert_same_training(expected, got, exact=False)


def test_residual_gemm_honours_hooks_but_not_profiler_labels(monkeypatch, calls):
    """The decoder calls its MLP's parts directly for the residual GEMM only when no hook on the MLP would be
    skipped: a user's forward hook sees the MLP's own output (the module is called); fusepatch's profiler labels
    are passive (the profiled step runs the same kernels as the timed ones)."""
    from fusepatch.diagnostics.profile import label_layers
    from fusepatch.layers import simple
    from fusepatch.layers.support import projections

    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    plus = []
    real = simple.linear_plus
    monkeypatch.setattr(simple, "linear_plus", lambda *a: plus.append(1) or real(*a))
    model = tiny_model("qwen3").train()
    batch = lm_batch(model)
    expected = loss_and_grads(model, **batch)
    fusepatch.apply(model)
    layers = model.config.num_hidden_layers
    with label_layers(model):
        got = loss_and_grads(model, **batch)
    assert len(plus) == layers
    assert_same_training(expected, got, exact=False)
    seen = []
    mlp = model.model.layers[0].mlp
    handle = mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    plus.clear()
    got = loss_and_grads(model, **batch)
    handle.remove()
    assert len(plus) == layers - 1 and seen == [(2, 29, model.config.hidden_size)]
    assert_same_training(expected, got, exact=False)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_shared_input_projections_under_autocast(monkeypatch, model_type, calls):
    """Autocast over fp32 weights (the Trainer's bf16): the projections still share one input gradient, cast as
    autocast casts them. Against the same patched model with the projections called one by one: the same loss
    and logits, bit for bit, and fp32 gradients that differ by where bf16 rounds the summed input gradient
    (one rounding per accumulating GEMM instead of one per add); the Gated DeltaNet's decay parameters, whose
    gradients sum over every token with cancellation, amplify that (the GPU tests' DECAY_TOL, 0.25)."""
    from fusepatch.layers.support import projections

    shared = []
    plain_apply = projections._SharedInputLinears.apply
    monkeypatch.setattr(projections._SharedInputLinears, "apply", lambda *a: shared.append(a[1]) or plain_apply(*a))
    model = tiny_model(model_type).train()
    batch = lm_batch(model)
    fusepatch.apply(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_a, logits_a, grads_a = loss_and_grads(model, **batch)
    assert not shared
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_b, logits_b, grads_b = loss_and_grads(model, **batch)
    assert shared, "the shared-input projections must run under autocast"
    assert torch.equal(loss_a, loss_b) and torch.equal(logits_a, logits_b)
    for name in grads_a:
        assert grads_b[name].dtype == torch.float32
        err = (grads_b[name] - grads_a[name]).norm() / grads_a[name].norm().clamp_min(1e-12)
        assert err < (0.25 if name.endswith(("A_log", "dt_bias")) else 2e-2), (name, float(err))
