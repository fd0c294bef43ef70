"""The Gated DeltaNet's per-token inputs to the chunked delta rule, forward and backward, as one Triton kernel each.

Before fla's chunk kernels run, each layer turns its raw projections into what they read: q and k L2-normalised
per head (with the inverse norms the backward needs), ``beta = sigmoid(b)``, and the decay
``g = -exp(A_log) * softplus(a + dt_bias)`` summed within each 64-token chunk and scaled to log2 space. fla does
that in four launches (``l2norm_fwd`` twice, ``fused_beta_sigmoid``, ``gdn_gate_chunk_cumsum``): little GPU work
for many times its cost in host time, which the GPU waits for at the start of a synced step. Its backward is six
more (the add of the two decay
gradients, the reverse chunk-local cumsum, the gate backward and its two sums, the sigmoid backward). Here each
direction is one kernel over (chunk, key head) programs: a program owns the chunk's rows of its key head's q and k
and of the ``Hv / Hk`` value heads grouped with it (value head ``h * G + j`` belongs to key head ``h``, fla's
grouping); the backward's per-chunk sums of the ``A_log`` / ``dt_bias`` gradients land in one small tensor summed by
torch (one launch; no atomics, so the result does not depend on the run).

Math in fp32 as fla's (the same formulas; its softplus is hand-written PTX, here ``log(1 + exp(x))`` above the same
threshold): outputs within fp32 rounding of fla's, the normalised q/k in the input dtype, rstd, beta and g in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # fla's chunk size for the gated delta rule: the decay is summed within these
ELEMENTS = 4096  # rows x head_dim per L2-norm step of a program
WARPS = 4
MAX_GROUPS = 64  # value heads a key head (wider: fla's own four functions)
MAX_DIM = 1024  # key head size (wider: fla's)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _chunk(t, bh, cu_seqlens, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The first token (flattened over the batch) of this program's chunk and the end of its sequence."""
    if IS_VARLEN:
        seq = tl.load(chunk_indices + t * 2).to(tl.int64)
        t = tl.load(chunk_indices + t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    else:
        bos = bh * T
        eos = bos + T
    return bos + t * BT, eos


@triton.jit
def _l2norm_rows(x, y, rstd, first, eos, head, eps, HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BR: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    col = tl.arange(0, BK)
    for step in tl.static_range(BT // BR):
        tok = first + step * BR + tl.arange(0, BR)
        inside = tok < eos
        mask = inside[:, None] & (col < K)[None, :]
        at = (tok * HK + head)[:, None] * K + col[None, :]
        v = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
        r = 1 / tl.sqrt(tl.sum(v * v, 1) + eps)
        tl.store(y + at, (v * r[:, None]).to(y.dtype.element_ty), mask=mask)
        tl.store(rstd + tok * HK + head, r, mask=inside)


@triton.jit(do_not_specialize=["T"])
def _inputs_fwd(
    q, k, a, b, A_log, dt_bias, cu_seqlens, chunk_indices,
    q_out, q_rstd, k_out, k_rstd, beta, g,
    T, eps, scale,
    HK: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    BG: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    head = i_bh % HK
    first, eos = _chunk(i_t, i_bh // HK, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    _l2norm_rows(q, q_out, q_rstd, first, eos, head, eps, HK, K, BT, BR, BK)
    _l2norm_rows(k, k_out, k_rstd, first, eos, head, eps, HK, K, BT, BR, BK)

    tok = first + tl.arange(0, BT)
    j = tl.arange(0, BG)
    vhead = head * G + j
    mask = (tok < eos)[:, None] & (j < G)[None, :]
    at = tok[:, None] * (HK * G) + vhead[None, :]
    bv = tl.load(b + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta + at, tl.sigmoid(bv), mask=mask)
    x = tl.load(a + at, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias + vhead, mask=j < G, other=0.0).to(tl.float32)[None, :]
    decay = -tl.exp(tl.load(A_log + vhead, mask=j < G, other=0.0).to(tl.float32))
    gate = tl.where(mask, decay[None, :] * _softplus(x), 0.0)
    tl.store(g + at, tl.cumsum(gate, 0) * scale, mask=mask)


@triton.jit(do_not_specialize=["T"])
def _inputs_bwd(
    a, b, A_log, dt_bias, dg, dg2, dbeta, cu_seqlens, chunk_indices,
    da, db, partial,
    T,
    HK: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    head, seq = i_bh % HK, i_bh // HK
    first, eos = _chunk(i_t, seq, cu_seqlens, chunk_indices, T, BT, IS_VARLEN)
    tok = first + tl.arange(0, BT)
    j = tl.arange(0, BG)
    vhead = head * G + j
    mask = (tok < eos)[:, None] & (j < G)[None, :]
    at = tok[:, None] * (HK * G) + vhead[None, :]

    # the decay: the two gradients of the chunk-summed g, summed back over each chunk (reverse cumsum)
    d = tl.load(dg + at, mask=mask, other=0.0).to(tl.float32) + tl.load(dg2 + at, mask=mask, other=0.0).to(tl.float32)
    rc = tl.sum(d, 0)[None, :] - tl.cumsum(d, 0) + d
    x = tl.load(a + at, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias + vhead, mask=j < G, other=0.0).to(tl.float32)[None, :]
    decay = -tl.exp(tl.load(A_log + vhead, mask=j < G, other=0.0).to(tl.float32))
    dx = tl.where(mask, decay[None, :] * tl.sigmoid(x) * rc, 0.0)
    tl.store(da + at, dx.to(da.dtype.element_ty), mask=mask)
    d_a_log = tl.sum(tl.where(mask, rc * decay[None, :] * _softplus(x), 0.0), 0)
    row = partial + (seq * tl.num_programs(0) + tl.program_id(0)) * 2 * (HK * G)
    tl.store(row + vhead, d_a_log, mask=j < G)
    tl.store(row + HK * G + vhead, tl.sum(dx, 0), mask=j < G)

    # beta = sigmoid(b)
    s = tl.sigmoid(tl.load(b + at, mask=mask, other=0.0).to(tl.float32))
    dy = tl.load(dbeta + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(db + at, (dy * s * (1.0 - s)).to(db.dtype.element_ty), mask=mask)


def supported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why these kernels cannot take q ``[B, T, Hk, K]`` with v ``[B, T, Hv, V]``, or None when they can."""
    heads, values = q.shape[-2], v.shape[-2]
    if values % heads or values // heads > MAX_GROUPS:
        return f"{values} value heads over {heads} key heads (needs a whole group of at most {MAX_GROUPS})"
    if q.shape[-1] > MAX_DIM:
        return f"key head size {q.shape[-1]} > {MAX_DIM}"
    return None


def _grid(q: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None) -> tuple[int, int]:
    batch, length, heads = q.shape[0], q.shape[1], q.shape[2]
    if cu_seqlens is None:
        return triton.cdiv(length, CHUNK), batch * heads
    if chunk_indices is None or batch != 1:
        raise ValueError("delta_rule_inputs: packed rows need batch 1 and the chunk table (prepare_chunk_indices)")
    return chunk_indices.shape[0], heads


def delta_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    scale: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, ...]:
    """q and k L2-normalised with their inverse norms, ``sigmoid(b)``, and the chunk-summed decay times ``scale``:
    ``(q_n, q_rstd, k_n, k_rstd, beta, g)``, what fla's ``l2norm_fwd`` (twice), ``fused_beta_sigmoid`` and
    ``gdn_gate_chunk_cumsum`` give. q, k ``[B, T, Hk, K]``; a, b ``[B, T, Hv]``; packed rows as fla takes them
    (batch 1, ``cu_seqlens`` and its chunk table)."""
    q, k, a, b = (t.contiguous() for t in (q, k, a, b))
    batch, length, heads, dim = q.shape
    values = a.shape[-1]
    groups = values // heads
    fp32 = dict(device=q.device, dtype=torch.float32)
    q_n, k_n = torch.empty_like(q), torch.empty_like(k)
    q_rstd, k_rstd = torch.empty(batch, length, heads, **fp32), torch.empty(batch, length, heads, **fp32)
    beta, g = torch.empty(batch, length, values, **fp32), torch.empty(batch, length, values, **fp32)
    grid = _grid(q, cu_seqlens, chunk_indices)
    if q.numel() and grid[0]:
        block_k = triton.next_power_of_2(dim)
        _inputs_fwd[grid](
            q, k, a, b, A_log, dt_bias, cu_seqlens if cu_seqlens is not None else q,
            chunk_indices if chunk_indices is not None else q,
            q_n, q_rstd, k_n, k_rstd, beta, g, length, eps, scale,
            HK=heads, G=groups, K=dim, BT=CHUNK, BR=max(1, min(CHUNK, ELEMENTS // block_k)), BK=block_k,
            BG=max(2, triton.next_power_of_2(groups)), IS_VARLEN=cu_seqlens is not None, num_warps=WARPS,
        )  # fmt: skip
    return q_n, q_rstd, k_n, k_rstd, beta, g


def delta_rule_inputs_bwd(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    dg: torch.Tensor,
    dg2: torch.Tensor,
    dbeta: torch.Tensor,
    heads: int,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``a``, ``b``, ``A_log`` and ``dt_bias`` from those of g (two, summed: fla's ``dqkwg`` and
    WY-backward ones) and of beta, for ``heads`` key heads: what fla's ``add_``, reverse ``chunk_local_cumsum``,
    ``gdn_gate_bwd`` and ``fused_beta_sigmoid_bwd`` give, in ``a``'s, ``b``'s and the parameters' dtypes."""
    a, b, dg, dg2, dbeta = (t.contiguous() for t in (a, b, dg, dg2, dbeta))
    batch, length, values = a.shape
    groups = values // heads
    da, db = torch.empty_like(a), torch.empty_like(b)
    grid = _grid(a.view(batch, length, heads, groups), cu_seqlens, chunk_indices)
    partial = torch.empty(grid[0] * batch, 2, values, device=a.device, dtype=torch.float32)  # every row written
    if a.numel() and grid[0]:
        _inputs_bwd[grid](
            a, b, A_log, dt_bias, dg, dg2, dbeta, cu_seqlens if cu_seqlens is not None else a,
            chunk_indices if chunk_indices is not None else a, da, db, partial, length,
            HK=heads, G=groups, BT=CHUNK, BG=max(2, triton.next_power_of_2(groups)),
            IS_VARLEN=cu_seqlens is not None, num_warps=WARPS,
        )  # fmt: skip
    sums = partial.sum(0)
    return da, db, sums[0].to(A_log.dtype).view_as(A_log), sums[1].to(dt_bias.dtype).view_as(dt_bias)
