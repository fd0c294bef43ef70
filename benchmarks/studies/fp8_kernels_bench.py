"""The FP8 kernels alone (``fusepatch/kernels/fp8.py``) at the 27B projection widths, median of 20 CUDA-event
timings each.

``layout``: the tiled FP8 transpose (a frozen weight's input gradient) against the strided copy it replaces, and
the column quantization (transposed, padded) against a transposed copy followed by the row quantization.

``kept``: a frozen weight's kept FP8 copy, checked at every call (``refresh_weight``: the fingerprint of
the weight's contents compared on the device, the copy quantized again in its own buffers only when it changed)
against the quantization that keeping the copy saves (``quantize_weight``), per projection shape of an 8-layer
27B LoRA step (every projection's base frozen) and summed over the step's projections: ``check_ms`` the weight as
it was, ``check_changed_ms`` a changed weight (check and quantization), ``quantize_ms``; ``host_us`` what a call
costs the host to queue (its two launches against the quantization's one). The sums are one forward's; the
kept copy serves the input gradient with no check.

    python benchmarks/studies/fp8_kernels_bench.py             # prints one JSON object: milliseconds per case
    python benchmarks/studies/fp8_kernels_bench.py --cases kept \
        --json-out benchmarks/records/DATE-fp8-kept-check-h200.jsonl
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import code, command, gpu_name, today, versions  # noqa: E402

CASES = ("layout", "kept")


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return round(times[len(times) // 2], 4)


def host_us(fn, calls: int = 200) -> float:
    """Microseconds of host time a call of ``fn`` takes to queue its work (no sync between the calls)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(spent / calls * 1e6, 2)


def layout() -> dict:
    from fusepatch.kernels.fp8 import quantize_columns, quantize_rows, transpose

    out = {}
    for shape in [(17408, 5120), (5120, 17408), (12288, 5120)]:
        q = quantize_rows(torch.randn(shape, device="cuda", dtype=torch.bfloat16))[0]
        out[f"transpose {shape}"] = {
            "strided_copy_ms": median_ms(lambda q=q: q.t().contiguous()),
            "tiled_ms": median_ms(lambda q=q: transpose(q)),
        }
    for shape in [(4096, 5120), (4096, 17408)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out[f"columns {shape}"] = {
            "quantize_columns_ms": median_ms(lambda x=x: quantize_columns(x, 16)),
            "copy_then_rows_ms": median_ms(lambda x=x: quantize_rows(x.t().contiguous())),
            "rows_ms": median_ms(lambda x=x: quantize_rows(x)),
        }
    return out


def kept_sites(shape: str = "27b", layers: int = 8) -> dict[tuple[int, int], int]:
    """The weight shapes of the projections ``precision="fp8"`` computes in a LoRA step of ``shape`` (all frozen
    bases: each keeps an FP8 copy), with how many projections have each: built on the meta device."""
    from static_memory import _projection, build

    model = build(shape, layers, lora=16)
    sites: collections.Counter = collections.Counter()
    for name, module in model.named_modules():
        if _projection(name, module) and not module.weight.requires_grad:
            sites[tuple(module.weight.shape)] += 1
    return dict(sites)


def refresh_weight(weight, quantized, check) -> None:
    """What the dispatcher runs for a kept copy at each call (``fusepatch/ops/prepared.py``): the check of the
    weight's contents, then the candidate's write where it changed."""
    from fusepatch.ops.fp8_linear.scaled_mm import refresh
    from fusepatch.ops.prepared import stale

    refresh(weight, quantized, stale(weight, check))


def _site(size: tuple[int, int], device: str) -> dict:
    """One weight shape's timings: the check of a weight as it was, of a changed one, and the quantization."""
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight
    from fusepatch.ops.prepared import fingerprint_weight

    weights = [torch.randn(size, device=device, dtype=torch.bfloat16) for _ in range(2)]
    quantized, check = quantize_weight(weights[0]), fingerprint_weight(weights[0])
    changing = itertools.cycle(weights)  # each call a weight other than the one checked before
    return {
        "check_ms": median_ms(lambda: refresh_weight(weights[0], quantized, check)),
        "check_changed_ms": median_ms(lambda: refresh_weight(next(changing), quantized, check)),
        "quantize_ms": median_ms(lambda: quantize_weight(weights[0])),
        "check_host_us": host_us(lambda: refresh_weight(weights[0], quantized, check)),
        "quantize_host_us": host_us(lambda: quantize_weight(weights[0])),
    }


def kept(shape: str = "27b", layers: int = 8, device: str = "cuda") -> dict:
    from fusepatch.ops.fp8_linear.scaled_mm import quantize_weight
    from fusepatch.ops.prepared import fingerprint_weight

    sites = kept_sites(shape, layers)
    out: dict = {"sites": {}, "step": {}}
    for size, count in sorted(sites.items()):
        out["sites"][str(size)] = {"projections": count, **_site(size, device)}
    for field in ("check_ms", "check_changed_ms", "quantize_ms"):
        total = sum(site[field] * site["projections"] for site in out["sites"].values())
        out["step"][field] = round(total, 4)
    out["step"]["projections"] = sum(site["projections"] for site in out["sites"].values())
    out["step"]["check_over_quantize"] = round(out["step"]["check_ms"] / out["step"]["quantize_ms"], 3)
    # the step's checks queued back to back, as a forward queues them (the host's launches included)
    projections = [
        (weight, quantize_weight(weight), fingerprint_weight(weight))
        for size, count in sites.items()
        for weight in [torch.randn(size, device=device, dtype=torch.bfloat16) for _ in range(count)]
    ]
    out["step"]["checks_back_to_back_ms"] = median_ms(lambda: [refresh_weight(*p) for p in projections])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json-out", default=None, help="append the record row (date, GPU, versions) to this file")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; expected some of {', '.join(CASES)}")

    results = {}
    if "layout" in cases:
        results.update(layout())
    if "kept" in cases:
        results["kept 27b, 8 layers, LoRA"] = kept()
    print(json.dumps(results))
    if args.json_out:
        row = {
            "benchmark": "fp8_kernels",
            "date": today(),
            "gpu": gpu_name(),
            "versions": versions(("torch", "triton"), absent=False),
            "command": command(__file__),
            "code": code(),
            "results": results,
            "record_note": "median of 20 CUDA-event timings per case, bf16 weights; host_us: mean of 200 calls",
        }
        with open(args.json_out, "a") as out:
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
