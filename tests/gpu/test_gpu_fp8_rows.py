"""FP8 rows written by their producers (``kernels/fp8_rows``) on the GPU: the compiled RMSNorm, add-RMSNorm and
SwiGLU kernels (forward; the SwiGLU's and the add-RMSNorm's backward gradients) give the bits ``quantize_rows_reference`` gives on
their output, at the 27B layer widths; a mini Qwen3.5 trained with ``apply(precision="fp8")`` computes the same
loss and gradients with the rows carried as with every input quantized by its projection (but for the norms' few
roundings, a small part of what FP8 itself changes), with fewer quantization launches; an activation written in
place after its rows were made is quantized again."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MINI

from fusepatch.ops.common import relative_error

pytestmark = pytest.mark.gpu


def _same_bits(rows, y: torch.Tensor) -> None:
    """``rows`` are ``quantize_rows_reference``'s bits of ``y``; where not, the message says which rows differ and
    how (their scales, a differing value and both codes)."""
    from fusepatch.kernels.fp8 import quantize_rows
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_rows_reference

    flat = y.reshape(-1, y.shape[-1])
    want_q, want_inverse = quantize_rows_reference(flat)
    assert rows.q.shape == want_q.shape and rows.inverse.shape == want_inverse.shape, (rows.q.shape, want_q.shape)
    scales = rows.inverse.nan_to_num(-1.0, -2.0) != want_inverse.nan_to_num(-1.0, -2.0)
    codes = rows.q.view(torch.uint8) != want_q.view(torch.uint8)
    if scales.any() or codes.any():
        bad = (scales.flatten() | codes.any(1)).nonzero().flatten()
        i = int(bad[0])
        message = (
            f"{len(bad)} of {flat.shape[0]} rows differ ({int(scales.sum())} scales, {int(codes.sum())} codes); "
            f"row {i}: peak {flat[i].float().abs().max().item()!r}, inverse {rows.inverse[i].item()!r} against "
            f"{want_inverse[i].item()!r}; "
        )
        if codes[i].any():
            j = int(codes[i].nonzero().flatten()[0])
            kernel_q = quantize_rows(flat.contiguous())[0].view(torch.uint8)  # the standalone kernel, beside it
            message += (
                f"column {j}: value {flat[i, j].item()!r}, code {int(rows.q.view(torch.uint8)[i, j])} against "
                f"{int(want_q.view(torch.uint8)[i, j])} (quantize_rows: {int(kernel_q[i, j])}; "
                f"{int((kernel_q != want_q.view(torch.uint8)).sum())} of its codes differ)"
            )
        else:
            message += "no code of that row differs"
        raise AssertionError(message)


def _differ(what: str, got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} against {tuple(want.shape)}"
    differ = got.nan_to_num() != want.nan_to_num()
    return (
        f"{what}: {int(differ.sum())} of {got.numel()} values differ from the plain kernel's (rows: "
        + str(differ.reshape(-1, got.shape[-1]).any(1).nonzero().flatten()[:8].tolist())
        + ")"
    )


def _one_rounding(what: str, got: torch.Tensor, want: torch.Tensor, most: float = 1e-4) -> None:
    """``got`` is ``want`` but for one rounding in at most ``most`` of its values (one, in a small tensor): what the
    norm's kernel compiled with FP8 rows and the one compiled without may differ by (``kernels/rms_norm.py``; on an
    H100, 7 to 104 of 3.1 million values). The plain form rounds twice, the normalised row to the input dtype and
    then its product with the weight: one rounding of the first apart moves the output by at most two units in its
    last place (fp16 on an H100: two in some of its 104)."""
    got, want = got.nan_to_num(), want.nan_to_num()
    differ = got != want
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()[differ]
    few = int(differ.sum()) <= max(1, most * got.numel())
    assert few and bool((steps <= 2).all()), _differ(what, got, want)


def _inputs(shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    flat = x.view(-1, shape[-1])
    flat[0] *= 1e4  # a large row
    flat[1] = 0  # a zero row: the smallest peak's scale
    flat[2, 5] = float("nan")  # a NaN row: its scale NaN
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 301, 5120), (7, 1024), (5, 64)], ids=["hidden", "narrow", "rows-a-program"])
def test_norm_kernels_write_the_reference_rows(shape, dtype):
    from fusepatch.kernels import fp8_rows
    from fusepatch.kernels.rms_norm import add_rms_norm, add_rms_norm_zero_centered, rms_norm, rms_norm_zero_centered

    x, residual = _inputs(shape, dtype), torch.randn(shape, device="cuda").to(dtype)
    weight = (torch.randn(shape[-1], device="cuda") * 0.1).to(dtype)
    cases = [(f, (x, weight, 1e-6)) for f in (rms_norm, rms_norm_zero_centered)]
    cases += [(f, (x, residual, weight, 1e-6)) for f in (add_rms_norm, add_rms_norm_zero_centered)]
    for norm, args in cases:
        plain = norm(*args)
        with fp8_rows.frame() as frame:
            with frame.emitting():
                out = norm(*args)
            y = out[0] if isinstance(out, tuple) else out
            _same_bits(fp8_rows.carried(y).rows, y)  # the rows of the output this kernel wrote, bit for bit
        plain = plain[0] if isinstance(plain, tuple) else plain
        _one_rounding(norm.__name__, y, plain)  # and that output the plain kernel's, but for a few roundings


@pytest.mark.parametrize("shape", [(2, 301, 17408), (9, 2064), (3, 64)], ids=["intermediate", "odd", "narrow"])
def test_swiglu_kernels_write_the_reference_rows_forward_and_backward(shape):
    from fusepatch.kernels import fp8_rows
    from fusepatch.kernels.swiglu import swiglu

    gate = _inputs(shape, torch.bfloat16).requires_grad_(True)
    up = torch.randn(shape, device="cuda").to(torch.bfloat16).requires_grad_(True)
    dy = _inputs(shape, torch.bfloat16)
    plain = swiglu(gate, up)
    plain_grads = torch.autograd.grad(plain, (gate, up), dy)
    with fp8_rows.frame() as frame:
        with frame.emitting(True, gradients=True):
            out = swiglu(gate, up)
        _same_bits(fp8_rows.carried(out).rows, out)
    assert torch.equal(out.nan_to_num(), plain.nan_to_num())
    grads = torch.autograd.grad(out, (gate, up), dy)
    for grad, want in zip(grads, plain_grads):
        assert torch.equal(grad.nan_to_num(), want.nan_to_num())
        flat = grad.view(-1, shape[-1])
        _same_bits(fp8_rows.carried_gradient(flat), flat)


@pytest.mark.parametrize("shape", [(2, 301, 5120), (7, 1024)], ids=["hidden", "narrow"])
def test_add_norm_backward_writes_the_reference_rows(shape):
    from fusepatch.kernels import fp8_rows
    from fusepatch.kernels.rms_norm import add_rms_norm_zero_centered

    x = torch.randn(shape, device="cuda").to(torch.bfloat16).requires_grad_(True)
    residual = torch.randn(shape, device="cuda").to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(shape[-1], device="cuda") * 0.1).to(torch.bfloat16)
    dy, dh = _inputs(shape, torch.bfloat16), torch.randn(shape, device="cuda").to(torch.bfloat16)
    plain = torch.autograd.grad(add_rms_norm_zero_centered(x, residual, weight, 1e-6), (x, residual), (dy, dh))
    with fp8_rows.frame() as frame:
        with frame.emitting(False, gradients=True):
            outs = add_rms_norm_zero_centered(x, residual, weight, 1e-6)
    grad, _ = torch.autograd.grad(outs, (x, residual), (dy, dh))
    _one_rounding("the input gradient", grad, plain[0])
    flat = grad.reshape(-1, shape[-1])
    _same_bits(fp8_rows.carried_gradient(flat), flat)


def _fp8_step(model, ids, monkeypatch, *, carried: bool, hook=None):
    """One step's loss and gradients, and the by-rows quantization launches it made (the weights' included)."""
    from fusepatch.kernels import fp8, fp8_rows

    launches = []
    quantize = fp8.quantize_rows
    with monkeypatch.context() as patch:
        patch.setattr(fp8, "quantize_rows", lambda *a, **k: launches.append(1) or quantize(*a, **k))
        if not carried:  # every projection quantizes its own input, as without ``fp8_rows``
            for name in ("emitting", "emitting_gradients", "sharing"):
                patch.setattr(fp8_rows, name, lambda: False)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(launches)


def _close(got, want, bf16, spread, grads=None) -> None:
    """``got`` (loss, gradients) is ``want``'s within their run-to-run ``spread`` plus a tenth of what FP8 itself
    changes (``bf16``: the same step without FP8): the norms' few roundings (``_one_rounding``) move the FP8 codes of
    a few values, far less than FP8 moves them all; rows wrong, stale or from another tensor move them as much."""
    (loss, grads), (want_loss, want_grads), (bf16_loss, bf16_grads) = got, want, bf16
    assert (loss - want_loss).abs() <= (bf16_loss - want_loss).abs() / 10 + 1e-6, (loss, want_loss, bf16_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        fp8_error = relative_error(bf16_grads[name], grad)
        assert relative_error(grads[name], grad) <= 2 * spread[name] + fp8_error / 10 + 1e-6, name


def test_a_model_computes_the_same_with_the_rows_carried(monkeypatch):
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text", seed=0, **MINI).to("cuda", torch.bfloat16).train()
    bf16_model = copy.deepcopy(model)
    fusepatch.apply(model, precision="fp8", verbose=False)
    fusepatch.apply(bf16_model, verbose=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda")
    loss, grads, each = _fp8_step(model, ids, monkeypatch, carried=False)
    _, again, _ = _fp8_step(model, ids, monkeypatch, carried=False)  # the path's own run-to-run spread
    spread = {name: relative_error(again[name], grad) for name, grad in grads.items()}
    bf16_loss, bf16_grads, _ = _fp8_step(bf16_model, ids, monkeypatch, carried=False)
    fused_loss, fused, fewer = _fp8_step(model, ids, monkeypatch, carried=True)
    _close((fused_loss, fused), (loss, grads), (bf16_loss, bf16_grads), spread)
    # per layer: the mixer's input, gate/up's input, down_proj's input, gate/up's and the mixer's output
    # projection's output gradients
    assert fewer <= each - 6 * model.config.num_hidden_layers, (fewer, each)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recomputed_loss, recomputed, _ = _fp8_step(model, ids, monkeypatch, carried=True)
    assert torch.equal(recomputed_loss, fused_loss)  # the same kernels as the carried step: the same bits
    for name, grad in fused.items():
        assert relative_error(recomputed[name], grad) <= 2 * spread[name] + 1e-6, name


def test_an_activation_written_after_its_rows_were_made_is_quantized_again(monkeypatch):
    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    base = tiny_model("qwen3", seed=0, **MINI, num_hidden_layers=1).to("cuda", torch.bfloat16).train()
    bf16_model = copy.deepcopy(base)
    fusepatch.apply(base, precision="fp8", verbose=False)
    fusepatch.apply(bf16_model, verbose=False)
    model = copy.deepcopy(base)
    for each in (base, model, bf16_model):
        each.model.layers[0].input_layernorm.register_forward_hook(lambda module, args, out: out.mul_(1.5))
    ids = torch.randint(0, base.config.vocab_size, (2, 128), device="cuda")
    loss, grads, _ = _fp8_step(base, ids, monkeypatch, carried=False)
    bf16 = _fp8_step(bf16_model, ids, monkeypatch, carried=False)[:2]
    fused_loss, fused, _ = _fp8_step(model, ids, monkeypatch, carried=True)
    _close((fused_loss, fused), (loss, grads), bf16, dict.fromkeys(grads, 0.0))
