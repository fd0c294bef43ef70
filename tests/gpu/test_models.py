"""Whole models of the families without linear attention (Qwen3, Qwen3-MoE, Qwen2, Qwen2-MoE) on a real GPU:
fused norms, SwiGLU, MoE experts and the fused loss inside a mini model, against the fp32 eager reference
(bounds in conftest.py), and a 30-step training run per family tracking the eager loss curve."""

from __future__ import annotations

import pytest
from conftest import MINI, compare_models, forward_syncs, loss_curves, model_failures, record
from helpers import HYBRID, MOE, NOT_HYBRID

pytestmark = pytest.mark.gpu
FAMILIES = list(NOT_HYBRID)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mini_model_logits_loss_and_every_gradient(model_type):
    errors, kernels32, kernels16 = compare_models(model_type)
    record(model_type, {"kernels_fp32": kernels32, "kernels_bf16": kernels16, "errors": errors})
    fused = {op: name for op, name in kernels16.items() if name != "eager"}
    assert fused, f"nothing fused in {model_type}: {kernels16}"
    failures = model_failures(errors)
    assert not failures, f"kernels fp32 {kernels32} bf16 {kernels16}; errors against fp32 eager: {failures}"


@pytest.mark.parametrize("model_type", FAMILIES + [f for f in HYBRID if f in MOE])
def test_thirty_training_steps_track_the_eager_loss_curve(model_type):
    eager_curve, fused_curve = loss_curves(model_type)
    assert eager_curve[-1] < eager_curve[0] - 0.5  # it learns (tokens drawn from a 64-token subset)
    gaps = [abs(a - b) / a for a, b in zip(eager_curve, fused_curve)]
    assert max(gaps) < 0.03, list(zip(eager_curve, fused_curve))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_moe"])
def test_prompt_masked_labels_run_the_loss_on_the_labelled_rows(model_type, monkeypatch):
    """Chat-SFT labels (the first 120 of every 301 labels -100): the fused loss gets the labelled rows only
    (layers/support/labelled_rows.py), and loss, logits and every gradient stay within the mini-model bounds against the
    fp32 eager model on the same labels."""
    from fusepatch.layers.support import labelled_rows

    seen = []
    select = labelled_rows.LabelledRows.select

    def spy(self, hidden):
        out = select(self, hidden)
        seen.append((hidden.shape[0], out[0].shape[0]))
        return out

    monkeypatch.setattr(labelled_rows.LabelledRows, "select", spy)
    errors, kernels32, kernels16 = compare_models(model_type, prompt=120)
    record(f"{model_type}-prompt", {"kernels_fp32": kernels32, "kernels_bf16": kernels16, "errors": errors})
    assert kernels16["linear_cross_entropy"] != "eager", kernels16
    # 2 rows x 301 positions: 2 x 120 prompt labels and each row's last position are ignored
    assert (602, 602 - 2 * 119 - 2) in seen, seen
    failures = model_failures(errors)
    assert not failures, f"kernels fp32 {kernels32} bf16 {kernels16}; errors against fp32 eager: {failures}"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_moe"])
def test_mini_model_with_the_mlp_product_recomputed(model_type, monkeypatch):
    """``FUSEPATCH_MLP_RECOMPUTE=1`` (layers/mlp_recompute.py): the MLPs' down projections recompute their input
    in the backward through the chosen SwiGLU kernel; loss, logits and every gradient stay within the mini-model
    bounds against the fp32 eager model, and the path ran."""
    from fusepatch.layers import mlp_recompute

    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")  # read by apply
    ran = []
    real = mlp_recompute._RecomputedDown.apply
    monkeypatch.setattr(mlp_recompute._RecomputedDown, "apply", lambda *a: ran.append(1) or real(*a))
    errors, kernels32, kernels16 = compare_models(model_type)
    record(f"{model_type}-mlp-recompute", {"kernels_fp32": kernels32, "kernels_bf16": kernels16, "errors": errors})
    assert ran and kernels16["swiglu"] != "eager", kernels16
    failures = model_failures(errors)
    assert not failures, f"kernels fp32 {kernels32} bf16 {kernels16}; errors against fp32 eager: {failures}"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2_moe"])
def test_forward_of_a_plain_batch_waits_for_nothing(model_type):
    """Labels and nothing else (no positions, mask or cache): the patched forward makes no call that waits for the
    GPU (layers/support/positions.py), so a training loop queues the next step behind the optimizer. The same batch with
    the caller's own positions makes transformers' packed-rows check wait: the guard sees real waits."""
    plain, own = forward_syncs(model_type)
    assert plain is None, plain
    assert own is not None and "synchroniz" in own, own


TRACED_WRONG = (
    "traced by dynamo on the H200 with every op eager, the Qwen3.5 mini model's logits are 0.127 off against the "
    "bound 0.016, as transformers' own model compiled: inductor's compile of transformers' rotary embedding gives "
    "wrong tables there (benchmarks/studies/trace_check.py); on the CPU the trace matches: apply traces patched "
    "forwards on the CPU only (TRACED_DEVICES)"
)
WRONG = pytest.mark.xfail(strict=True, raises=AssertionError, reason=TRACED_WRONG)
# Traced through the fused kernels on the H200 the same code matched in one run and was off in the next (two runs
# of 2026-12-04): inductor's compile of the rotary tables is not the same every time. Not strict, so either
# outcome is reported (XPASS / XFAIL) and neither hides the other.
SOMETIMES = pytest.mark.xfail(strict=False, raises=AssertionError, reason="sometimes: " + TRACED_WRONG)


@pytest.mark.parametrize(
    "model_type, mode",
    [
        ("qwen3", "outside-dynamo"),
        ("qwen3_5_text", "outside-dynamo"),
        ("qwen3_5_text", "without-kernels"),
        ("qwen3", "traced-through-kernels"),
        pytest.param("qwen3_5_text", "traced-without-kernels", marks=WRONG),
        pytest.param("qwen3_5_text", "traced-through-kernels", marks=SOMETIMES),
    ],
)
def test_inductor_compiled_patched_model_matches_the_uncompiled_one(model_type, mode):
    """``torch.compile`` (inductor) of a patched bf16 mini model: loss, logits and every gradient are as close to
    the fp32 eager model as the uncompiled patched model's (within 1.25x, plus a 1e-3 floor for rounding that
    inductor's own fusions reorder; the decay parameters' gradients within DECAY_TOL, as in every model test:
    on the CPU, inductor moved dt_bias's error from 0.019 to 0.026 on the eager ops). On a GPU the patched model
    runs outside dynamo, with fused kernels (not traceable ops) or without them (``without-kernels``: every op
    excluded, as on a GPU without the kernel packages; dynamo's trace of it is not checked there). The
    ``traced-*`` modes force dynamo through the patched forwards, with every op eager or through the fused
    kernels (breaking the graph at each), to show what apply keeps users from. The CPU tests trace with
    AOTAutograd and inductor."""
    import copy

    import torch
    from conftest import DECAY_TOL, MINI, eager, outputs

    import fusepatch
    from fusepatch.ops import OPS
    from fusepatch.ops.common import relative_error
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model(model_type, **MINI)
    ids = torch.randint(0, base.config.vocab_size, (2, 301), device="cuda")
    reference = outputs(eager(copy.deepcopy(base).cuda()), ids)
    model = copy.deepcopy(base).cuda().to(torch.bfloat16)
    fusepatch.apply(model, exclude=list(OPS) if mode.endswith("without-kernels") else ())
    states = [module._fusepatch for module in model.modules() if hasattr(module, "_fusepatch")]
    untraced = "cuda" if mode.endswith("without-kernels") else None
    assert states and all(s.traceable_on is None and s.untraced_on == untraced for s in states)
    if mode.startswith("traced"):
        for state in states:
            state.traceable_on = "cuda"
    plain = outputs(model, ids)
    # every layer instance is its own guard on the patched forward: past the default limit of 8 recompiles dynamo
    # would run the rest of the layers uncompiled, and the test would not test the trace
    with torch._dynamo.config.patch(recompile_limit=64):
        compiled = outputs(torch.compile(model), ids)
    compiled = {name.removeprefix("_orig_mod."): value for name, value in compiled.items()}
    worse = {}
    for name, ref in reference.items():
        bound = 1.25 * relative_error(plain[name], ref) + 1e-3
        if name.endswith(("A_log", "dt_bias")):  # sums that cancel: any reordering moves them (conftest.py)
            bound = max(bound, DECAY_TOL)
        got = relative_error(compiled[name], ref)
        if got > bound:
            worse[name] = (round(got, 5), round(bound, 5))
    assert not worse, worse


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fused_loss_outputs_are_transformers(model_type):
    """The fused loss on real kernels, bf16, in training: an fp32 loss as transformers' (within the bf16 bound
    against transformers' own bf16 model), NaN where transformers' is NaN (every label -100), and
    ``return_dict=False``'s tuple with every field at transformers' position, None in the logits' place."""
    import copy

    import torch

    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    reference = tiny_model(model_type, **MINI).cuda().to(torch.bfloat16).train()
    patched = copy.deepcopy(reference)
    report = fusepatch.apply(patched)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert chosen["linear_cross_entropy"] != "eager", chosen
    ids = torch.randint(0, reference.config.vocab_size, (2, 64), device="cuda")
    extra = {"output_router_logits": True} if "moe" in model_type else {}
    ref = reference(input_ids=ids, labels=ids, return_dict=False, **extra)
    got = patched(input_ids=ids, labels=ids, return_dict=False, **extra)
    at = 2 if extra else 1  # loss, [aux_loss], logits, cache, [router logits]
    assert len(got) == len(ref) and got[at] is None and ref[at].shape[:2] == ids.shape
    assert got[0].dtype == ref[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
    for index in range(len(ref)):
        if index != at:
            assert type(got[index]) is type(ref[index]), index
    ignored = torch.full_like(ids, -100)
    ref_nan = reference(input_ids=ids, labels=ignored, use_cache=False).loss
    got_nan = patched(input_ids=ids, labels=ignored, use_cache=False).loss
    assert ref_nan.isnan() and got_nan.isnan() and got_nan.dtype == torch.float32
