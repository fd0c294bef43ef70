"""fla's TileLang ``chunk_bwd_dqkwg`` (the delta rule's q/k/w/g gradients, the longest fla kernel of the 27B-shaped
step on the H200: 2.54 ms a step, 6 layers) at other tilings, alone at the 27B shape (4096 tokens, 48 value heads
with q/k expanded to them, K = V = 128): time, and the largest difference from fla's own tiling.

fla builds it with K split in 64-wide blocks (two programs per chunk and head), so each program reads the chunk's
``v``, ``do`` and ``dv`` and computes ``do @ v^T`` again for its half of K; one 128-wide block reads and computes
them once. Run on the GPU machine: ``bash benchmarks/gpu_run.sh dqkwg``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import gpu_name, median_ms  # noqa: E402


def inputs(tokens: int = 4096, heads: int = 48, dim: int = 128, chunk: int = 64, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    chunks = tokens // chunk
    # decays in log2 space, cumulated within each chunk (what gdn_gate_chunk_cumsum gives the kernel)
    step = -torch.rand(1, chunks, chunk, heads, generator=gen, device="cuda") * 0.05
    g = step.cumsum(2).reshape(1, tokens, heads).float()
    return dict(
        q=randn(1, tokens, heads, dim, scale=dim**-0.5),
        k=randn(1, tokens, heads, dim, scale=dim**-0.5),
        v=randn(1, tokens, heads, dim),
        w=randn(1, tokens, heads, dim, scale=0.1),
        g=g,
        h=randn(1, chunks, heads, dim, dim, scale=0.1),
        dv=randn(1, tokens, heads, dim),
        do=randn(1, tokens, heads, dim),
        dh=randn(1, chunks, heads, dim, dim, scale=0.1),
        scale=dim**-0.5,
    )


def tiled(x: dict, block_k: int, block_v: int, warps: int):
    """The kernel fla builds, at ``block_k`` x ``block_v`` tiles and ``warps`` warps; returns a runner."""
    import triton
    from fla.ops.common.backends.tilelang.chunk_bwd import _build_chunk_bwd_dqkwg_kernel

    _, tokens, heads, dim = x["q"].shape
    blocks_k = triton.cdiv(dim, block_k)
    kernel = _build_chunk_bwd_dqkwg_kernel(
        B=1, H=heads, HV=heads, K=dim, V=dim, BT=64, BK=block_k, BV=block_v, NK=blocks_k, hD1=dim, hD2=dim,
        dtype_str="bfloat16", USE_G=True, USE_DW=True, STATE_V_FIRST=False, IS_VARLEN=False, num_warps=warps,
    )  # fmt: skip
    h, dh = (x[n].reshape(-1, dim, dim) for n in ("h", "dh"))

    def run():
        dq, dk, dw = (torch.empty_like(x[n]) for n in ("q", "k", "w"))
        dg = torch.zeros(blocks_k, 1, tokens, heads, dtype=torch.float32, device="cuda")
        kernel(x["q"], x["k"], x["v"], x["g"], h, x["do"], dh, dq, dk, dw, x["dv"], dg, x["scale"])
        return dq, dk, dw, dg.sum(0)

    return run


def fla_default(x: dict):
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg

    def run():
        return chunk_bwd_dqkwg(
            q=x["q"], k=x["k"], v=x["v"], w=x["w"], g=x["g"], h=x["h"], dv=x["dv"], do=x["do"], dh=x["dh"],
            scale=x["scale"], chunk_size=64,
        )  # fmt: skip

    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    x = inputs()
    reference = fla_default(x)()
    rows = []
    variants = [("fla's own call", None)] + [
        (f"BK {bk} BV {bv}, {w} warps", (bk, bv, w)) for bk, bv, w in [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 64, 4), (128, 32, 8)]
    ]  # fmt: skip
    for name, tiles in variants:
        try:
            run = fla_default(x) if tiles is None else tiled(x, *tiles)
            out = run()
            diffs = [
                float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip(out, reference)
            ]
            rows.append(
                {
                    "variant": name,
                    "ms": round(median_ms(run, warmup=3, repeat=40), 4),
                    "max_rel_diff_dq_dk_dw_dg": diffs,
                }
            )
        except Exception as exc:  # noqa: BLE001 - a tiling TileLang cannot build is a result
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    print("| variant | ms | max rel. diff (dq, dk, dw, dg) against fla's call |\n| --- | ---: | --- |")
    for r in rows:
        diffs = ", ".join(f"{d:.1e}" for d in r.get("max_rel_diff_dq_dk_dw_dg", []))
        print(f"| {r['variant']} | {r.get('ms', '-')} | {diffs or r.get('error', '')} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"gpu": gpu_name(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
