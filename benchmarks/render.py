"""The current results tables, rendered from the run records in ``benchmarks/records/`` (one JSON line per row).

python benchmarks/render.py            # markdown: speed, then fidelity, newest record per shape
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(directory: str = os.path.join(HERE, "records")) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as f:
            rows += [dict(json.loads(line), record=os.path.basename(path)) for line in f if line.strip()]
    return rows


def speed(rows: list[dict]) -> list[str]:
    runs = [r for r in rows if r["benchmark"] == "train_step"]
    lines = [
        "| shape | config | tokens/s (synced) | vs hf-fast | back to back | Trainer loop | peak GiB | date, GPU | record |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for shape in sorted({r["shape"] for r in runs}):
        latest = max(r["date"] for r in runs if r["shape"] == shape)
        mine = [r for r in runs if r["shape"] == shape and r["date"] == latest]
        base = statistics.median(r["tokens_per_s_synced"] for r in mine if r["config"] == "hf-fast")
        for config in sorted({r["config"] for r in mine}, key=lambda c: c != "fusepatch"):
            same = [r for r in mine if r["config"] == config]
            tok = statistics.median(r["tokens_per_s_synced"] for r in same)
            b2b = statistics.median(r["tokens_per_s_back_to_back"] for r in same)
            loop = statistics.median(r["tokens_per_s_trainer_loop"] for r in same)
            first = same[0]
            shape_text = f"{shape} ({first['layers']} layers, seq {first['seq']}, batch {first['batch']})"
            lines.append(
                f"| {shape_text} | {config} | {tok:,.0f} | {tok / base:.2f}x | {b2b:,.0f} | {loop:,.0f} | "
                f"{first['peak_gib']:.1f} | {latest}, {first['gpu']} | {first['record']} |"
            )
    return lines


def fidelity(rows: list[dict]) -> list[str]:
    runs = [r for r in rows if r["benchmark"] == "fidelity"]
    lines = [
        "| shape | config | loss rel. error | median gradient rel. error | max (parameter) | > 1.25x hf-fast | date |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        theirs = run["results"].get("hf-fast", {}).get("errors", {})
        for config, result in run["results"].items():
            errors = result["errors"]
            worst = max(errors, key=errors.get)
            beyond = (
                sum(1 for n, e in errors.items() if theirs and e > 1.25 * theirs[n]) if config != "hf-fast" else "-"
            )
            lines.append(
                f"| {run['shape']} ({run['layers']} layers) | {config} | {result['loss_error']:.1e} | "
                f"{statistics.median(errors.values()):.4f} | {errors[worst]:.4f} ({worst}) | {beyond} | {run['date']} |"
            )
    return lines


def main() -> int:
    rows = load()
    print("\n".join(["## Speed", "", *speed(rows), "", "## Fidelity against fp32 eager", "", *fidelity(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
