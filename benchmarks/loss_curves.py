"""Loss curves of the SFT example, fusepatch against hf-fast, two seeds each: is fusepatch's curve within the
run-to-run spread of hf-fast's?

    python benchmarks/loss_curves.py hf-fast:0=hf0.log hf-fast:1=hf1.log fusepatch:0=fp0.log fusepatch:1=fp1.log

Each log is ``examples/sft_ultrachat.py``'s output (its ``losses:`` line). The curves are averaged over windows
of ``--window`` steps; the spread is the largest window difference between hf-fast's two seeds, and fusepatch's
distance the largest window difference between fusepatch and hf-fast at the same seed. Prints a markdown table
and appends one JSON record to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys


def losses(path: str) -> list[float]:
    with open(path) as f:
        for line in f:
            if line.startswith("losses: "):
                return [float(x) for x in line.split()[1:]]
    raise SystemExit(f"{path}: no 'losses:' line (did the run finish?)")


def windows(curve: list[float], size: int) -> list[float]:
    return [sum(curve[i : i + size]) / len(curve[i : i + size]) for i in range(0, len(curve), size)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="config:seed=log")
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--out", default=None)
    parser.add_argument("--command", default="", help="the command that made the logs, for the record")
    args = parser.parse_args()
    curves: dict[tuple[str, str], list[float]] = {}
    for run in args.runs:
        label, _, path = run.partition("=")
        config, _, seed = label.partition(":")
        curves[(config, seed)] = losses(path)
    seeds = sorted({seed for _, seed in curves})
    smooth = {key: windows(curve, args.window) for key, curve in curves.items()}
    count = min(len(v) for v in smooth.values())
    head = "| steps | " + " | ".join(f"{c} seed {s}" for c, s in sorted(smooth)) + " |"
    lines = [head, "|" + "---|" * (len(smooth) + 1)]
    for i in range(count):
        row = " | ".join(f"{smooth[key][i]:.4f}" for key in sorted(smooth))
        lines.append(f"| {i * args.window + 1}-{(i + 1) * args.window} | {row} |")
    spread = max(abs(smooth[("hf-fast", seeds[0])][i] - smooth[("hf-fast", seeds[1])][i]) for i in range(count))
    distance = max(abs(smooth[("fusepatch", s)][i] - smooth[("hf-fast", s)][i]) for s in seeds for i in range(count))
    within = distance <= spread
    lines += [
        "",
        f"hf-fast's run-to-run spread (largest {args.window}-step window difference between seeds): {spread:.4f}",
        f"fusepatch's largest window difference from hf-fast at the same seed: {distance:.4f}"
        f" -> {'within' if within else 'OUTSIDE'} the spread",
    ]
    print("\n".join(lines))
    if args.out:
        record = {
            "benchmark": "loss_curves",
            "date": datetime.date.today().isoformat(),
            "command": args.command,
            "window": args.window,
            "steps": {f"{c}:{s}": len(v) for (c, s), v in curves.items()},
            "windows": {f"{c}:{s}": v for (c, s), v in smooth.items()},
            "spread": spread,
            "distance": distance,
            "within": within,
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
