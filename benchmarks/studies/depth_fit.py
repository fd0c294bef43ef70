"""The deepest model of a shape that full fine-tuning fits on one GPU, per configuration: memory is a feature.

    python benchmarks/studies/depth_fit.py --shape 27b --configs hf-fast,fusepatch,fusepatch+fp8 \\
        --site-fla /tmp/site-fla --site-tl /tmp/site-tl --checkpointing --out record.jsonl

Each probe is one process of ``train_step.py`` (through ``run_all.run_one``: the same environments and label
words as the benchmark tables) that trains the shape at a depth for ``--steps`` steps with AdamW; a depth fits
when the process finishes without running out of memory. The depths are bisected between ``--low`` and
``--high`` (the shape's full depth by default), in whole multiples of ``--multiple`` (4 keeps Qwen3.5's three
linear-attention layers to one full-attention layer). One JSON line per configuration: the deepest depth that
fit, the shallowest that did not, every probe's depth, outcome, peak memory and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import code, command, gpu_name, today, versions  # noqa: E402
from shapes import SHAPES  # noqa: E402

OUT_OF_MEMORY = ("out of memory", "outofmemoryerror", "cuda error: out of memory")


def outcome(result: dict) -> str:
    """``fits``, ``oom`` or ``error`` for one probe's result (``run_all.run_one``'s dict)."""
    error = str(result.get("error", "")).lower()
    if not error:
        return "fits"
    return "oom" if any(sign in error for sign in OUT_OF_MEMORY) else "error"


def deepest(probe: Callable[[int], str], low: int, high: int, multiple: int) -> tuple[int | None, int | None, dict]:
    """Bisect depths ``low..high`` (multiples of ``multiple``) for the deepest that ``probe`` says ``fits``,
    assuming memory grows with depth. Returns (deepest that fits or None, shallowest that ran out or None, every
    probe's outcome by depth). A probe that fails for another reason stops the search: its depth tells nothing
    about memory."""
    depths = list(range(max(multiple, low - low % multiple), high + 1, multiple))
    seen: dict[int, str] = {}
    lo, hi = 0, len(depths) - 1
    fit, over = None, None
    while lo <= hi:
        mid = (lo + hi) // 2
        seen[depths[mid]] = result = probe(depths[mid])
        if result == "fits":
            fit = depths[mid]
            lo = mid + 1
        elif result == "oom":
            over = depths[mid]
            hi = mid - 1
        else:
            break
    return fit, over, seen


def main() -> int:
    import run_all

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--configs", default="hf-fast,fusepatch,fusepatch+fp8")
    parser.add_argument("--low", type=int, default=4)
    parser.add_argument("--high", type=int, default=None, help="default: the shape's full depth")
    parser.add_argument("--multiple", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--site-fla", default="")
    parser.add_argument("--site-tl", default="")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--workdir", default=".")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    high = args.high or SHAPES[args.shape]["layers"]
    common = {
        "date": today(),
        "command": command(__file__),
        "commit": args.commit or code(),
        "gpu": gpu_name(),
        "versions": versions(),
        "shape": args.shape,
        "checkpointing": args.checkpointing,
        "lora": args.lora,
    }
    for label in args.configs.split(","):
        probes: list[dict] = []
        # the probes' own versions: they import the kernel packages, this process does not
        probe_versions: list[dict] = []

        def probe(
            depth: int, label: str = label, probes: list[dict] = probes, seen: list[dict] = probe_versions
        ) -> str:
            step = argparse.Namespace(
                shape=args.shape,
                steps=args.steps,
                warmup=1,
                layers=depth,
                checkpointing=args.checkpointing,
                vary_seq=0.0,
                packed_docs=0,
                sft=False,
                doc_tokens=0,
                lora=args.lora,
                prompt=0.0,
                site_fla=args.site_fla,
                site_tl=args.site_tl,
                timeout=args.timeout,
                workdir=args.workdir,
            )
            result = run_all.run_one(f"{label}+quick", step)
            if result.get("versions"):
                seen.append(result["versions"])
            said = outcome(result)
            probes.append(
                {
                    "layers": depth,
                    "outcome": said,
                    "peak_gib": result.get("peak_mem_gib"),
                    "tokens_per_s": result.get("tokens_per_s"),
                    "error": str(result.get("error", ""))[-300:] if said == "error" else None,
                }
            )
            print(json.dumps({"config": label, **probes[-1]}), flush=True)
            return said

        fit, over, _ = deepest(probe, args.low, high, args.multiple)
        with open(args.out, "a") as fh:
            found = {"versions": probe_versions[0]} if probe_versions else {}
            row = {**common, **found, "config": label, "deepest_fit": fit, "first_oom": over, "probes": probes}
            fh.write(json.dumps(row))
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
