"""The current results tables, rendered from the run records in ``benchmarks/records/`` (one JSON line per row).

python benchmarks/render.py            # markdown: speed (the newest run of every workload), then fidelity
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


def _workload(r: dict) -> str:
    """The shape and what the step trains: rows of one workload compare with each other only."""
    text = f"{r['shape']} ({r['layers']} layers, seq {r['seq']}, batch {r['batch']})"
    if r.get("lora_rank"):
        text += f", LoRA r{r['lora_rank']}"
    if r.get("sft"):
        text += ", packed chat SFT"
    return text


def _label(config: str) -> str:
    """``+quick`` only leaves the memory and host views out (the timing is the same): dropped from the label."""
    return "+".join(word for word in config.split("+") if word != "quick")


def speed(rows: list[dict]) -> list[str]:
    """Every workload's configurations, each from its newest run (date, then place in the records, then code);
    ``vs hf-fast`` against hf-fast of that same run only, never across runs (machines differ). Peak reserved is
    the allocator's whole holding: CUDA-graph memory pools count there, not in the allocated peak."""
    runs = [r for r in rows if r["benchmark"] == "train_step" and r.get("tokens_per_s_synced")]
    lines = [
        "| workload | config | tokens/s (synced) | vs hf-fast | back to back | Trainer loop | peak GiB | peak reserved GiB | date, GPU, code | record |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for workload in sorted({_workload(r) for r in runs}):
        mine = [r for r in runs if _workload(r) == workload]
        for config in sorted({_label(r["config"]) for r in mine}, key=lambda c: (c != "fusepatch", c)):
            theirs = [(r["date"], i) for i, r in enumerate(mine) if _label(r["config"]) == config]
            date, index = max(theirs)  # a date's later lines are later runs
            run = (date, mine[index].get("code", ""))
            same = [r for r in mine if _label(r["config"]) == config and (r["date"], r.get("code", "")) == run]
            bases = [
                r["tokens_per_s_synced"]
                for r in mine
                if _label(r["config"]) == "hf-fast" and (r["date"], r.get("code", "")) == run
            ]
            tok = statistics.median(r["tokens_per_s_synced"] for r in same)
            b2b = statistics.median(r["tokens_per_s_back_to_back"] for r in same)
            loop = statistics.median(r["tokens_per_s_trainer_loop"] for r in same)
            first = same[0]
            ratio = f"{tok / statistics.median(bases):.2f}x" if bases else "-"
            reserved = "-" if first.get("peak_reserved_gib") is None else f"{first['peak_reserved_gib']:.1f}"
            lines.append(
                f"| {workload} | {config} | {tok:,.0f} | {ratio} | {b2b:,.0f} | {loop:,.0f} | {first['peak_gib']:.1f} | {reserved} | "
                f"{date}, {first['gpu']}, {run[1] or '-'} | {first['record']} |"
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
