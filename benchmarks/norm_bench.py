"""The RMSNorm candidates alone (forward + backward), at fixed and at varying row counts.

    python benchmarks/norm_bench.py --json-out norm.json

Two cases per norm site of the Qwen3.5-27B shapes (decoder width 5120; the per-head q/k norm, 24 heads of 256;
bf16, zero-centered form):
- fixed: the same 4,096 tokens every call; median of ``--steps`` calls after ``--warmup`` (the benchmark tables'
  case: every shape seen before).
- varying: ``--lengths`` packed-row lengths, each new to the process, one call each, timed with whatever the
  kernel compiles or autotunes for it (the SFT case: packed rows of a different length every step). Reported:
  the total and the slowest call.
Eager is transformers' arithmetic (``fusepatch.ops.norms.rms_norm_zero_centered_reference``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from fusepatch.ops.norms import RMS_NORM_ZERO_CENTERED, rms_norm_zero_centered_reference

SITES = {"decoder (5120)": (1, 5120), "q/k per head (24 x 256)": (24, 256)}


def implementations() -> dict:
    found = {"eager": rms_norm_zero_centered_reference}
    for candidate in RMS_NORM_ZERO_CENTERED.candidates:
        if candidate.name in ("triton", "fla"):
            try:
                found[candidate.name] = candidate.load()
            except ImportError as exc:
                print(f"{candidate.name} not importable: {exc}", file=sys.stderr)
    return found


def call(fn, tokens: int, heads: int, dim: int, weight: torch.Tensor) -> float:
    x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weight.detach().requires_grad_(True)
    grad = torch.randn_like(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x, w, 1e-6).backward(grad)
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
    for site, (heads, dim) in SITES.items():
        weight = 0.1 * torch.randn(dim, device="cuda", dtype=torch.bfloat16)
        for name, fn in implementations().items():
            for _ in range(args.warmup):
                call(fn, args.tokens, heads, dim, weight)
            fixed = [call(fn, args.tokens, heads, dim, weight) for _ in range(args.steps)]
            varying = [call(fn, t, heads, dim, weight) for t in lengths]
            rows.append(
                {
                    "site": site,
                    "impl": name,
                    "fixed_median_ms": round(statistics.median(fixed) * 1000, 3),
                    "varying_total_ms": round(sum(varying) * 1000, 1),
                    "varying_max_ms": round(max(varying) * 1000, 1),
                }
            )
    print(f"{torch.cuda.get_device_name(0)}; bf16, fwd+bwd; fixed: {args.tokens} tokens; varying: {lengths}")
    print("| site | implementation | fixed: median ms | varying: total ms | varying: slowest call ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['site']} | {r['impl']} | {r['fixed_median_ms']} | {r['varying_total_ms']} | {r['varying_max_ms']} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
