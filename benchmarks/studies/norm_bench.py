"""The RMSNorm candidates alone (forward + backward), at fixed and at varying row counts.

    python benchmarks/studies/norm_bench.py --json-out norm.json

Two cases per norm site of the Qwen3.5-27B shapes (decoder width 5120 and the per-head q/k norm, 24 heads of 256,
zero-centered form; the Gated DeltaNet output norm, 48 value heads of 128, gated form; bf16):
- fixed: the same 4,096 tokens every call; median of ``--steps`` calls after ``--warmup`` (the benchmark tables'
  case: every shape seen before).
- varying: ``--lengths`` packed-row lengths, each new to the process, one call each, timed with whatever the
  kernel compiles or autotunes for it (the SFT case: packed rows of a different length every step). Reported:
  the total and the slowest call.
Eager is transformers' arithmetic (the ops' references in ``fusepatch.ops.rms_norm``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from fusepatch.ops import OPS

# site: (op, heads, feature size)
SITES = {
    "decoder (5120)": ("rms_norm_zero_centered", 1, 5120),
    "q/k per head (24 x 256)": ("rms_norm_zero_centered", 24, 256),
    "gated, per value head (48 x 128)": ("gated_rms_norm", 48, 128),
}


def implementations(op: str) -> dict:
    found = {"eager": OPS[op].reference}
    for candidate in OPS[op].candidates:
        if candidate.name in ("triton", "fla"):
            try:
                found[candidate.name] = candidate.load()
            except ImportError as exc:
                print(f"{candidate.name} not importable: {exc}", file=sys.stderr)
    return found


def call(fn, op: str, tokens: int, heads: int, dim: int, weight: torch.Tensor) -> float:
    x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weight.detach().requires_grad_(True)
    grad = torch.randn_like(x)
    args = (x, torch.randn_like(x, requires_grad=True), w) if op == "gated_rms_norm" else (x, w)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, 1e-6).backward(grad)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lengths", default="3907,4011,4133,4260,4388,4502,4617,4745,4861,4990")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    # each row printed as it is measured: a run cut off at its time limit keeps what it measured (fla's kernels
    # autotune for every new row count in the varying case, which can take minutes)
    print(f"{torch.cuda.get_device_name(0)}; bf16, fwd+bwd; fixed: {args.tokens} tokens; varying: {lengths}")
    print("| site | implementation | fixed: median ms | varying: total ms | varying: slowest call ms |")
    print("| --- | --- | ---: | ---: | ---: |", flush=True)
    for site, (op, heads, dim) in SITES.items():
        weight = 0.1 * torch.randn(dim, device="cuda", dtype=torch.bfloat16) + (op == "gated_rms_norm")
        for name, fn in implementations(op).items():
            for _ in range(args.warmup):
                call(fn, op, args.tokens, heads, dim, weight)
            fixed = [call(fn, op, args.tokens, heads, dim, weight) for _ in range(args.steps)]
            varying = [call(fn, op, t, heads, dim, weight) for t in lengths]
            r = {
                "site": site,
                "impl": name,
                "fixed_median_ms": round(statistics.median(fixed) * 1000, 3),
                "varying_total_ms": round(sum(varying) * 1000, 1),
                "varying_max_ms": round(max(varying) * 1000, 1),
            }
            rows.append(r)
            print(
                f"| {r['site']} | {r['impl']} | {r['fixed_median_ms']} | {r['varying_total_ms']} | {r['varying_max_ms']} |",
                flush=True,
            )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
