"""Loss curves of two configurations, two seeds each: is the candidate's curve within the run-to-run spread of
the baseline's?

    python benchmarks/studies/loss_curves.py hf-fast:0=hf0.log hf-fast:1=hf1.log fusepatch:0=fp0.log \
        fusepatch:1=fp1.log
    python benchmarks/studies/loss_curves.py bf16:0=a.log bf16:1=b.log fp8:0=c.log fp8:1=d.log \
        --baseline bf16 --candidate fp8

Each log holds a ``losses:`` line (``examples/sft_ultrachat.py``'s output, or ``benchmarks/studies/text_curves.py``'s).
The curves are averaged over windows of ``--window`` steps; the spread is the largest window difference between
the baseline's two seeds (``--baseline``, default hf-fast), and the candidate's distance the largest window
difference between the candidate (``--candidate``, default fusepatch) and the baseline at the same seed. Both are
given over all windows and over the windows after step ``--after`` (50): the acceptance rule is the candidate's
distance within the spread over the windows after it (the first steps fall fast, and a window there differs by more
than the rest of the curve). Largest against largest: a window where the candidate is outside that window's own
spread still passes (``benchmarks/figures.py`` counts the windows inside for the docs). Prints a markdown table and appends one JSON record to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import today  # noqa: E402


def losses(path: str) -> list[float]:
    with open(path) as f:
        for line in f:
            if line.startswith("losses: "):
                return [float(x) for x in line.split()[1:]]
    raise SystemExit(f"{path}: no 'losses:' line (did the run finish?)")


def windows(curve: list[float], size: int) -> list[float]:
    return [sum(curve[i : i + size]) / len(curve[i : i + size]) for i in range(0, len(curve), size)]


def largest(smooth: dict, pairs: list[tuple[str, str, str, str]], indices) -> float:
    """The largest window difference between the curves of each pair (config, seed, config, seed) over the
    windows ``indices``; nan where there is no window."""
    return max(
        (abs(smooth[(a, s)][i] - smooth[(b, t)][i]) for a, s, b, t in pairs for i in indices), default=float("nan")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="config:seed=log")
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--baseline", default="hf-fast", help="the configuration whose seeds give the spread")
    parser.add_argument("--candidate", default="fusepatch", help="the configuration compared with the baseline")
    parser.add_argument("--after", type=int, default=50, help="the acceptance rule's windows start after this step")
    parser.add_argument("--out", default=None)
    parser.add_argument("--command", default="", help="the command that made the logs, for the record")
    args = parser.parse_args(argv)
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
    base, cand = args.baseline, args.candidate
    for config in (base, cand):
        missing = [s for s in seeds if (config, s) not in smooth]
        if missing:
            raise SystemExit(f"no {config} run for seed(s) {', '.join(missing)}: give config:seed=log for each")
    if len(seeds) < 2:
        raise SystemExit(f"{base}'s spread needs two seeds, got {seeds}")
    # the windows after step --after: those that start after it (25-step windows after 50: 51-75 onwards)
    late = [i for i in range(count) if i * args.window >= args.after]
    spread_all, spread_late = (largest(smooth, [(base, seeds[0], base, seeds[1])], idx) for idx in (range(count), late))
    pairs = [(cand, s, base, s) for s in seeds]
    distance_all, distance_late = (largest(smooth, pairs, idx) for idx in (range(count), late))
    within = distance_all <= spread_all
    within_late = distance_late <= spread_late  # nan (no window after --after) is never within
    lines += [
        "",
        f"{base}'s run-to-run spread (largest {args.window}-step window difference between seeds): {spread_all:.4f}",
        f"{cand}'s largest window difference from {base} at the same seed: {distance_all:.4f}"
        f" -> {'within' if within else 'OUTSIDE'} the spread",
        "",
        f"| windows | {base}'s spread | {cand}'s distance | {cand} |",
        "|---|---|---|---|",
        f"| all windows | {spread_all:.4f} | {distance_all:.4f} | {'within' if within else 'OUTSIDE'} |",
        f"| after step {args.after} | {spread_late:.4f} | {distance_late:.4f} | {'within' if within_late else 'OUTSIDE'} |",
    ]
    print("\n".join(lines))
    if args.out:
        record = {
            "benchmark": "loss_curves",
            "date": today(),
            "command": args.command,
            "window": args.window,
            "steps": {f"{c}:{s}": len(v) for (c, s), v in curves.items()},
            "windows": {f"{c}:{s}": v for (c, s), v in smooth.items()},
            "baseline": base,
            "candidate": cand,
            "spread": spread_all,
            "distance": distance_all,
            "within": within,
            "after": args.after,
            "spread_after": None if math.isnan(spread_late) else spread_late,
            "distance_after": None if math.isnan(distance_late) else distance_late,
            "within_after": within_late,
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
