"""The delta rule's stage faults on the CPU, its fla and fusepatch Triton kernels run by Triton's interpreter.

tests/gpu/test_gpu_stage_faults.py runs every stage fault on the GPU; this runs the same wrapper and stage tables
(tests/stage_faults.py) on a machine without one, in bf16 (tests/interpreter.py makes the interpreter's bf16
arithmetic the GPU's), for the faults the H200 runs saw pass (``LISTED``) or every output of every stage
(``--all``). fla-core must be importable (not in CI: CI's normal run does not run this). A self-test takes
10-40 s here::

    TRITON_INTERPRET=1 PYTHONPATH=<fla-core>:. python tests/stage_faults_interpreter.py --seeds 11 12 13 \\
        --record /tmp/stage-faults-cpu.jsonl

prints one line a run (clean runs on each seed, then each fault on the first seed, or on each of ``--fault-seeds``;
``--outputs prepare_wy_repr_bwd:3``: that stage output alone) and exits 1 where a clean run was refused or a fault
passed."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import interpreter  # noqa: E402

interpreter.install()

from stage_faults import COMPOSITES, injected  # noqa: E402

OP = "gated_delta_rule"
# (stage, output) of the faults the H200 runs saw pass: WY keys, the WY backward's key and decay gradients, the
# A_log / dt_bias gradients
LISTED = {
    "chunk_gated_delta_rule_fwd_intra": (0,),
    "recompute_w_u_fwd": (0,),
    "prepare_wy_repr_bwd": (0, 3),
    "gdn_gate_bwd": (1, 2),
}
CANDIDATES = ("fla-saved-states-grouped", "fla-saved-states", "fla", "fla-gate-outside")


def measured(name: str, stage, fault, index: int, packed: bool, seed: int, cases: tuple[str, ...] = ()):
    """(verdict, errors, bounds, wrapper, seconds) of the self-test of ``name`` with ``stage`` spoiled; ``cases``:
    only those of the op's cases (a fault they refuse, the whole self-test refuses: its verdict is every case's)."""
    import dataclasses

    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op = OPS[OP]
    if cases:
        kept = tuple(case for case in op.selftest.cases if case.name in cases)
        op = dataclasses.replace(op, selftest=dataclasses.replace(op.selftest, cases=kept))
    candidate = next(c for c in op.candidates if c.name == name)
    start = time.perf_counter()
    with injected(stage, fault, index) as wrapper:
        fn = candidate.load()
        errors, limits = selftest.measure(op, fn, "cpu", "bfloat16", packed=packed, seed=seed)
    verdict = selftest.judge(op, errors, limits, "cpu", "bfloat16")
    return verdict, errors, limits, wrapper, time.perf_counter() - start


def main(argv=None) -> int:
    from fusepatch.engine.selftest import worst

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--faults", nargs="*", default=["x1.02", "x0.98"])
    parser.add_argument("--seeds", nargs="*", type=int, default=[11])
    parser.add_argument("--packed", nargs="*", default=["0", "1"])
    parser.add_argument("--all", action="store_true", help="every output of every stage, not only LISTED")
    parser.add_argument("--record", help="append a JSON line per run here")
    parser.add_argument("--clean", choices=("both", "only", "none"), default="both", help="the unfaulted runs")
    parser.add_argument("--fault-cases", nargs="*", default=[], help="run the faults with these cases only")
    parser.add_argument(
        "--fault-seeds", nargs="*", type=int, default=[], help="the faults' seeds (the first of --seeds)"
    )
    parser.add_argument("--outputs", nargs="*", default=[], help="only these stage outputs (name:index)")
    args = parser.parse_args(argv)
    bad = []

    def out(row):
        print(json.dumps({k: v for k, v in row.items() if k not in ("errors", "bounds")}), flush=True)
        if args.record:
            with open(args.record, "a") as file:
                file.write(json.dumps(row) + "\n")

    chosen = {}
    for item in args.outputs:
        stage_name, _, number = item.rpartition(":")
        chosen[stage_name] = (*chosen.get(stage_name, ()), int(number))
    listed = chosen or LISTED
    for name in args.candidates:
        stages = [s for s in COMPOSITES[OP, name] if (args.all and not chosen) or s.name in listed]
        for packed in (p == "1" for p in args.packed):
            for seed in args.seeds if args.clean != "none" else ():  # the unfaulted candidate, on each seed
                verdict, errors, limits, _, seconds = measured(name, stages[0], None, 0, packed, seed)
                found = worst(errors, limits)
                out({"candidate": name, "fault": None, "packed": packed, "seed": seed, "refused": not verdict.ok,
                     "worst": found, "error": errors[found], "bound": limits[found], "seconds": round(seconds, 1),
                     "errors": errors, "bounds": limits})  # fmt: skip
                if not verdict.ok:
                    bad.append(f"{name} packed={packed} seed={seed} refused unfaulted: {verdict.reason}")
            for stage in stages if args.clean != "only" else ():
                outputs = listed.get(stage.name, ()) if chosen or not args.all else None
                index = 0
                while True:
                    if outputs is not None and index >= max(outputs, default=-1) + 1:
                        break
                    if outputs is not None and index not in outputs:
                        index += 1
                        continue
                    for fault, seed in itertools.product(args.faults, args.fault_seeds or args.seeds[:1]):
                        found = measured(name, stage, fault, index, packed, seed, tuple(args.fault_cases))
                        verdict, errors, limits, wrapper, seconds = found
                        if wrapper.calls == 0 or index >= wrapper.outputs:
                            break
                        if not wrapper.applied:
                            continue
                        found = worst(errors, limits)
                        out({"candidate": name, "stage": stage.label, "output": index, "fault": fault,
                             "packed": packed, "seed": seed, "cases": args.fault_cases or "all", "refused": not verdict.ok, "worst": found,
                             "error": errors[found], "bound": limits[found], "seconds": round(seconds, 1),
                             "errors": errors, "bounds": limits})  # fmt: skip
                        if verdict.ok:
                            bad.append(f"{name} {stage.label} output {index} {fault} packed={packed} passed")
                    else:
                        index += 1
                        continue
                    break
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
