"""Rowwise FP8 (e4m3) quantization in one Triton kernel: each row's absolute maximum, its power-of-two scale and
the cast, reading the row twice and writing it once in FP8.

Why a kernel: in eager PyTorch the same quantization is five kernels over the whole tensor (abs, amax, multiply,
clamp, cast) and costs about what the FP8 GEMM it feeds saves. Why power-of-two scales: the dequantization in
the GEMM's epilogue is then exact, and this kernel and :func:`fusepatch.ops.fp8_linear.scaled_mm.quantize_rows`
(the same math in PyTorch, used off the GPU) give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels.fp8_range import FP8_MAX, FP8_TINY

BLOCK = 1024
WARPS = 4


@triton.jit
def _quantize_rows(
    x, q, inverse, columns, stride_x, stride_q, FP8_MAX: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    start_x, start_q = x + row * stride_x, q + row * stride_q
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        values = tl.load(start_x + cols, mask=cols < columns, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(values))
    peak = tl.maximum(tl.max(amax, axis=0), TINY)
    scale = tl.exp2(tl.floor(tl.log2(FP8_MAX / peak)))  # the largest power of two that keeps the row in range
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < columns
        values = tl.load(start_x + cols, mask=mask, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(values * scale, -FP8_MAX), FP8_MAX)
        tl.store(start_q + cols, scaled.to(q.dtype.element_ty), mask=mask)
    tl.store(inverse + row, 1.0 / scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inverse_scale)`` of a 2-D tensor whose rows are contiguous: ``q`` float8_e4m3fn of ``x``'s shape,
    ``inverse_scale`` fp32 ``[rows, 1]`` with ``x ~= q * inverse_scale``."""
    rows, columns = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, columns), device=x.device, dtype=torch.float8_e4m3fn)
    inverse = torch.empty((rows, 1), device=x.device, dtype=torch.float32)
    if rows:
        _quantize_rows[(rows,)](
            x,
            q,
            inverse,
            columns,
            x.stride(0),
            q.stride(0),
            FP8_MAX=FP8_MAX,
            TINY=FP8_TINY,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    return q, inverse
