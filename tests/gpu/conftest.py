import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import MINI  # noqa: E402,F401  (the GPU tests import it from here)


def _outcome(report) -> str | None:
    """A test's outcome as its record row says it (``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``,
    ``error`` for a failed setup or teardown), from the report of the phase that decides it; None for the others."""
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    return "skipped" if report.when == "setup" and report.skipped else None


def pytest_runtest_logreport(report):
    """As each test ends (FUSEPATCH_GPU_REPORT_DIR, files per pytest-xdist worker): its outcome and the seconds of
    the phase that decided it, the call's for a test that ran (its fixtures' setup apart: pytest times phases
    apart) (``outcomes-*.jsonl``, the GPU suite's record), and a failure's traceback (``failures-*.txt``). pytest prints
    them only when the whole run ends, which a run cut off at its time limit never reaches."""
    folder = os.environ.get("FUSEPATCH_GPU_REPORT_DIR")
    if not folder or getattr(report, "node", None) is not None:  # (xdist's controller copy)
        return
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    outcome = _outcome(report)
    if outcome is not None:
        row = {"test": report.nodeid, "file": report.nodeid.split("::")[0], "outcome": outcome}
        with open(os.path.join(folder, f"outcomes-{worker}.jsonl"), "a") as file:
            file.write(json.dumps({**row, "seconds": round(report.duration, 2)}) + "\n")
    if report.failed:
        with open(os.path.join(folder, f"failures-{worker}.txt"), "a") as file:
            file.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def require(verdict, what: str):
    """Skip when a kernel package is absent, unless FUSEPATCH_GPU_REQUIRE=1 (the H200 run), where it fails."""
    if verdict.ok:
        return
    message = f"{what}: {verdict.reason}"
    if os.environ.get("FUSEPATCH_GPU_REQUIRE") == "1":
        pytest.fail(message)
    pytest.skip(message)


def kernel(op: str, name: str, dtype):
    """Load candidate ``name`` of ``op`` after its checks (skip, or fail under FUSEPATCH_GPU_REQUIRE=1, if refused)."""
    from fusepatch.base.dtypes import dtype_name
    from fusepatch.base.env import capture
    from fusepatch.base.requirements import Inputs
    from fusepatch.engine.resolve import static_verdict
    from fusepatch.ops import OPS

    candidate = next(c for c in OPS[op].candidates if c.name == name)
    verdict, _ = static_verdict(candidate, capture(refresh=True))
    require(verdict, f"{op}/{name}")
    require(candidate.inputs.check(Inputs("cuda", dtype_name(dtype))), f"{op}/{name}")
    return candidate.load()


def compare(fn, reference, args, dtype, tol: float, extra=(), looser=None, **kwargs):
    """``fn`` on ``args`` cast to ``dtype`` against ``reference`` on fp64 copies: the output and every float
    input's gradient (``d<index>``) within ``tol``, or ``looser[name]`` for the quantities named there. Integer
    arguments (labels, expert indices) pass through."""
    from helpers import errors_against_fp64

    looser = looser or {}
    errors = errors_against_fp64(fn, reference, args, dtype, extra, **kwargs)
    record(os.environ.get("PYTEST_CURRENT_TEST", "op").split(" ")[0], {"tol": tol, "looser": looser, "errors": errors})
    bad = {k: v for k, v in errors.items() if not v <= looser.get(k, tol)}
    assert not bad, f"errors over {tol}: {bad} (all: {errors})"
    return errors


# --- whole models: a patched mini model against its fp32 eager reference (both model test files) ---
# fp32: the fused model in fp32 within FP32_TOL of the fp32 eager model (Triton's tf32 dots, amplified through
# the layers): proves the wiring and the kernels. bf16: a bf16 model differs from its fp32 self by rounding
# alone, by a few percent in some gradients; the fused bf16 model passes when its error against the fp32
# reference is at most FACTOR x the bf16 eager model's error + FLOOR. The decay parameters of the Gated
# DeltaNet layers (A_log, dt_bias) get at least DECAY_TOL at bf16 (see test_gdn_models.py). fla's delta rule
# refuses fp32, so the fp32 model runs it on the eager path: fp32 proves the wiring and the other kernels.
FACTOR = 3.0
FLOOR = 5e-3
FP32_TOL = 1e-2
DECAY_TOL = 0.25


def eager(model):
    """``model`` with every op held on its eager reference (same forwards as the fused model, no kernels)."""
    import fusepatch
    from fusepatch.ops import OPS

    fusepatch.apply(model, exclude=list(OPS))
    return model


def outputs(model, ids, labels=None, **kwargs) -> dict:
    """Loss, logits and every parameter gradient (fp32 copies) of one forward + backward (labels: ``ids``)."""
    model.zero_grad(set_to_none=True)
    labels = ids if labels is None else labels
    out = model(
        input_ids=ids, labels=labels, use_cache=False, return_logits=True, **kwargs
    )  # fused loss: ask for logits
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.float(), "logits": out.logits.float(), **grads}


def outputs_and_decay_scales(model, ids, **kwargs) -> tuple[dict, dict]:
    """``outputs(model, ids)`` and, for every Gated DeltaNet layer with its own ``in_proj_a`` (Qwen3.5), ``{A_log /
    dt_bias name: the sum over tokens of the absolute per-token terms of that parameter's gradient}`` (run it on
    the fp32 reference). Why: ``g = -exp(A_log) * softplus(a + dt_bias)``, so ``d dt_bias = sum_t da_t``
    and ``d A_log = sum_t da_t * softplus(z_t) / sigmoid(z_t)`` (``z = a + dt_bias``); those sums cancel to a
    small fraction of their terms, and their relative error is then bf16 rounding divided by that fraction (0.02
    to 0.6 between random inputs at layer 0 of the mini model, bf16 on either attention path). Measured against
    the terms' own size the error is bf16's again. The hooks make fusepatch call the projections as modules."""
    import torch

    captured, handles = {}, []
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in ("in_proj_a", "A_log", "dt_bias")):

            def hook(_, __, out, name=name):
                captured[name] = [out.detach()]
                out.register_hook(lambda grad, name=name: captured[name].append(grad.detach()))

            handles.append(module.in_proj_a.register_forward_hook(hook))
    try:
        result = outputs(model, ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    scales = {}
    for name, (a, da) in captured.items():
        module = model.get_submodule(name)
        z = (a.double() + module.dt_bias.double()).reshape(-1, a.shape[-1])
        da = da.double().reshape(-1, a.shape[-1])
        scales[f"{name}.dt_bias"] = da.abs().sum(0)
        scales[f"{name}.A_log"] = (da * torch.nn.functional.softplus(z) / torch.sigmoid(z)).abs().sum(0)
    return result, scales


def summand_error(got, ref, scale) -> float:
    """``||got - ref|| / ||scale||``: a gradient's error against the size of the terms it sums."""
    return ((got.double() - ref.double()).norm() / scale.norm().clamp_min(1e-30)).item()


def compare_models(model_type: str, length: int = 301, prompt: int = 0) -> tuple[dict, dict, dict]:
    """Errors against the fp32 eager mini model of ``model_type``: ``{quantity: {fp32, bf16, eager_bf16}}``,
    plus the kernels chosen per op at fp32 and bf16 (first patched layer that has the op). ``prompt``: the first
    so many labels of every row are -100, as chat SFT masks the prompt."""
    import copy

    import torch

    import fusepatch
    from fusepatch.ops.common import relative_error
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model(model_type, **MINI)
    ids = torch.randint(0, base.config.vocab_size, (2, length), device="cuda")
    labels = ids.clone()
    labels[:, :prompt] = -100
    reference = outputs(eager(copy.deepcopy(base).cuda()), ids, labels)
    eager16 = outputs(eager(copy.deepcopy(base).cuda().to(torch.bfloat16)), ids, labels)
    fused, kernels = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(base).cuda().to(dtype)
        report = fusepatch.apply(model)
        fused[dtype] = outputs(model, ids, labels)
        kernels[str(dtype)[6:]] = {c.op: c.chosen for layer in reversed(report.layers) for c in layer.choices}
    errors = {
        name: {
            "fp32": relative_error(fused[torch.float32][name], ref),
            "bf16": relative_error(fused[torch.bfloat16][name], ref),
            "eager_bf16": relative_error(eager16[name], ref),
        }
        for name, ref in reference.items()
    }
    return errors, kernels["float32"], kernels["bfloat16"]


def model_failures(errors: dict) -> dict:
    """The quantities outside the bounds stated above."""
    failures = {}
    for name, e in errors.items():
        if not e["fp32"] <= FP32_TOL:
            failures[f"{name} fp32"] = e
        bound = FACTOR * e["eager_bf16"] + FLOOR
        if name.endswith(("A_log", "dt_bias")):
            bound = max(bound, DECAY_TOL)
        if not e["bf16"] <= bound:
            failures[f"{name} bf16"] = e
    return failures


def record(name: str, data: dict) -> None:
    """Keep the measured errors (FUSEPATCH_GPU_REPORT_DIR, one file per pytest-xdist worker), before asserting:
    a run cut off by its time limit still brings back what each finished test measured."""
    import json

    folder = os.environ.get("FUSEPATCH_GPU_REPORT_DIR")
    if os.environ.get("TRITON_F32_DEFAULT"):  # fp32 dots in full precision instead of tf32: a separate record
        name += f" [TRITON_F32_DEFAULT={os.environ['TRITON_F32_DEFAULT']}]"
    if folder:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"model-errors-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json")
        existing = json.load(open(path)) if os.path.exists(path) else {}
        existing[name] = data
        json.dump(existing, open(path, "w"), indent=1)


def loss_curves(model_type: str, steps: int = 30) -> tuple[list[float], list[float]]:
    """Eager and fused bf16 mini models trained side by side with AdamW on the same batches."""
    import copy

    import torch

    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model(model_type, **MINI)
    models = [eager(copy.deepcopy(base).cuda().to(torch.bfloat16)), copy.deepcopy(base).cuda().to(torch.bfloat16)]
    fusepatch.apply(models[1])
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 64, (4, 256), device="cuda", generator=generator) for _ in range(steps)]
    curves = []
    for model in models:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves.append(losses)
    return curves[0], curves[1]


def forward_syncs(model_type: str) -> tuple[str | None, str | None]:
    """The patched bf16 mini model's forward with labels under torch's sync debug mode ("error": every call that
    waits for the GPU raises): ``(what a plain batch's forward raised, what the same batch with the caller's own
    positions raised)``, ``None`` where nothing waited. The first forward and backward run before, unguarded
    (self-tests, compiles). sdpa attention, as the benchmarks and real models use: with eager attention
    transformers builds a float mask from a scalar it copies to the GPU (masking_utils ``eager_mask``), a wait of
    its own that the first GPU run of this test found (H200 run of 2026-11-30)."""
    import torch

    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model(model_type, attn_implementation="sdpa", **MINI).cuda().to(torch.bfloat16)
    fusepatch.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 301), device="cuda")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    own = torch.arange(301, device="cuda")[None].expand(2, -1).clone()
    raised = []
    for extra in ({}, {"position_ids": own}):
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(input_ids=ids, labels=ids, use_cache=False, **extra).loss
        except RuntimeError as exc:
            import traceback

            # where: the innermost frames of the library code that made the call
            torch_dir = os.path.dirname(torch.__file__)  # torch's own frames; transformers' and fla's stay
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
            where = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
            raised.append(f"{str(exc).splitlines()[0]} at {where}")
        else:
            raised.append(None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if raised[-1] is None:
            loss.backward()
    return raised[0], raised[1]
