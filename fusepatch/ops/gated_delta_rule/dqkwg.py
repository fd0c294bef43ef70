"""The delta rule's q/k/w/g gradients through fla's TileLang kernel, built with one 128-wide K block.

On Hopper with Triton 3.4-3.7.0 fla runs ``chunk_bwd_dqkwg`` as a TileLang kernel (its Triton kernel gives wrong
gradients there). fla builds it with K in 64-wide blocks and 4 warps: two programs per chunk and head, each reading
the chunk's ``v``, ``do`` and ``dv`` and computing ``do @ v^T`` again for its half of K. Built by the same builder
with K in one block (K <= 128) and 8 warps, one program reads those inputs and computes ``do @ v^T`` once, with dq,
dk and dw bit for bit fla's and dg to float rounding (fla adds its two K halves' partial sums);
benchmarks/studies/dqkwg_bench.py compares the two tilings.

Used only where fla itself would run TileLang (its ``common`` TileLang backend available, enabled and accepting
the call) and the tiling applies; fla's own call otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable

import torch

from fusepatch.backends import fla as fla_backend
from fusepatch.backends.fla import DQKWG_BUILDER, DQKWG_BUILDER_ARGS
from fusepatch.base.dtypes import dtype_name

BLOCK_K = 128
BLOCK_V = 64
WARPS = 8
_FALLBACK = "the delta rule's dq/dk/dw/dg kernel runs with fla's own tiling (two programs per chunk and head: slower)"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _builder() -> tuple[Callable, object] | None:
    """fla's kernel builder and its TileLang backend, or None (no fla, no TileLang, a builder that changed)."""
    if importlib.util.find_spec("tilelang") is None:  # fla cannot run its TileLang kernel either: nothing to widen
        return None
    try:
        from fla.ops.common.backends import CommonTileLangBackend

        chunk_bwd = importlib.import_module("fla.ops.common.backends.tilelang.chunk_bwd")
        build = getattr(chunk_bwd, DQKWG_BUILDER)
    except Exception as exc:  # noqa: BLE001 - a layout that moved is reported, then fla's own call
        fla_backend.NAMES.drift(
            f"fla's TileLang dqkwg builder cannot be loaded ({type(exc).__name__}: {exc})", _FALLBACK
        )
        return None
    names: set[str] = set()
    for candidate in (build, getattr(build, "func", None), getattr(build, "__wrapped__", None)):
        try:
            names = set(inspect.signature(candidate).parameters) if candidate is not None else set()
        except (TypeError, ValueError):
            continue
        if DQKWG_BUILDER_ARGS <= names:
            break
    if not DQKWG_BUILDER_ARGS <= names:
        lacking = sorted(DQKWG_BUILDER_ARGS - names)
        fla_backend.NAMES.drift(f"fla's {DQKWG_BUILDER} lacks the keywords {lacking}", _FALLBACK)
        return None
    return build, CommonTileLangBackend()


def load(fla_dqkwg: Callable) -> Callable:
    """``fla_dqkwg`` (fla's ``chunk_bwd_dqkwg``) with the wide tiling where it applies, the same keywords."""
    found = _builder()
    if found is None:
        return fla_dqkwg
    build, backend = found

    def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, dv=None, scale=None, **kwargs):
        cu_seqlens, chunk_indices = kwargs.get("cu_seqlens"), kwargs.get("chunk_indices")
        chunk = kwargs.get("chunk_size", 64)
        batch, tokens, heads, dim_k = k.shape
        value_heads, dim_v = v.shape[2], v.shape[-1]
        usable = (
            w is not None
            and dv is not None
            and g is not None
            and dim_k <= BLOCK_K
            and dim_v % BLOCK_V == 0
            and q.dtype in _DTYPES
            and not kwargs.get("state_v_first", False)
            and kwargs.get("g_gamma") is None
            and (cu_seqlens is None or chunk_indices is not None)
            and backend.is_available()
            and backend.is_enabled()
            and backend.verify("chunk_bwd_dqkwg", q, k, v, do, h, dh, w=w, g=g, dv=dv, scale=scale, **kwargs)[0]
        )
        if not usable:
            return fla_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, scale=scale, **kwargs)
        varlen = cu_seqlens is not None
        h_flat, dh_flat = (t.reshape(-1, t.shape[-2], t.shape[-1]) for t in (h, dh))
        kernel = build(
            B=batch, H=heads, HV=value_heads, K=dim_k, V=dim_v, BT=chunk, BK=BLOCK_K, BV=BLOCK_V, NK=1,
            hD1=h_flat.shape[-2], hD2=h_flat.shape[-1], dtype_str=dtype_name(q.dtype), USE_G=True, USE_DW=True,
            STATE_V_FIRST=False, IS_VARLEN=varlen, num_warps=WARPS,
        )  # fmt: skip
        # per value head; one K block: the gate gradient needs no sum over blocks
        dq = q.new_empty(batch, tokens, value_heads, dim_k)
        dk = k.new_empty(batch, tokens, value_heads, dim_k)
        dw = torch.empty_like(w)
        dg = torch.zeros(1, batch, tokens, value_heads, dtype=torch.float32, device=q.device)
        scale = dim_k**-0.5 if scale is None else scale
        places = (cu_seqlens.int(), chunk_indices.int()) if varlen else ()
        kernel(q, k, v, g, h_flat, do, dh_flat, dq, dk, dw, dv, dg, *places, scale)
        if heads != value_heads:  # fla's kernels give q/k gradients per value head: sum each group
            groups = value_heads // heads
            dq = dq.view(batch, tokens, heads, groups, dim_k).sum(3)
            dk = dk.view(batch, tokens, heads, groups, dim_k).sum(3)
        return dq, dk, dw, dg[0]

    return chunk_bwd_dqkwg
