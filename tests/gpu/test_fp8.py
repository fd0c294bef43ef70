"""FP8 projections on the H200: the Triton quantization kernel against its PyTorch twin (the same bits), the FP8
GEMMs' error against fp32 at the 27B layer widths, and a mini Qwen3.5 model trained with
``apply(model, precision="fp8")`` against the same model patched in bf16."""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize(
    "tokens, inputs, outputs", [(4096, 5120, 7168), (4096, 17408, 5120), (1000, 2048, 6144)], ids=["qkv", "down", "2b"]
)
def test_fp8_gemms_on_the_gpu(tokens, inputs, outputs):
    """Output and both gradients in FP8's band against fp32 at the 27B and 2B-like widths (1000 tokens: the
    weight gradient's token dimension padded)."""
    fn = kernel("fp8_linear", "scaled-mm", torch.bfloat16)
    x = torch.randn(tokens, inputs, device="cuda")
    w = torch.randn(outputs, inputs, device="cuda") * inputs**-0.5
    grad = torch.randn(tokens, outputs, device="cuda")
    results = []
    for f, dtype in ((torch.nn.functional.linear, torch.float32), (fn, torch.bfloat16)):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w)]
        out = f(*leaves)
        out.backward(grad.to(out.dtype))
        results.append((out, leaves[0].grad, leaves[1].grad))
    errors = {n: relative_error(g, w) for n, g, w in zip(("out", "dx", "dw"), results[1], results[0])}
    record(f"fp8-{tokens}x{inputs}x{outputs}", {"errors": errors, "band": FP8_ERROR})
    assert all(FP8_ERROR[0] < e < FP8_ERROR[1] for e in errors.values()), errors


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
    ids = torch.randint(0, base.config.vocab_size, (2, 512), device="cuda")
    losses, grads = [], []
    for model in (bf16, fp8):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    errors = {n: relative_error(grads[1][n], g) for n, g in grads[0].items() if n.endswith("proj.weight")}
    record("fp8-mini-model", {"losses": losses, "worst": max(errors.values())})
    assert abs(losses[1] - losses[0]) / losses[0] < 0.02, losses
    assert max(errors.values()) < 0.25, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
