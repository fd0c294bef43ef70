"""The producers' FP8 rows (``kernels/fp8_rows``) in Triton's CPU interpreter: the RMSNorm, add-RMSNorm and SwiGLU
kernels asked for them write the same output as without, and FP8 rows with the bits ``kernels/fp8.quantize_rows``
gives on that output (the interpreter casts to FP8 its own way: the same math under the same cast) and the inverse
scales of its PyTorch twin ``quantize_rows_reference`` (NaN rows included). tests/gpu/test_gpu_fp8_rows.py checks the
compiled kernels' bits against the twin. One process for all of them: the interpreter's start is the cost."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from helpers import run_in_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from fusepatch.kernels import fp8_rows
    from fusepatch.kernels.fp8 import quantize_rows
    from fusepatch.kernels.rms_norm import add_rms_norm, add_rms_norm_zero_centered, rms_norm, rms_norm_zero_centered
    from fusepatch.kernels.swiglu import swiglu
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_rows_reference
    torch.manual_seed(0)

    def same_bits(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def same_scales(a, b):  # NaN and infinity where the other has them, every other scale equal
        return torch.equal(a.nan_to_num(nan=-1.0, posinf=-2.0), b.nan_to_num(nan=-1.0, posinf=-2.0))

    def check(produce, *args):
        plain = produce(*args)
        plain = plain[0] if isinstance(plain, tuple) else plain
        with fp8_rows.frame() as frame:
            with frame.emitting():
                y = produce(*args)
            y = y[0] if isinstance(y, tuple) else y
            rows = fp8_rows.carried(y).rows
        assert torch.equal(y.nan_to_num(), plain.nan_to_num()), produce  # the output as without the rows
        flat = y.reshape(-1, y.shape[-1])
        q, inverse = quantize_rows(flat)
        assert same_bits(rows.q, q), produce
        assert same_scales(rows.inverse, quantize_rows_reference(flat)[1]) and same_scales(inverse, rows.inverse)

    # narrow rows (several a program), a row wider than a block; fp16 once
    for dtype, shape in ((torch.bfloat16, (2, 5, 48)), (torch.bfloat16, (3, 2064)), (torch.float16, (4, 32))):
        x = (torch.randn(shape) * 3).to(dtype)
        x.view(-1, shape[-1])[1, 7] = float("nan")  # a NaN row: its scale NaN, as in the twin
        weight = (torch.randn(shape[-1]) * 0.1).to(dtype)
        residual = (torch.randn(shape) * 4).to(dtype)
        for norm in (rms_norm, rms_norm_zero_centered):
            check(norm, x, weight, 1e-6)
        for norm in (add_rms_norm, add_rms_norm_zero_centered):
            check(norm, x, residual, weight, 1e-6)
        check(swiglu, x, residual)
    # the SwiGLU backward: both input gradients' rows, as quantize_rows gives them on the gradients it returns
    for shape in ((3, 2064), (2, 5, 48)):
        gate, up = (torch.randn(shape).to(torch.bfloat16).requires_grad_(True) for _ in range(2))
        dy = torch.randn(shape).to(torch.bfloat16)
        dy.view(-1, shape[-1])[1, 3] = float("nan")
        plain = torch.autograd.grad(swiglu(gate, up), (gate, up), dy)
        with fp8_rows.frame() as frame:
            with frame.emitting(True, gradients=True):
                out = swiglu(gate, up)
        grads = torch.autograd.grad(out, (gate, up), dy)
        for grad, want in zip(grads, plain):
            assert torch.equal(grad.nan_to_num(), want.nan_to_num())
            flat = grad.reshape(-1, shape[-1])  # a view, as autograd hands a gradient back through a view
            rows = fp8_rows.carried_gradient(flat)
            q, inverse = quantize_rows(flat)
            assert same_bits(rows.q, q) and same_scales(rows.inverse, quantize_rows_reference(flat)[1]), shape
            assert fp8_rows.carried_gradient(flat) is None  # taken by its one reader
    # the add-RMSNorm backward: the summand's gradient's rows (the mixer's output projection's output gradient)
    for shape in ((3, 2064), (2, 5, 48)):
        x, residual = (torch.randn(shape).to(torch.bfloat16).requires_grad_(True) for _ in range(2))
        weight = (torch.randn(shape[-1]) * 0.1).to(torch.bfloat16)
        dy, dh = (torch.randn(shape).to(torch.bfloat16) for _ in range(2))
        plain = torch.autograd.grad(add_rms_norm_zero_centered(x, residual, weight, 1e-6), (x, residual), (dy, dh))
        with fp8_rows.frame() as frame:
            with frame.emitting(False, gradients=True):
                outs = add_rms_norm_zero_centered(x, residual, weight, 1e-6)
        grad, _ = torch.autograd.grad(outs, (x, residual), (dy, dh))
        assert torch.equal(grad, plain[0])
        flat = grad.reshape(-1, shape[-1])
        rows = fp8_rows.carried_gradient(flat)
        q, inverse = quantize_rows(flat)
        assert same_bits(rows.q, q) and same_scales(rows.inverse, quantize_rows_reference(flat)[1]), shape
    x = torch.randn(4, 40).to(torch.bfloat16)  # a width FP8 GEMMs cannot take: no rows asked of the kernel
    with fp8_rows.frame() as frame:
        with frame.emitting():
            y = rms_norm(x, torch.ones(40, dtype=torch.bfloat16), 1e-6)
        assert fp8_rows.carried(y) is None
    print("ok")
    """
)


def test_producers_write_the_fp8_rows_quantize_rows_gives_in_the_interpreter():
    assert "ok" in run_in_interpreter(SCRIPT)


def test_a_norm_without_rows_launches_the_kernel_without_their_branch(monkeypatch):
    """The rows flag is a constexpr, so the plain norm runs a kernel compiled without the rows' branch: as a runtime
    flag it made the plain backward kernel 3.3x slower on an H100. With rows, the same launch but for the flag."""
    import torch

    from fusepatch.kernels import fp8_rows
    from fusepatch.kernels import rms_norm as module

    launches = []

    class Grab:  # stands for a Triton kernel: records each launch's argument count and keyword constexprs
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((len(args), kwargs))

    monkeypatch.setattr(module, "_rms_norm_fwd", Grab())
    monkeypatch.setattr(module, "_rms_norm_bwd", Grab())
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    flags = module._flags(True, False, x.dtype, weight.dtype)
    for rows in (None, fp8_rows.buffers(x)):
        rstd = module._norm_forward(x, weight, 1e-6, flags, x, torch.empty_like(x), fp8=rows)
        module._norm_backward(x, weight, rstd, x, torch.randn_like(x), flags, fp8=rows)
    (plain_fwd, plain_fwd_kw), (plain_bwd, plain_bwd_kw), (rows_fwd, rows_fwd_kw), (rows_bwd, rows_bwd_kw) = launches
    assert plain_fwd_kw.pop("FP8") is False and plain_bwd_kw.pop("FP8") is False, launches
    assert rows_fwd_kw.pop("FP8") is True and rows_bwd_kw.pop("FP8") is True, launches
    assert (plain_fwd, plain_fwd_kw, plain_bwd, plain_bwd_kw) == (rows_fwd, rows_fwd_kw, rows_bwd, rows_bwd_kw)
