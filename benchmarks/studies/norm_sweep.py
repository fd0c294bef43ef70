"""fusepatch's RMSNorm kernels at other launch configurations: GPU time of the forward and of the backward
(kernel plus the weight gradient's final sum), measured with CUDA events, at the 27B shape's norm sites.

    python benchmarks/studies/norm_sweep.py --json-out sweep.json

The library picks one configuration per feature size (``fusepatch.kernels.rms_norm._blocks`` and ``BWD_STEPS``)
so that nothing compiles per row count; this sweeps (rows a tile, warps, row blocks a backward program) around it,
so a new default is chosen from measurements. Every configuration is checked against the fp64 reference (relative
error of y, dx and dw), and the default is marked.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time

import torch

from fusepatch.kernels import rms_norm as rn
from fusepatch.ops import OPS
from fusepatch.ops.common import relative_error

# site: (op, rows a token, feature size)
SITES = {
    "decoder norm (5120)": ("rms_norm_zero_centered", 1, 5120),
    "decoder add+norm (5120)": ("add_rms_norm_zero_centered", 1, 5120),
    "q/k per head (24 x 256)": ("rms_norm_zero_centered", 24, 256),
    "gated, per value head (48 x 128)": ("gated_rms_norm", 48, 128),
}


def _reference(op: str, x, other, w, dy, dres):
    """The op's own reference in fp64: (y, dx, dw), dx with the residual's gradient where the op returns it."""
    x64, w64, other64 = x.double().requires_grad_(True), w.double().requires_grad_(True), other.double()
    if op.startswith("add_"):
        y, h = OPS[op].reference(x64, other64, w64, 1e-6)
        dx, dw = torch.autograd.grad((y, h), (x64, w64), (dy.double(), dres.double()))
        return y.detach(), dx, dw
    args = (x64, other64, w64) if op == "gated_rms_norm" else (x64, w64)
    y = OPS[op].reference(*args, 1e-6)
    dx, dw = torch.autograd.grad(y, (x64, w64), dy.double())
    return y.detach(), dx, dw


def _grid(dim: int):
    block_d = 1 << (dim - 1).bit_length()
    # around the defaults (wide: one row a tile, 16 warps; narrow: 16 or 32 rows, 4-8 warps; 8 row blocks),
    # small enough that the compiles (one backward kernel a configuration) take about a minute
    if block_d >= 2048:
        tiles, warps, blocks = (1, 2), (8, 16), (4, 8, 16)
    else:
        tiles, warps, blocks = (8, 16, 32), (4, 8), (8, 16)
    for rows, w, steps in itertools.product(tiles, warps, blocks):
        if block_d * rows <= 16384:
            yield block_d, rows, w, steps


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # Triton's CPU interpreter (the test): wall time, for the table's shape only
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e6 / reps
    # A launch costs the CPU about what one of these kernels costs the GPU (tens of us), so timing calls as they
    # are issued measures the launches (the 2026-11-30 H200 run's first sweep: the same forward configuration timed 28.8 and
    # 39.9 us). The GPU first spins while the CPU queues every call, then runs them back to back.
    torch.cuda.synchronize()
    cpu = time.perf_counter()
    fn()
    cpu = time.perf_counter() - cpu
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9 * (3 * reps * cpu + 2e-3)))  # cycles at ~2 GHz: three times the queueing time
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps  # us


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--at-most", type=int, default=None, help="configurations a site: the default, then the grid's")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default_blocks, default_steps = rn._blocks, rn.BWD_STEPS
    rows_out = []
    try:
        for site, (op, heads, dim) in SITES.items():
            zero_centered, gated, add = "zero_centered" in op, op.startswith("gated"), op.startswith("add_")
            rows = args.tokens * heads
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(rows, dim, device=device, generator=g).bfloat16()
            other = torch.randn(rows, dim, device=device, generator=g).bfloat16()
            w = (0.1 * torch.randn(dim, device=device, generator=g) + (0.0 if zero_centered else 1.0)).bfloat16()
            dy = torch.randn(rows, dim, device=device, generator=g).bfloat16()
            dres = torch.randn(rows, dim, device=device, generator=g).bfloat16() if add else None
            flags = rn._flags(zero_centered, gated, x.dtype, w.dtype)
            z = other if gated else x
            want = default_blocks(dim), default_steps
            ref, ref_dx, ref_dw = _reference(op, x, other, w, dy, dres)
            grid = sorted(_grid(dim), key=lambda c: ((c[0], c[1], c[2]), c[3]) != want)  # the default first
            for block_d, tile, warps, steps in grid[: args.at_most]:
                rn._blocks = lambda d, c=(block_d, tile, warps): c  # noqa: E731
                rn.BWD_STEPS = steps
                y = torch.empty_like(x)
                h = torch.empty_like(x) if add else x
                forward = functools.partial(
                    rn._norm_forward, h, w, 1e-6, flags, h if add else z, y, add=(x, other) if add else None
                )
                rstd = forward()
                backward = functools.partial(rn._norm_backward, h, w, rstd, z, dy, flags, dres=dres)
                dx, _, dw = backward()
                rows_out.append(
                    {
                        "site": site,
                        "block_d": block_d,
                        "rows_a_tile": tile,
                        "warps": warps,
                        "bwd_steps": steps,
                        "default": ((block_d, tile, warps), steps) == want,
                        "fwd_us": round(_time(forward, args.reps), 1),
                        "bwd_us": round(_time(backward, args.reps), 1),
                        "err_y": relative_error(y, ref),
                        "err_dx": relative_error(dx, ref_dx),
                        "err_dw": relative_error(dw, ref_dw),
                    }
                )
    finally:
        rn._blocks, rn.BWD_STEPS = default_blocks, default_steps
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (Triton interpreter: times are not GPU times)"
    print(f"{gpu}; bf16, {args.tokens} tokens, CUDA-event time per call (us)")
    print("| site | rows a tile | warps | backward row blocks | fwd us | bwd us (+ dw sum) | err y / dx / dw |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for site in SITES:
        ranked = sorted((r for r in rows_out if r["site"] == site), key=lambda r: r["bwd_us"])
        shown = ranked[:5] + [r for r in ranked[5:] if r["default"]]
        for r in shown:
            mark = " (default)" if r["default"] else ""
            print(
                f"| {site}{mark} | {r['rows_a_tile']} | {r['warps']} | {r['bwd_steps']} | {r['fwd_us']} | "
                f"{r['bwd_us']} | {r['err_y']:.1e} / {r['err_dx']:.1e} / {r['err_dw']:.1e} |"
            )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows_out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
