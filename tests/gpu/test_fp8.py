"""FP8 projections on the H200: the Triton quantization kernels (rows, rows with a factor per column, columns
written transposed and padded) against their PyTorch twins (the same bits), the FP8 GEMMs' error against fp32 at
the 27B layer widths for a trained and a frozen weight, a mini Qwen3.5 model trained with
``apply(model, precision="fp8")`` against the same model patched in bf16, the same with peft LoRA, under FSDP2
(NCCL, world size 1) and compiled against the same FP8 model plain, and a model converted with torchao first; a
frozen weight's kept copy checked and requantized on the device (no host sync, under CUDA graph capture)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import MINI, kernel, record

from fusepatch.ops.common import relative_error

pytestmark = pytest.mark.gpu
FP8_ERROR = (0.02, 0.05)  # as on the CPU (tests/ops/fp8_linear): FP8's rounding, and not bf16's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(301, 5120), (64, 17408), (7, 1000)], ids=["hidden", "intermediate", "odd"])
def test_quantize_kernel_gives_the_reference_bits(shape, dtype):
    from fusepatch.kernels.fp8 import quantize_rows
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_rows_reference

    x = torch.randn(shape, device="cuda").to(dtype)
    x[0] *= 1e4
    x[1] = 0
    q, inverse = quantize_rows(x)
    want_q, want_inverse = quantize_rows_reference(x)
    assert torch.equal(inverse, want_inverse)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    strided = torch.randn(shape[1] + 32, shape[0], device="cuda").to(dtype).t()[:, : shape[1]]  # rows not packed
    assert torch.equal(
        quantize_rows(strided)[0].view(torch.uint8), quantize_rows_reference(strided)[0].view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "shape", [(301, 5120), (4096, 1024), (2500, 80), (7, 1000), (0, 64)], ids=["pad", "tall", "peaks", "odd", "empty"]
)
def test_column_and_factor_kernels_give_the_reference_bits(shape, dtype):
    from fusepatch.kernels.fp8 import quantize_columns, quantize_rows
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_columns_reference, quantize_rows_reference

    x = torch.randn(shape, device="cuda").to(dtype)
    if shape[0] > 2:
        x[:, 0] *= 1e4
        x[:, 1] = 0
    for multiple in (1, 16):
        q, inverse = quantize_columns(x, multiple)
        want_q, want_inverse = quantize_columns_reference(x, multiple)
        assert q.shape == want_q.shape and torch.equal(inverse, want_inverse)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    from fusepatch.kernels.fp8 import transpose

    q = quantize_rows(x)[0]
    assert torch.equal(transpose(q).view(torch.uint8), q.t().contiguous().view(torch.uint8))
    factor = torch.exp2(torch.randint(-8, 8, (shape[1],), device="cuda").float())
    q, inverse = quantize_rows(x, factor)
    want_q, want_inverse = quantize_rows_reference(x, factor)
    assert torch.equal(inverse, want_inverse) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize(
    "tokens, inputs, outputs", [(4096, 5120, 7168), (4096, 17408, 5120), (1000, 2048, 6144)], ids=["qkv", "down", "2b"]
)
def test_fp8_gemms_on_the_gpu(tokens, inputs, outputs, frozen):
    """Output and both gradients in FP8's band against fp32 at the 27B and 2B-like widths (1000 tokens: the
    weight gradient's token dimension padded); a frozen weight (LoRA's base): output and input gradient, through
    the forward's FP8 weight."""
    fn = kernel("fp8_linear", "scaled-mm", torch.bfloat16)
    x = torch.randn(tokens, inputs, device="cuda")
    w = torch.randn(outputs, inputs, device="cuda") * inputs**-0.5
    grad = torch.randn(tokens, outputs, device="cuda")
    results = []
    for f, dtype in ((torch.nn.functional.linear, torch.float32), (fn, torch.bfloat16)):
        leaves = [t.detach().to(dtype).requires_grad_(not (frozen and i == 1)) for i, t in enumerate((x, w))]
        out = f(*leaves)
        out.backward(grad.to(out.dtype))
        results.append((out, leaves[0].grad, leaves[1].grad))
    names = ("out", "dx") if frozen else ("out", "dx", "dw")
    errors = {n: relative_error(g, w) for n, g, w in zip(names, results[1], results[0])}
    assert not frozen or results[1][2] is None
    record(f"fp8-{tokens}x{inputs}x{outputs}{'-frozen' if frozen else ''}", {"errors": errors, "band": FP8_ERROR})
    assert all(FP8_ERROR[0] < e < FP8_ERROR[1] for e in errors.values()), errors


def _one_step_each(models, vocab_size: int) -> list[float]:
    """One training step of each model on the same random tokens: the losses (the gradients left on the models)."""
    ids = torch.randint(0, vocab_size, (2, 512), device="cuda")
    losses = []
    for model in models:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    return losses


def test_mini_model_trains_in_fp8_close_to_bf16():
    """A mini Qwen3.5 model: apply(precision="fp8") chooses the FP8 kernel for every projection (the report
    says so), and one training step's loss and the projections' gradients stay near the bf16 patched model's."""
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16)
    bf16, fp8 = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(bf16, verbose=False)
    report = fusepatch.apply(fp8, precision="fp8", verbose=False)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert chosen["fp8_linear"] == "scaled-mm", report.log_lines()
    losses = _one_step_each((bf16, fp8), base.config.vocab_size)
    grads = [{n: p.grad for n, p in model.named_parameters() if p.grad is not None} for model in (bf16, fp8)]
    errors = {n: relative_error(grads[1][n], g) for n, g in grads[0].items() if n.endswith("proj.weight")}
    record("fp8-mini-model", {"losses": losses, "worst": max(errors.values())})
    assert abs(losses[1] - losses[0]) / losses[0] < 0.02, losses
    assert max(errors.values()) < 0.25, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("mib", [None, "64"], ids=["one-chunk", "four-chunks"])  # 64 MiB at 32,768: 1024 tokens
def test_fp8_loss_on_the_gpu(mib, monkeypatch):
    """The LM head's GEMMs in FP8 (``fp8_linear_cross_entropy``: fusepatch's cross-entropy kernels in its chunk loop)
    against fp32: the loss within a tenth of FP8's band, both gradients in it (and not bf16's: the three GEMMs ran in
    FP8), with one chunk and with several, the Trainer's count and a loss gradient other than 1."""
    if mib is not None:
        monkeypatch.setenv("FUSEPATCH_CE_LOGITS_MIB", mib)
    fn = kernel("fp8_linear_cross_entropy", "scaled-mm", torch.bfloat16)
    from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_reference

    tokens, hidden, vocab = 4001, 1024, 32768
    h = torch.randn(tokens, hidden, device="cuda")
    w = torch.randn(vocab, hidden, device="cuda") * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[::9] = -100
    results = []
    for f, dtype in ((linear_cross_entropy_reference, torch.float32), (fn, torch.bfloat16)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (h, w)]
        out = f(*leaves, y, num_items_in_batch=4321)
        (out * 0.7).backward()
        results.append((out, leaves[0].grad, leaves[1].grad))
    errors = {n: relative_error(g, r) for n, g, r in zip(("loss", "dh", "dw"), results[1], results[0])}
    record(f"fp8-loss-{mib or 'default'}", {"errors": errors, "band": FP8_ERROR})
    assert errors["loss"] < FP8_ERROR[0] / 10, errors
    assert all(0.015 < errors[n] < FP8_ERROR[1] for n in ("dh", "dw")), errors


def test_mini_model_trains_its_head_in_fp8():
    """``apply(precision="fp8", lm_head_precision="fp8")`` on a mini Qwen3.5: the report chooses the FP8 loss's kernel, and a
    step's loss and the head's gradient stay near the same model's with a bf16 head, yet differ from it."""
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16)
    plain, head = copy.deepcopy(base), copy.deepcopy(base)
    fusepatch.apply(plain, precision="fp8", verbose=False)
    report = fusepatch.apply(head, precision="fp8", lm_head_precision="fp8", verbose=False)
    chosen = {c.op: c.chosen for layer in report.layers for c in layer.choices}
    assert chosen["fp8_linear_cross_entropy"] == "scaled-mm", report.log_lines()
    losses = _one_step_each((plain, head), base.config.vocab_size)
    grads = [model.lm_head.weight.grad for model in (plain, head)]
    error = relative_error(grads[1], grads[0])
    record("fp8-head-mini-model", {"losses": losses, "head_grad_error": error})
    assert abs(losses[1] - losses[0]) / losses[0] < 0.01, losses
    assert 1e-3 < error < 0.1, error


def test_mini_model_lora_over_an_fp8_base():
    """peft LoRA over a mini Qwen3.5 model with ``precision="fp8"`` (peft first, as a training script does): the
    fused LoRA path runs the FP8 bases; loss near the bf16 LoRA model's, and the bases quantized once over two
    steps."""
    peft = pytest.importorskip("peft")
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    losses = []
    ids = torch.randint(0, base.config.vocab_size, (2, 512), device="cuda")
    for precision in (None, "fp8"):
        torch.manual_seed(0)
        model = peft.get_peft_model(copy.deepcopy(base), config)
        fusepatch.apply(model, precision=precision, verbose=False)
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        losses.append(loss.item())
        caches = [
            m
            for m in model.modules()
            if "fp8_linear" in getattr(m.__dict__.get("_fusepatch"), "ops", {})
            and m._fusepatch.ops["fp8_linear"].kept(m.weight) is not None
        ]
        assert (precision is None) == (not caches)
    record("fp8-mini-lora", {"losses": losses})
    assert abs(losses[1] - losses[0]) / losses[0] < 0.02, losses


def test_a_nan_stays_nan_in_the_kernels():
    """A NaN in a row (rows kernel) or a column (columns kernel) makes that row's or column's scale NaN, as in
    the PyTorch twins: never a finite FP8 value in a NaN's place."""
    from fusepatch.kernels.fp8 import quantize_columns, quantize_rows

    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    x[7, 11] = float("nan")
    q, inverse = quantize_rows(x)
    assert torch.isnan(inverse[7]) and torch.isnan(q[7].float()).all() and torch.isfinite(inverse[8:]).all()
    q, inverse = quantize_columns(x, 16)
    assert torch.isnan(inverse[11]) and torch.isnan(q[11, :300].float()).all() and torch.isfinite(inverse[12:]).all()


def test_fsdp2_world_size_one_trains_fp8_as_the_unsharded_model(tmp_path):
    """FSDP2 over NCCL, world size 1, with ``precision="fp8"``: the FP8 kernel is chosen for the sharded model, and
    its loss and projection gradients match the unsharded FP8 model's (the gathered weights quantize to the same
    bits; only the kernels' own run-to-run order differs)."""
    import json
    import os

    from helpers import FP8_FSDP2_WORKER, torchrun

    script, out = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(FP8_FSDP2_WORKER)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = torchrun(
        str(script),
        str(out),
        tests,
        "cuda",
        processes=1,
        timeout=600,
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    record("fp8-fsdp2", {"loss": data["loss"], "ref_loss": data["ref_loss"], "worst": max(data["errors"].values())})
    assert data["chosen"] == "scaled-mm" and data["calls"] > 0 and data["errors"], data
    assert abs(data["loss"] - data["ref_loss"]) <= 1e-3 * abs(data["ref_loss"]), data
    assert max(data["errors"].values()) <= 2e-2, sorted(data["errors"].items(), key=lambda kv: -kv[1])[:5]


def test_compiled_fp8_model_trains_as_the_uncompiled_one(monkeypatch):
    """``model.compile()`` after ``apply(precision="fp8")``: on a GPU the patched forwards, the FP8 projections
    among them, run outside dynamo (a graph break each) and dynamo compiles what is left, so the compiled step
    still runs its FP8 GEMMs, and its loss and projection gradients match the uncompiled FP8 model's."""
    from helpers import counted_fp8_gemms

    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    calls = counted_fp8_gemms(monkeypatch)

    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16)
    plain, compiled = copy.deepcopy(base), copy.deepcopy(base)
    for model in (plain, compiled):
        fusepatch.apply(model, precision="fp8", verbose=False)
    compiled.compile()
    ids = torch.randint(0, base.config.vocab_size, (2, 256), device="cuda")
    losses, grads = [], []
    try:
        for model in (plain, compiled):
            calls.clear()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    finally:  # dynamo's caches are the process's: the next test starts without them
        torch._dynamo.reset()
    assert calls, "the compiled model ran no FP8 GEMM"
    errors = {n: relative_error(grads[1][n], g) for n, g in grads[0].items() if n.endswith("proj.weight")}
    record("fp8-compiled", {"losses": losses, "worst": max(errors.values())})
    assert abs(losses[1] - losses[0]) <= 1e-3 * abs(losses[0]), losses
    assert errors and max(errors.values()) <= 2e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_a_torchao_converted_model_keeps_its_float8_modules():
    """A model the user converted with torchao's float8 training before ``apply(precision="fp8")``: its
    ``Float8Linear`` projections keep their class and forward, fusepatch's fused layers call each once per
    forward (never reading the weight past it), and the step trains as the converted model unpatched."""
    float8 = pytest.importorskip("torchao.float8")
    import fusepatch
    from fusepatch.layers.fp8 import PROJECTIONS
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16)
    config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    plain, patched = copy.deepcopy(base), copy.deepcopy(base)
    for model in (plain, patched):
        float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: fqn.rpartition(".")[2] in PROJECTIONS
        )
    fusepatch.apply(patched, precision="fp8", verbose=False)
    converted = [m for m in patched.modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all("forward" not in m.__dict__ for m in converted)
    calls = []
    for module in converted:
        module.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, base.config.vocab_size, (2, 256), device="cuda")
    losses = []
    for model in (plain, patched):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert len(calls) == len(converted), (len(calls), len(converted))
    assert all(m.weight.grad is not None for m in converted)
    record("fp8-torchao-converted", {"losses": losses})
    assert abs(losses[1] - losses[0]) <= 2e-2 * abs(losses[0]), losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(17408, 5120), (5120, 6144), (48, 80)], ids=["27b-mlp", "27b-qkv", "small"])
def test_fingerprint_kernel_gives_the_twins_fingerprint(shape, dtype):
    """The check of a kept copy on the GPU: the fingerprint kernel's atomics and last-program compare give the
    PyTorch twin's fingerprint at the 27B widths (thousands of programs), flag exactly a changed weight (one value
    in the middle, two values swapped) and leave the state's sums and count zeroed for the next call."""
    from fusepatch.kernels.fingerprint import fingerprint
    from fusepatch.kernels.fingerprint_spec import DONE, HELD, STALE, STATE_WORDS, SUMS
    from fusepatch.ops.prepared import fingerprint_reference

    def held(state):
        return state[HELD : HELD + 2].to(torch.int64) & 0xFFFFFFFF

    x = torch.randn(shape, device="cuda").to(dtype)
    x[0, 0], x[-1, -1] = 1.5, -2.5
    state = torch.zeros(STATE_WORDS, dtype=torch.int32, device="cuda")
    for _ in range(2):  # the second call: the same weight, not stale
        fingerprint(x, state)
        assert torch.equal(held(state), fingerprint_reference(x)) and bool((state[SUMS : DONE + 1] == 0).all())
    assert state[STALE].item() == 0
    changed = x.clone()
    changed[shape[0] // 2, shape[1] // 3] += 1
    fingerprint(changed, state)
    assert state[STALE].item() == 1 and torch.equal(held(state), fingerprint_reference(changed))
    swapped = x.clone()
    swapped[0, 0], swapped[-1, -1] = x[-1, -1], x[0, 0]
    fingerprint(swapped, state)
    assert state[STALE].item() == 1


def _kept(weight):
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight
    from fusepatch.ops.prepared import fingerprint_weight

    return quantize_weight(weight), fingerprint_weight(weight)


def refresh_weight(weight, quantized, check) -> None:
    """What the dispatcher runs for a kept copy at each call: the check of the weight's contents, then the
    candidate's conditional write (``ops/prepared.py``)."""
    from fusepatch.ops.fp8_linear.scaled_mm import refresh
    from fusepatch.ops.prepared import stale

    refresh(weight, quantized, stale(weight, check))


def _same(quantized, other) -> bool:
    return torch.equal(quantized.q.view(torch.uint8), other.q.view(torch.uint8)) and torch.equal(
        quantized.inverse, other.inverse
    )


def test_a_kept_copy_is_checked_and_requantized_without_a_host_sync():
    """The check and the candidate's ``refresh`` at a 27B MLP weight's shape under ``torch.cuda.set_sync_debug_mode("error")`` (any sync
    raises): a fresh weight leaves the copy's buffers unwritten (poisoned buffers stay poisoned), a weight written
    through ``.data`` gets its fresh quantization in the same buffers, the same bits as ``quantize_weight``."""
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight

    weight = torch.nn.Parameter(torch.randn(17408, 5120, device="cuda").to(torch.bfloat16), requires_grad=False)
    warm = weight.detach().clone()
    refresh_weight(warm.mul_(2), *_kept(weight))  # the kernels built before the checked calls
    quantized, check = _kept(weight)
    buffers = quantized.q.data_ptr(), quantized.inverse.data_ptr()
    poison = quantized.inverse.clone().fill_(3.0)
    quantized.inverse.copy_(poison)  # a fresh check must write nothing
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        refresh_weight(weight, quantized, check)
        unwritten = quantized.inverse.clone()
        weight.data.mul_(-0.5)
        refresh_weight(weight, quantized, check)
        written = quantized.inverse.clone()
        refresh_weight(weight, quantized, check)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (quantized.q.data_ptr(), quantized.inverse.data_ptr()) == buffers
    assert torch.equal(unwritten, poison) and not torch.equal(written, poison)
    assert _same(quantized, quantize_weight(weight))


def test_a_captured_check_requantizes_at_each_replay():
    """The check and the conditional write captured in a CUDA graph (as ``cuda_graphs=True`` captures a layer):
    each replay quantizes the copy again exactly when the weight changed since the last one (through ``.data``
    or its storage), and writes nothing when it did not."""
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight

    weight = torch.randn(5120, 6144, device="cuda").to(torch.bfloat16)
    quantized, check = _kept(weight)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        refresh_weight(weight, quantized, check)  # the kernels' first launches outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        refresh_weight(weight, quantized, check)
    for write in (lambda: weight.mul_(2), lambda: weight.untyped_storage().fill_(0), lambda: weight.add_(1)):
        write()
        graph.replay()
        assert _same(quantized, quantize_weight(weight))
        quantized.inverse.fill_(3.0)  # unchanged since: the next replay writes nothing
        graph.replay()
        assert bool((quantized.inverse == 3.0).all())
        quantized.inverse.copy_(quantize_weight(weight).inverse)


def test_a_frozen_fp8_model_follows_writes_through_data_on_the_gpu():
    """A frozen mini model with ``precision="fp8"`` (a reference model): its weights written through ``.data`` as
    TRL's sync writes them, the next forward equals a copy quantized afresh, exactly; a kept copy's check in the
    forward issues no host sync."""
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16).requires_grad_(False)
    fusepatch.apply(model, precision="fp8", verbose=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda")
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        for p in model.parameters():
            p.data.mul_(0.5).add_(0.01)
        after = model(input_ids=ids, use_cache=False).logits
        fresh = copy.deepcopy(model)(input_ids=ids, use_cache=False).logits
    assert torch.equal(after, fresh) and not torch.equal(after, before)
    projection = next(m for m in model.modules() if "fp8_linear" in getattr(m.__dict__.get("_fusepatch"), "ops", {}))
    dispatch = projection._fusepatch.ops["fp8_linear"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            kept = dispatch.prepared(projection.weight, "cuda", "bfloat16")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kept is dispatch.kept(projection.weight) and kept is not None


MATRIX_AXES = ("lora", "fp8", "recompute", "graphs", "checkpointing")
MATRIX = [dict(zip(MATRIX_AXES, flags)) for flags in itertools.product((False, True), repeat=len(MATRIX_AXES))]


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: "-".join(a for a in MATRIX_AXES if c[a]) or "plain")
def test_the_fp8_matrix_on_the_gpu(case, monkeypatch):
    """tests/layers/test_fp8_matrix.py's combinations with the GPU's kernels and real CUDA graphs: a mini model in
    bf16, four steps of one shape (the graphs captured at the third, replayed at the fourth; refused under
    checkpointing), the last step's loss and gradients against the same model unpatched: within FP8's error with
    FP8 (loss 2%, gradients' median 0.5), within bf16's without."""
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    peft = pytest.importorskip("peft") if case["lora"] else None
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1" if case["recompute"] else "0")
    torch.manual_seed(0)
    base = tiny_model("qwen3_5_text", **MINI).cuda().to(torch.bfloat16).train()
    if peft is not None:
        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        base = peft.get_peft_model(base, config, autocast_adapter_dtype=False)
    ids = torch.randint(0, base.config.vocab_size, (2, 256), device="cuda")

    def step(model, steps, checkpointing=False):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    want = step(copy.deepcopy(base), 1)
    model = copy.deepcopy(base)
    fusepatch.apply(model, precision="fp8" if case["fp8"] else None, cuda_graphs=case["graphs"], verbose=False)
    loss, grads = step(model, 4, case["checkpointing"])
    bound = (0.02, 0.5) if case["fp8"] else (5e-3, 0.05)
    assert abs(loss - want[0]) / want[0] < bound[0], (loss, want[0])
    errors = sorted(relative_error(g, want[1][n]) for n, g in grads.items())
    assert grads.keys() == want[1].keys() and errors[len(errors) // 2] < bound[1], errors
