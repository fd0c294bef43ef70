"""Turn the SFT example's logs (one per configuration, same run) into the results table.

    python benchmarks/studies/sft_table.py --gpus 8 sft-hf-fast.log sft-fusepatch.log

Reads the lines the example prints on rank 0: ``losses: ...``, ``fusepatch metrics: {...}`` (the profiled step)
and ``steady state (rank N): {...}`` (median over the timed steps after warm-up). Per-GPU figures are rank 0's;
the ratio column is against the first log's configuration. The loss curves are compared step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

_MARKERS = re.compile(r"(losses|fusepatch metrics|steady state \((?:this rank|rank (\d+))\)): ")


def _leading_floats(text: str) -> list[float]:
    values = []
    for word in text.split():
        try:
            values.append(float(word))
        except ValueError:
            break
    return values


def parse(path: str) -> dict:
    """The first ``losses`` and ``fusepatch metrics`` lines, and rank 0's ``steady state`` (else the first).
    Markers are found anywhere in a line: under torchrun two ranks' lines can run together."""
    text = open(path, encoding="utf-8", errors="replace").read()
    found: dict = {"config": os.path.basename(path).removeprefix("sft-").removesuffix(".log")}
    decoder = json.JSONDecoder()
    for match in _MARKERS.finditer(text):
        marker, rank = match.group(1), match.group(2)
        rest = text[match.end() :]
        if marker == "losses":
            if "losses" not in found:
                found["losses"] = [
                    float(x) for x in re.match(r"[-+0-9.eE naif]*", rest.split("\n", 1)[0]).group().split()
                ]
            continue
        try:
            value = decoder.raw_decode(rest)[0]
        except json.JSONDecodeError:
            continue
        if marker == "fusepatch metrics":
            found.setdefault("profile", value)
        elif "steady" not in found or rank == "0":
            found["steady"] = value
    return found


def _get(profile: dict, key: str, fmt: str) -> str:
    return format(profile[key], fmt) if key in profile else "-"


def table(runs: list[dict], gpus: int) -> str:
    base = runs[0].get("steady", {}).get("median_tokens_per_s")
    lines = [
        "| config | tokens/s per GPU (median) | vs first | median step ms | steps timed | peak GiB per GPU | "
        "GPU busy | MFU | aten ops/step | GPU kernels/step | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        steady, prof = run.get("steady", {}), run.get("profile", {})
        if not steady:
            lines.append(
                f"| {run['config']} | - | - | - | - | - | - | - | - | - | - |  (no steady-state line: run failed)"
            )
            continue
        rate = steady["median_tokens_per_s"]
        ratio = f"{rate / base:.2f}x" if base else "-"

        loss = f"{run['losses'][-1]:.3f}" if run.get("losses") else "-"
        lines.append(
            f"| {run['config']} | {rate:,.0f} | {ratio} | {steady['median_step_s'] * 1000:.1f} | {steady['steps']} | "
            f"{_get(prof, 'fusepatch/peak_memory_gib', '.2f')} | {_get(prof, 'fusepatch/gpu_busy_fraction', '.2f')} | "
            f"{_get(prof, 'fusepatch/mfu', '.3f')} | {_get(prof, 'fusepatch/cpu_ops_per_step', ',')} | "
            f"{_get(prof, 'fusepatch/gpu_kernels_per_step', ',')} | {loss} |"
        )
    lines.append(f"\n{gpus} GPU(s); per-GPU figures from rank 0.")
    curves = [r for r in runs if r.get("losses")]
    if len(curves) >= 2:
        first = curves[0]["losses"]
        for other in curves[1:]:
            gaps = [abs(a - b) / abs(a) for a, b in zip(first, other["losses"]) if a]
            lines.append(
                f"Loss curves, {curves[0]['config']} vs {other['config']}: {len(gaps)} steps, largest relative gap "
                f"{max(gaps):.3f}; {curves[0]['config']}: {' '.join(f'{x:.3f}' for x in first)}; "
                f"{other['config']}: {' '.join(f'{x:.3f}' for x in other['losses'])}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--gpus", type=int, default=1)
    args = parser.parse_args(argv)
    print(table([parse(p) for p in args.logs], args.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
