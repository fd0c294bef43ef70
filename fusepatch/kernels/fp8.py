"""FP8 (e4m3) quantization in Triton, along rows and along columns: each row's (column's) absolute maximum, its
power-of-two scale and the cast, reading the tensor twice and writing it once in FP8.

Along rows (``quantize_rows``): one program per row; an optional factor per column is applied first (a frozen
weight's rowwise scales moved into the gradient that multiplies it, so the backward reuses the forward's FP8 weight).
Along columns (``quantize_columns``): the operands whose GEMM reduces over their rows (the weight gradient's tokens,
the input gradient's weight) are written transposed, already in the layout ``torch._scaled_mm`` reads, with the
token dimension padded with zeros to its alignment: two kernels, the column maxima (atomic, over row blocks in
parallel) and the scaled, transposed write, instead of a transposed copy of the high-precision tensor and a
quantization of the copy. ``transpose``: an FP8 tensor transposed in tiles (a frozen weight's FP8 copy for the
input gradient).

``store_fp8_rows``: the same row quantization inside a kernel that holds whole rows of the tensor it produces (the
RMSNorm forward and backward), which writes the FP8 rows for the projection it feeds (``kernels/fp8_rows``).

A frozen weight's kept FP8 copy is checked at every call against the weight's contents without the host
(``kernels/fingerprint.py``: a fingerprint of every byte, compared on the device with the one held, setting a flag)
and quantized again into its own buffers only where the flag is set (``requantize_rows``): no sync, so a step stays
asynchronous and a CUDA graph that captured the check runs it at every replay.

Why a kernel: in eager PyTorch the same quantization is five kernels over the whole tensor (abs, amax, multiply,
clamp, cast) and costs about what the FP8 GEMM it feeds saves. Why power-of-two scales: the dequantization in
the GEMM's epilogue is then exact, and this kernel and :func:`fusepatch.ops.fp8_linear.scaled_mm.quantize_rows`
(the same math in PyTorch, used off the GPU) give the same bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusepatch.kernels.fp8_range import FP8_MAX, FP8_TINY, padded

BLOCK = 1024
WARPS = 4


@triton.jit
def clamped(scaled, FP8_MAX: tl.constexpr):
    """``scaled`` clamped to FP8's range, NaN kept (Triton's minimum and maximum drop a NaN operand)."""
    clamped = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
    return tl.where(scaled == scaled, clamped, scaled)


@triton.jit
def store_fp8_rows(values, mask, q, inverse, row_ok, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """``quantize_rows`` of a tile ``[rows, columns]`` a producing kernel holds whole rows of (fp32 ``values``, the
    output it stored, rounded to the output's dtype; ``mask``: its valid entries): the FP8 values to ``q`` (pointers
    of the tile's shape) and the inverse scales to ``inverse`` (one pointer a row): ``_quantize_rows``' math, so
    its bits (``kernels/fp8_rows``)."""
    peak = tl.max(tl.where(mask, tl.abs(values), 0.0), axis=1)
    nan = tl.max(tl.where(mask & (values != values), 1, 0), axis=1)
    peak = tl.maximum(peak, TINY)
    peak = tl.where(nan > 0, float("nan"), peak)  # a NaN row stays NaN, as in ``quantize_rows``
    scale = tl.exp2(tl.floor(tl.log2(FP8_MAX / peak)))
    tl.store(q, clamped(values * scale[:, None], FP8_MAX).to(q.dtype.element_ty), mask=mask)
    tl.store(inverse, 1.0 / scale, mask=row_ok)


@triton.jit
def row_scale(amax, nan, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """A row's scale from its running peaks and NaN flags (vectors a loop over the row filled): the largest power of
    two that keeps the row in range; NaN for a row holding a NaN, as in the PyTorch twin."""
    peak = tl.maximum(tl.max(amax, axis=0), TINY)
    peak = tl.where(tl.max(nan, axis=0) > 0, float("nan"), peak)
    return tl.exp2(tl.floor(tl.log2(FP8_MAX / peak)))


@triton.jit
def _quantize_rows(
    x,
    q,
    inverse,
    factor,
    columns,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    BLOCK: tl.constexpr,
    FACTOR: tl.constexpr,
    STALE_ONLY: tl.constexpr = False,
    stale=None,
):
    if STALE_ONLY:  # a kept copy's requantization: only where its check (``fingerprint``) found the weight changed
        wanted = tl.load(stale) != 0
    else:
        wanted = True
    if wanted:
        row = tl.program_id(0).to(tl.int64)
        start_x, start_q = x + row * stride_x, q + row * stride_q
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nan = tl.zeros((BLOCK,), dtype=tl.int32)
        for offset in range(0, columns, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            values = tl.load(start_x + cols, mask=cols < columns, other=0.0).to(tl.float32)
            if FACTOR:
                values = values * tl.load(factor + cols, mask=cols < columns, other=0.0)
            amax = tl.maximum(amax, tl.abs(values))
            nan = nan | (values != values).to(tl.int32)
        scale = row_scale(amax, nan, FP8_MAX, TINY)
        for offset in range(0, columns, BLOCK):
            cols = offset + tl.arange(0, BLOCK)
            mask = cols < columns
            values = tl.load(start_x + cols, mask=mask, other=0.0).to(tl.float32)
            if FACTOR:
                values = values * tl.load(factor + cols, mask=mask, other=0.0)
            tl.store(start_q + cols, clamped(values * scale, FP8_MAX).to(q.dtype.element_ty), mask=mask)
        tl.store(inverse + row, 1.0 / scale)


def quantize_rows(x: torch.Tensor, factor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inverse_scale)`` of a 2-D tensor whose rows are contiguous: ``q`` float8_e4m3fn of ``x``'s shape,
    ``inverse_scale`` fp32 ``[rows, 1]`` with ``x * factor ~= q * inverse_scale`` (``factor``: fp32, one value per
    column, or None)."""
    rows, columns = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if factor is not None:
        factor = factor.reshape(-1).float().contiguous()
    q = torch.empty((rows, columns), device=x.device, dtype=torch.float8_e4m3fn)
    inverse = torch.empty((rows, 1), device=x.device, dtype=torch.float32)
    _launch_rows(x, q, inverse, factor)
    return q, inverse


def _launch_rows(
    x: torch.Tensor,
    q: torch.Tensor,
    inverse: torch.Tensor,
    factor: torch.Tensor | None,
    stale: torch.Tensor | None = None,
) -> None:
    """``_quantize_rows`` over ``x``'s rows into ``(q, inverse)``; with ``stale``, only where it is set."""
    rows, columns = x.shape
    if rows:
        _quantize_rows[(rows,)](
            x,
            q,
            inverse,
            inverse if factor is None else factor,
            columns,
            x.stride(0),
            q.stride(0),
            FP8_MAX=FP8_MAX,
            TINY=FP8_TINY,
            BLOCK=BLOCK,
            FACTOR=factor is not None,
            STALE_ONLY=stale is not None,
            stale=stale,
            num_warps=WARPS,
        )


def requantize_rows(x: torch.Tensor, q: torch.Tensor, inverse: torch.Tensor, stale: torch.Tensor) -> None:
    """``quantize_rows(x)`` written into ``(q, inverse)`` (a kept copy's buffers) if ``stale`` (int32 ``[1]``: the
    flag of the check that last ran, ``kernels/fingerprint.py``) is set, nothing written otherwise; the flag is
    read on the device."""
    if x.stride(1) != 1:
        x = x.contiguous()
    _launch_rows(x, q, inverse, None, stale)


TILE_ROWS, TILE_COLUMNS = 64, 64


# an fp32's bits without its sign: as integers they order as the absolute values do, a NaN above infinity
SIGN = tl.constexpr(0x7FFFFFFF)
ONE = tl.constexpr(0x3F800000)  # the bits of 1.0


@triton.jit
def _column_peaks(x, peaks, rows, columns, stride_x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """``peaks[c] = max(peaks[c], max |x[r, c]|)`` over this program's block of rows, in the bits of the fp32
    absolute values (``peaks`` int32, starting at 0): as integers they order as the values do and a NaN is the
    largest, so one integer atomic keeps a NaN column's NaN (a float maximum drops it)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # the tokens on the grid's first axis: no 65535 bound
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    mask = (r[:, None] < rows) & (c[None, :] < columns)
    values = tl.load(x + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = values.to(tl.int32, bitcast=True) & SIGN
    tl.atomic_max(peaks + c, tl.max(bits, axis=0), mask=c < columns)


@triton.jit
def _quantize_columns(
    x,
    q,
    inverse,
    peaks,
    rows,
    rows_out,
    columns,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """``q[c, r] = x[r, c] * scale[c]`` in FP8 for ``r < rows_out``, zero where ``r >= rows`` (the padding)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # the tokens on the grid's first axis: no 65535 bound
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    peak = tl.load(peaks + c, mask=c < columns, other=ONE).to(tl.float32, bitcast=True)
    peak = tl.where(peak == peak, tl.maximum(peak, TINY), peak)  # a NaN column stays NaN, as in its twin
    scale = tl.exp2(tl.floor(tl.log2(FP8_MAX / peak)))
    mask = (r[:, None] < rows) & (c[None, :] < columns)
    values = tl.load(x + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    scaled = clamped(values * scale[None, :], FP8_MAX)
    out = (r[:, None] < rows_out) & (c[None, :] < columns)
    tl.store(q + c[None, :].to(tl.int64) * stride_q + r[:, None], scaled.to(q.dtype.element_ty), mask=out)
    if tl.program_id(0) == 0:
        tl.store(inverse + c, 1.0 / scale, mask=c < columns)


def quantize_columns(x: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(x.t())`` with the transposed rows padded with zeros to a multiple of ``multiple``, without
    the transposed copy: ``q`` float8_e4m3fn ``[columns, padded rows]`` (row-major), ``inverse_scale`` fp32
    ``[columns, 1]``."""
    rows, columns = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    rows_out = padded(rows, multiple)
    q = torch.empty((columns, rows_out), device=x.device, dtype=torch.float8_e4m3fn)
    inverse = torch.empty((columns, 1), device=x.device, dtype=torch.float32)
    if columns == 0 or rows_out == 0:  # no tokens: every column's peak is a zero column's
        inverse.fill_(1.0 / 2.0 ** math.floor(math.log2(FP8_MAX / FP8_TINY)))
        return q, inverse
    peaks = torch.zeros(columns, device=x.device, dtype=torch.int32)
    blocks = triton.cdiv(columns, TILE_COLUMNS)
    if rows:
        _column_peaks[(triton.cdiv(rows, TILE_ROWS), blocks)](
            x, peaks, rows, columns, x.stride(0), ROWS=TILE_ROWS, COLUMNS=TILE_COLUMNS, num_warps=WARPS
        )
    _quantize_columns[(triton.cdiv(rows_out, TILE_ROWS), blocks)](
        x,
        q,
        inverse,
        peaks,
        rows,
        rows_out,
        columns,
        x.stride(0),
        q.stride(0),
        FP8_MAX=FP8_MAX,
        TINY=FP8_TINY,
        ROWS=TILE_ROWS,
        COLUMNS=TILE_COLUMNS,
        num_warps=WARPS,
    )
    return q, inverse


@triton.jit
def _transpose(q, out, rows, columns, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    mask = (r[:, None] < rows) & (c[None, :] < columns)
    tile = tl.load(q + r[:, None].to(tl.int64) * columns + c[None, :], mask=mask)
    tl.store(out + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose(q: torch.Tensor) -> torch.Tensor:
    """``q.t().contiguous()`` of a contiguous 2-D FP8 tensor in tiles (a frozen weight for its input gradient):
    the strided elementwise copy moves single bytes; the tiles move rows of them."""
    rows, columns = q.shape
    out = torch.empty((columns, rows), device=q.device, dtype=q.dtype)
    if q.numel():
        source, target = q.contiguous().view(torch.uint8), out.view(torch.uint8)
        _transpose[(triton.cdiv(rows, TILE_ROWS), triton.cdiv(columns, TILE_COLUMNS))](
            source, target, rows, columns, ROWS=TILE_ROWS, COLUMNS=TILE_COLUMNS, num_warps=WARPS
        )
    return out
