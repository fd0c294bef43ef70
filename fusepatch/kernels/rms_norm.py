"""RMSNorm forward and backward in the three Qwen forms: plain (``w * norm(x)``), zero-centered
(``norm(x) * (1 + w)``) and gated (``w * norm(x) * silu(z)``, the Gated DeltaNet output norm), the first two also
with the decoder layer's residual add fused in (``h = residual + x``, returned with ``norm(h)``); one fixed launch
configuration per feature size and nothing compiled per row count.

Why not fla's for every call: for feature sizes up to 512 (the per-head q/k norms of the Qwen3 and Qwen3.5
attention, whose rows are tokens x heads) fla's RMSNorm kernels take the row-count bucket
``NB = cdiv(rows, 2048)`` as a compile-time constant and as an autotune key. With packed batches of varying length
nearly every step has a new bucket (24 heads: one every ~85 tokens), and each one compiles and autotunes the
forward and backward kernels again: a packed SFT step then spends most of its time compiling and autotuning
norms. fla's gated norm does the same with buckets of 65,536 rows (tokens x value heads: one every ~1,365 tokens
at 48 heads), and its residual-add backward at the model width takes rows per program (``cdiv(rows, SMs)``) as a
constexpr, so ``layer_norm_bwd_kernel_row`` is built again for new row counts too. Here the row count is a
runtime argument Triton does not specialize on, the block sizes depend on the feature size only, and nothing is
autotuned: a layer's norm compiles once per dtype.

Arithmetic follows transformers: statistics in fp32; the plain and gated forms round the normalised row to the
input dtype before the weight multiplies it (``weight * h.to(dtype)``; plain: result in the promoted dtype; gated:
that product in its own dtype, then ``* silu(gate.float())`` and back to the input dtype), the zero-centered
form multiplies in fp32 and rounds once (``(h * (1 + w.float())).type_as(x)``). The backward is the exact
derivative in fp32; the weight gradient is summed per program (8 row blocks), then over programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels import fp8_rows
from fusepatch.kernels.fp8 import FP8_MAX, FP8_TINY, store_fp8_rows
from fusepatch.kernels.rows import as_rows


# ``FP8`` is a constexpr: the kernel with rows is compiled apart from the plain one, which keeps no branch for
# them. (As a runtime flag it slowed the plain backward kernel 3.3x on an H100.) The two compiles may order their
# arithmetic differently, so an output can differ from the plain kernel's by one rounding in a few values (12 of
# 3.1 million at the 27B width in bf16, 104 in fp16; where the normalised row rounds before the weight multiplies
# it, two units in the last place); the rows are always the quantization of the output this kernel wrote.
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_fwd(
    x,
    a,
    res,
    w,
    z,
    y,
    rstd,
    q,
    inverse,
    rows,
    x_stride,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    GATED: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    ADD: tl.constexpr,
    FP8: tl.constexpr = False,
    FP8_MAX: tl.constexpr = FP8_MAX,
    TINY: tl.constexpr = FP8_TINY,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    col_ok = c < D
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = r[:, None] * D + c[None, :]
    if ADD:  # x = res + a, rounded to x's dtype (what `residual + hidden_states` stores), written, then normed
        av = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32)
        rv = tl.load(res + offsets, mask=mask, other=0.0).to(tl.float32)
        xr = (rv + av).to(x.dtype.element_ty)
        tl.store(x + offsets, xr, mask=mask)
        xv = xr.to(tl.float32)
    else:  # rows x_stride apart (a view such as Qwen3.5's query half of q_proj's output), the rest contiguous
        xv = tl.load(x + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xv * xv, axis=1) / D + eps)
    tl.store(rstd + r, inv, mask=row_ok)
    h = xv * inv[:, None]
    wv = tl.load(w + c, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        out = h * (1.0 + wv)[None, :]
    else:
        out = h.to(x.dtype.element_ty).to(tl.float32) * wv[None, :]
    if GATED:  # (w * norm(x)) in its own dtype, then * silu(z) in fp32
        if ROUND_PRODUCT:
            out = out.to(x.dtype.element_ty).to(tl.float32)
        zv = tl.load(z + offsets, mask=mask, other=0.0).to(tl.float32)
        out = out * zv * tl.sigmoid(zv)
    tl.store(y + offsets, out.to(y.dtype.element_ty), mask=mask)
    if FP8:  # the FP8 rows of the rounded output, for the FP8 projections it feeds (``kernels/fp8_rows``)
        store_fp8_rows(out.to(y.dtype.element_ty).to(tl.float32), mask, q + offsets, inverse + r, row_ok, FP8_MAX, TINY)


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_bwd(
    x,
    w,
    z,
    dy,
    dres,
    rstd,
    dx,
    dz,
    dw_partial,
    q,
    inverse,
    rows,
    x_stride,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    STEPS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    GATED: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    HAS_DRES: tl.constexpr,
    FP8: tl.constexpr = False,
    FP8_MAX: tl.constexpr = FP8_MAX,
    TINY: tl.constexpr = FP8_TINY,
):
    pid = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    col_ok = c < D
    wv = tl.load(w + c, mask=col_ok, other=0.0).to(tl.float32)
    scale = 1.0 + wv if ZERO_CENTERED else wv
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    # STEPS row blocks a program, each program summing its share of the weight gradient (rows past the end
    # masked off)
    for step in tl.static_range(STEPS):
        r = (pid * STEPS + step) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = r < rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = r[:, None] * D + c[None, :]
        xv = tl.load(x + r[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy + offsets, mask=mask, other=0.0).to(tl.float32)
        inv = tl.load(rstd + r, mask=row_ok, other=0.0)
        h = xv * inv[:, None]
        if GATED:  # y = t * silu(z), t = w * norm(x): dz from t, and the gradient reaching t is g * silu(z)
            t = h.to(x.dtype.element_ty).to(tl.float32) * wv[None, :]
            if ROUND_PRODUCT:
                t = t.to(x.dtype.element_ty).to(tl.float32)
            zv = tl.load(z + offsets, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(zv)
            tl.store(dz + offsets, (g * t * sig * (1.0 + zv * (1.0 - sig))).to(dz.dtype.element_ty), mask=mask)
            g = g * zv * sig
        if ZERO_CENTERED:
            acc += g * h
        else:
            acc += g * h.to(x.dtype.element_ty).to(tl.float32)
        gh = g * scale[None, :]
        # d/dx of x * rstd(x): rstd * (gh - h * mean(gh * h)) per row
        dot = tl.sum(gh * h, axis=1) / D
        gx = (gh - h * dot[:, None]) * inv[:, None]
        if HAS_DRES:  # x was also returned (the next residual): its gradient adds to the norm's
            gx += tl.load(dres + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx + offsets, gx.to(dx.dtype.element_ty), mask=mask)
        if FP8:  # the FP8 rows of dx, for the FP8 projection whose output gradient it is (``kernels/fp8_rows``)
            rounded = gx.to(dx.dtype.element_ty).to(tl.float32)
            store_fp8_rows(rounded, mask, q + offsets, inverse + r, row_ok, FP8_MAX, TINY)
    tl.store(dw_partial + pid * D + c, tl.sum(acc, axis=0), mask=col_ok)


def _blocks(dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, warps) from the feature size alone: ~4k elements a tile for narrow rows (several
    rows a program), one row a program for wide ones."""
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, min(16, 4096 // block_d))
    warps = min(16, max(4, block_d * block_rows // 512))
    return block_d, block_rows, warps


# Row blocks per backward program: each program writes one row of partial weight gradients, so 8 blocks a
# program keep that buffer at 1/8 of the rows (or 1/128 for narrow rows) while leaving thousands of programs.
BWD_STEPS = 8


def _norm_forward(flat, weight, eps, flags, z, y, add=None, fp8=None):
    """Launch the forward kernel over ``flat`` ``[rows, D]`` (rows any stride apart, columns contiguous); with
    ``add = (a, res)`` it first writes ``res + a`` into ``flat`` (contiguous); with ``fp8 = (q, inverse)`` it also
    writes ``y``'s FP8 rows there. Returns the per-row ``rstd`` the backward needs."""
    rows, dim = flat.shape
    rstd = torch.empty(rows, dtype=torch.float32, device=flat.device)
    block_d, block_rows, warps = _blocks(dim)
    a, res = add if add is not None else (flat, flat)
    if rows:
        _rms_norm_fwd[(triton.cdiv(rows, block_rows),)](
            flat,
            a,
            res,
            weight,
            z,
            y,
            rstd,
            *(fp8 if fp8 is not None else (y, rstd)),
            rows,
            flat.stride(0),
            eps,
            D=dim,
            BLOCK_D=block_d,
            BLOCK_ROWS=block_rows,
            num_warps=warps,
            ADD=add is not None,
            FP8=fp8 is not None,
            **flags,
        )
    return rstd


def _norm_backward(flat, weight, rstd, z, grad, flags, dres=None, fp8=None):
    """dx (plus ``dres`` where given, the gradient of ``flat`` itself), dz (gated) and dw; all contiguous; with
    ``fp8 = (q, inverse)`` also dx's FP8 rows."""
    rows, dim = flat.shape
    dx = torch.empty((rows, dim), dtype=flat.dtype, device=flat.device)
    dz = torch.empty_like(z) if flags["GATED"] else dx  # not written without a gate
    block_d, block_rows, warps = _blocks(dim)
    programs = triton.cdiv(rows, block_rows * BWD_STEPS)
    partial = torch.empty((programs, dim), dtype=torch.float32, device=flat.device)
    if rows:
        _rms_norm_bwd[(programs,)](
            flat,
            weight,
            z,
            grad,
            grad if dres is None else dres,
            rstd,
            dx,
            dz,
            partial,
            *(fp8 if fp8 is not None else (dx, rstd)),
            rows,
            flat.stride(0),
            D=dim,
            BLOCK_D=block_d,
            BLOCK_ROWS=block_rows,
            STEPS=BWD_STEPS,
            num_warps=warps,
            HAS_DRES=dres is not None,
            FP8=fp8 is not None,
            **flags,
        )
    return dx, (dz if flags["GATED"] else None), partial.sum(0).to(weight.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor | None, what: str) -> int:
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the last dimension {dim} of x")
    if other is not None and other.shape != x.shape:
        raise ValueError(f"rms_norm: {what} {tuple(other.shape)} and x {tuple(x.shape)} differ")
    return dim


def _flags(zero_centered: bool, gated: bool, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> dict[str, bool]:
    product = torch.promote_types(x_dtype, weight_dtype)  # the dtype of transformers' `weight * h.to(dtype)`
    return {"ZERO_CENTERED": zero_centered, "GATED": gated, "ROUND_PRODUCT": gated and product != torch.float32}


def _out_dtype(zero_centered: bool, gated: bool, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    return x_dtype if zero_centered or gated else torch.promote_types(x_dtype, weight_dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool, gate=None, fp8=None) -> torch.Tensor:
        dim = _check(x, weight, gate, "gate")
        flat = as_rows(x, dim)
        weight = weight.contiguous()
        z = flat if gate is None else gate.reshape(-1, dim).contiguous()
        ctx.flags = _flags(zero_centered, gate is not None, x.dtype, weight.dtype)
        # allocated in x's shape, not viewed into it: a view made inside an autograd function could not be written
        # in place afterwards (a forward hook's ``out.mul_(...)``), where transformers' output can
        y = torch.empty(
            x.shape, dtype=_out_dtype(zero_centered, gate is not None, x.dtype, weight.dtype), device=x.device
        )
        rstd = _norm_forward(flat, weight, eps, ctx.flags, z, y.view(flat.shape), fp8=fp8)
        ctx.save_for_backward(flat, weight, rstd, z)
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, weight, rstd, z = ctx.saved_tensors
        grad = grad_out.reshape(flat.shape).contiguous()
        dx, dz, dw = _norm_backward(flat, weight, rstd, z, grad, ctx.flags)
        dgate = dz.view(ctx.shape) if dz is not None else None
        return dx.view(ctx.shape), dw, None, None, dgate, None


class _AddRMSNorm(torch.autograd.Function):
    """``h = residual + x`` and ``norm(h)`` in one kernel; returns both (``h`` is the next residual). The
    backward adds ``h``'s own gradient into the norm's input gradient in the same kernel."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps: float, zero_centered: bool, fp8=None):
        dim = _check(x, weight, residual, "residual")
        a = x.reshape(-1, dim).contiguous()
        res = residual.reshape(-1, dim).contiguous()
        weight = weight.contiguous()
        # both outputs in x's shape, not views (as in ``_RMSNorm``): either may be written in place afterwards
        h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        ctx.flags = _flags(zero_centered, False, h.dtype, weight.dtype)
        y = torch.empty(x.shape, dtype=_out_dtype(zero_centered, False, h.dtype, weight.dtype), device=x.device)
        flat_h = h.view(a.shape)
        rstd = _norm_forward(flat_h, weight, eps, ctx.flags, flat_h, y.view(a.shape), add=(a, res), fp8=fp8)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, residual.dtype)
        # dh is the gradient of x, the projection's output that x is (o_proj, out_proj): its FP8 rows where asked
        ctx.fp8_gradients = x.dtype == h.dtype and fp8_rows.fits(h.dtype, dim) and fp8_rows.emitting_gradients()
        return y, h

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_h: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        h = h.view(-1, h.shape[-1])
        grad = grad_out.reshape(h.shape).contiguous()
        dres = None if grad_h is None else grad_h.reshape(h.shape).contiguous()
        rows = fp8_rows.buffers(h) if ctx.fp8_gradients else None
        dh, _, dw = _norm_backward(h, weight, rstd, h, grad, ctx.flags, dres=dres, fp8=rows)
        if rows is not None:
            fp8_rows.record_gradient(dh, rows)  # what autograd hands the projection are views of dh
        dh = dh.view(ctx.shape)
        x_dtype, residual_dtype = ctx.dtypes
        return dh.to(x_dtype), dh.to(residual_dtype), dw, None, None, None


def _fp8_buffers(x: torch.Tensor, weight: torch.Tensor, zero_centered: bool, residual=None) -> fp8_rows.Rows | None:
    """Where a frame asks for them (``kernels/fp8_rows.emitting``) and an FP8 projection could read the output:
    buffers for its FP8 rows; None otherwise (no extra stores)."""
    if not fp8_rows.emitting():
        return None
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if not fp8_rows.fits(_out_dtype(zero_centered, False, dtype, weight.dtype), x.shape[-1]):
        return None
    return fp8_rows.buffers(x)


def _with_rows(y: torch.Tensor, rows: fp8_rows.Rows | None) -> torch.Tensor:
    if rows is not None:
        fp8_rows.record(y, rows)
    return y


@torch.compiler.disable  # a graph break under torch.compile, like fla's ops: dynamo never traces the launch
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Qwen3 RMSNorm ``weight * norm(x).to(x.dtype)`` over the last dimension, fused backward."""
    rows = _fp8_buffers(x, weight, False)
    return _with_rows(_RMSNorm.apply(x, weight, eps, False, None, rows), rows)


@torch.compiler.disable
def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/Qwen3-Next RMSNorm ``(norm(x) * (1 + weight)).type_as(x)`` over the last dimension, fused backward."""
    rows = _fp8_buffers(x, weight, True)
    return _with_rows(_RMSNorm.apply(x, weight, eps, True, None, rows), rows)


@torch.compiler.disable
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm ``(weight * norm(x).to(x.dtype)) * silu(gate)``, result in x's dtype, fused
    backward (the gate's gradient included)."""
    return _RMSNorm.apply(x, weight, eps, False, gate)


@torch.compiler.disable
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The decoder layer's ``h = residual + x; rms_norm(h)`` in one kernel: ``(norm(h), h)``."""
    rows = _fp8_buffers(x, weight, False, residual)
    y, h = _AddRMSNorm.apply(x, residual, weight, eps, False, rows)
    return _with_rows(y, rows), h


@torch.compiler.disable
def add_rms_norm_zero_centered(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The decoder layer's ``h = residual + x; rms_norm_zero_centered(h)`` in one kernel: ``(norm(h), h)``."""
    rows = _fp8_buffers(x, weight, True, residual)
    y, h = _AddRMSNorm.apply(x, residual, weight, eps, True, rows)
    return _with_rows(y, rows), h
