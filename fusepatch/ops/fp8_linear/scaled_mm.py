"""A linear projection whose three GEMMs (output, input gradient, weight gradient) run in FP8 on
``torch._scaled_mm`` with rowwise scales: every operand quantized to float8_e4m3fn along the GEMM's reduction
dimension, one scale per row (per token, per output or input feature), so one large value costs only its own
row's precision. The forward keeps the high-precision input (as a bf16 linear does) and quantizes it again,
transposed, for the weight gradient; the weight stays in its own dtype (the optimizer's master copy).

``_scaled_mm`` takes its first operand row-major and its second column-major, each with a reduction dimension
that is a multiple of 16, and with rowwise scales writes bf16 only: the token dimension of the weight gradient is
padded with zero rows to a multiple of 16, and outputs in another dtype are cast from bf16.
"""

from __future__ import annotations

import torch

from fusepatch.kernels.fp8_range import FP8_MAX, FP8_TINY

FP8 = torch.float8_e4m3fn
MULTIPLE = 16  # _scaled_mm's alignment of the reduction and output dimensions


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels/fp8.quantize_rows`` in PyTorch: the same power-of-two scales and the same bits."""
    peak = x.abs().amax(dim=1, keepdim=True).float().clamp_min(FP8_TINY)
    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX / peak)))
    q = (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reciprocal()


def _quantizer(device: torch.device):
    if device.type == "cuda":
        from fusepatch.kernels.fp8 import quantize_rows

        return quantize_rows
    return quantize_rows_reference


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """``x.t()`` contiguous, its columns (the tokens) padded with zeros to a multiple of 16."""
    rows, columns = x.shape
    padded = -(-rows // MULTIPLE) * MULTIPLE
    out = x.new_zeros((columns, padded)) if padded != rows else x.new_empty((columns, rows))
    out[:, :rows].copy_(x.t())
    return out


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.t()`` in FP8 for row-major ``a [M, K]`` and ``b [N, K]``, rowwise scales along K, in ``dtype``."""
    quantize = _quantizer(a.device)
    aq, a_scale = quantize(a)
    bq, b_scale = quantize(b)
    out = torch._scaled_mm(aq, bq.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=torch.bfloat16)
    return out if dtype == torch.bfloat16 else out.to(dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        flat = x.reshape(-1, x.shape[-1])
        out = _mm(flat, weight, x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = grad @ W: reduction over the outputs
            dx = _mm(flat_grad, weight.t(), x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:  # dW = grad.t() @ x: reduction over the tokens
            dw = _mm(_transposed(flat_grad), _transposed(x.reshape(-1, x.shape[-1])), weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = flat_grad.sum(0)
        return dx, dw, db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs in FP8; output and input gradient in
    ``x``'s dtype, weight and bias gradients in theirs. ``weight``'s two dimensions must be multiples of 16."""
    if weight.shape[0] % MULTIPLE or weight.shape[1] % MULTIPLE:
        raise ValueError(
            f"fp8_linear: weight {tuple(weight.shape)}: FP8 GEMMs need both dimensions multiples of {MULTIPLE}"
        )
    return _FP8Linear.apply(x, weight, bias)


def load():
    """The candidate's function (``torch._scaled_mm`` must exist: torch 2.5 or newer)."""
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._scaled_mm")
    return fp8_linear
