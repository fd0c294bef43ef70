"""What the self-test costs each op on the GPU: one plain call (the self-test before it had cases) against every
case the op declares, for the first candidate that loads here, after a first call that compiles.

    python benchmarks/studies/selftest_cost.py --commit <git commit> --out record.jsonl

One JSON line per op (and the 27B layer's head sizes for the delta rule): median milliseconds of 3 measures each,
the first call's seconds (compile and autotune included), and the cases' names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import command, gpu_name, today, versions  # noqa: E402
from shapes import selftest_dims  # noqa: E402

DIMS = selftest_dims("27b")


def _seconds(measure, op, fn, packed: bool, dims) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    measure(op, fn, "cuda", "bfloat16", packed=packed, dims=dims)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from fusepatch.base.env import capture
    from fusepatch.base.op import Case
    from fusepatch.base.requirements import Inputs
    from fusepatch.engine import selftest
    from fusepatch.engine.resolve import static_verdict
    from fusepatch.ops import OPS

    common = {
        "benchmark": "selftest_cost",
        "date": today(),
        "command": command(__file__),
        "commit": args.commit,
        "gpu": gpu_name(),
        "versions": versions(("torch", "triton", "transformers", "fla-core", "causal-conv1d", "tilelang")),
    }
    rows = []
    for op in OPS.values():
        if op.selftest is None:
            continue
        for candidate in op.candidates:
            verdict, _ = static_verdict(candidate, capture())
            if not (verdict.ok and candidate.inputs.check(Inputs("cuda", "bfloat16")).ok):
                continue
            try:
                fn = candidate.load()
            except Exception:  # noqa: BLE001 - the next candidate
                continue
            for dims in (None, DIMS.get(op.name)) if op.name in DIMS else (None,):
                plain = dataclasses.replace(op, selftest=dataclasses.replace(op.selftest, cases=(Case(),)))
                packed = op.name in ("gated_delta_rule", "causal_conv1d")
                first = _seconds(selftest.measure, op, fn, packed, dims)
                times = {
                    label: statistics.median(
                        1000 * _seconds(selftest.measure, spec, fn, packed, dims) for _ in range(3)
                    )
                    for label, spec in (("one_call", plain), ("all_cases", op))
                }
                row = {
                    **common,
                    "op": op.name,
                    "candidate": candidate.name,
                    "dims": dims,
                    "cases": [case.name or "plain" for case in op.selftest.cases],
                    "first_call_s": round(first, 2),
                    "one_call_ms": round(times["one_call"], 1),
                    "all_cases_ms": round(times["all_cases"], 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            break
    with open(args.out, "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
