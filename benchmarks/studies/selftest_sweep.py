"""How close unfaulted kernels come to their self-test bounds over many seeds: the data the floors are set from.

``apply`` draws each self-test's inputs from a seed fixed per (op, candidate, device, dtype, packing, sizes), so a
kernel whose clean error reaches its bound on some seeds is refused on some machines' keys and accepted on others.
This runs the self-test of every candidate that loads here (or those named) on many seeds, packed and not, and
writes one JSON line per run: the worst quantity's error over its bound, and every error and bound, so that a
floor change can be replayed against the same errors (``selftest.bounds``).

    python benchmarks/studies/selftest_sweep.py --op gated_delta_rule --seeds 16 --commit <git commit> --out rows.jsonl

On a GPU a compiled self-test takes under a second; without one, tests/stage_faults_interpreter.py ``--clean only``
runs fla's candidates in Triton's interpreter (about 20 s a run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import command, gpu_name, today, versions  # noqa: E402
from shapes import selftest_dims  # noqa: E402

DIMS = selftest_dims("27b")


def worst(errors: dict[str, float], limits: dict[str, float]) -> tuple[str | None, float]:
    """The quantity nearest its bound and that ratio; a non-finite error counts as infinitely far over (with a
    bound or without); (None, 0.0) where nothing is bounded."""
    ratios = {k: math.inf for k, e in errors.items() if not math.isfinite(e)}
    ratios.update({k: e / limits[k] for k, e in errors.items() if math.isfinite(e) and limits.get(k)})
    if not ratios:
        return None, 0.0
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="gated_delta_rule")
    parser.add_argument("--candidates", nargs="*", default=[], help="these candidates only (default: every one)")
    parser.add_argument("--seeds", type=int, default=16, help="seeds 0 .. N-1")
    parser.add_argument("--dims", action="store_true", help="also at the 27B layer's sizes (DIMS)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("selftest_sweep.py needs a CUDA GPU (without one: tests/stage_faults_interpreter.py --clean only)")
        return 2

    from fusepatch.base.env import capture
    from fusepatch.base.requirements import Inputs, reject
    from fusepatch.engine import selftest
    from fusepatch.engine.resolve import static_verdict
    from fusepatch.ops import OPS

    op = OPS[args.op]
    common = {
        "benchmark": "selftest_sweep",
        "date": today(),
        "command": command(__file__, argv),
        "code": args.commit,
        "gpu": gpu_name(),
        "versions": versions(("torch", "triton", "transformers", "fla-core", "causal-conv1d", "tilelang")),
        "op": op.name,
        "dtype": args.dtype,
    }
    env = capture()
    with open(args.out, "a") as out:
        for candidate in op.candidates:
            if args.candidates and candidate.name not in args.candidates:
                continue
            verdict, _ = static_verdict(candidate, env)
            if not (verdict.ok and candidate.inputs.check(Inputs("cuda", args.dtype)).ok):
                print(f"{candidate.name}: skipped ({verdict.reason or 'inputs'})", flush=True)
                continue
            try:
                fn = candidate.load()
            except Exception as exc:  # noqa: BLE001 - the next candidate; apply would refuse this one too
                print(f"{candidate.name}: failed to load ({type(exc).__name__}: {exc})", flush=True)
                continue
            shapes = [(packed, None) for packed in (False, True)]
            if args.dims and op.name in DIMS:
                shapes.append((False, DIMS[op.name]))
            for packed, dims in shapes:
                for seed in range(args.seeds):
                    start = time.perf_counter()
                    try:
                        found = selftest.measure(op, fn, "cuda", args.dtype, packed=packed, dims=dims, seed=seed)
                    except Exception as exc:  # noqa: BLE001 - a self-test that raises refuses (selftest.run)
                        first = (str(exc).strip().splitlines() or [""])[0]
                        found = reject(f"self-test raised {type(exc).__name__}: {first}")
                    if not isinstance(found, tuple):
                        row = {"refused": True, "reason": found.reason}
                    else:
                        errors, limits = found
                        name, ratio = worst(errors, limits)
                        verdict = selftest.judge(op, errors, limits, "cuda", args.dtype)
                        row = {"refused": not verdict.ok, "worst": name, "ratio": round(ratio, 4)}
                        row.update(errors=errors, bounds=limits)
                    row = {**common, "candidate": candidate.name, "packed": packed, "dims": dims, "seed": seed, **row}
                    row["seconds"] = round(time.perf_counter() - start, 2)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(
                        f"{candidate.name} packed={packed} dims={bool(dims)} seed {seed}: "
                        f"{'REFUSED' if row['refused'] else 'ok'} {row.get('worst')} {row.get('ratio')}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
