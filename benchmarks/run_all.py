"""Run the benchmark configurations side by side, each in its own process, and print a markdown table.

    python benchmarks/run_all.py --shape 27b --site-fla /tmp/site-fla --site-tl /tmp/site-tl --out results.json

``--site-fla`` holds fla + causal-conv1d (+ kernels, liger); ``--site-tl`` holds tilelang and its
dependencies. Each configuration sees only the folders it is meant to: ``eager`` sees neither, the
``-no-tilelang`` rows see fla but not tilelang (the stack where fla's Hopper guard bites). A label may carry
environment settings for its process: ``fusepatch+FUSEPATCH_CE_LOGITS_MIB=1024``.

``--record FILE`` appends the run's rows in the records' form (``benchmarks/records/``: the fields the docs' figures
read, the code's commit, the command), each as its configuration ends; ``--from-json`` writes them from an earlier
run's ``--out`` instead of running, with that run's options and the command that measured it:

    python benchmarks/run_all.py --from-json results.json --record rows.jsonl --commit abc1234 --note "what ran" \
        --command "python benchmarks/run_all.py --shape 2b ..." --shape 2b
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import provenance
from shapes import SHAPES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIGS = {
    # label: (train_step config, needs fla, needs tilelang)
    "eager": ("eager", False, False),
    "hf-fast": ("hf-fast", True, True),
    "liger": ("liger", True, True),
    "fusepatch": ("fusepatch", True, True),
    "hf-fast-no-tilelang": ("hf-fast", True, False),
    "fusepatch-no-tilelang": ("fusepatch", True, False),
}


# label words that are train_step options: fusepatch+compile, hf-fast+compile+quick, fusepatch+graphs+quick,
# fusepatch+cudagraphs+quick (the library's apply(cuda_graphs=True)), fusepatch+cache+quick (the config's use_cache=True),
# fusepatch+fp8+quick (apply(precision="fp8")), fusepatch+fp8+drop+quick (and drop_frozen_weights=True: LoRA's frozen
# bases kept in FP8 only), fusepatch+fp8+fastaccum+quick (its GEMMs with use_fast_accum=True), fusepatch+fp8+fp8head
# (apply(lm_head_precision="fp8"): the LM head's GEMMs in FP8 too),
# hf-fast+torchao+compile+quick (torchao's float8 rowwise, compiled as torchao advises),
# hf-fast+torchao+compilelayers+quick (the same with each decoder layer compiled, as torchtitan does),
# hf-fast+torchao+compileprojections+quick (only the projections compiled: fla and causal-conv1d stay),
# hf-fast+freezegc (gc.freeze() after the warm-up, as FusePatchCallback does after step 2)
FLAGS = {
    "compile": ["--compile"],
    "compilelayers": ["--compile-layers"],
    "compileprojections": ["--compile-projections"],
    "quick": ["--no-diagnostics"],
    "graphs": ["--graph-layers"],
    "cudagraphs": ["--cuda-graphs"],
    "cache": ["--default-cache"],
    "fp8": ["--precision", "fp8"],
    "drop": ["--drop-frozen-weights"],
    "fastaccum": ["--fast-accum"],
    "fp8head": ["--fp8-lm-head"],
    "torchao": ["--torchao-float8"],
    "freezegc": ["--freeze-gc"],
}


def parse_label(label: str) -> tuple[str, dict[str, str], list[str], str]:
    """``fusepatch+FUSEPATCH_CE_LOGITS_MIB=1024``, ``hf-fast+compile``: a configuration plus environment settings
    or options (``FLAGS``) for its process, so that variants are measured in the same run as their baselines.
    ``+code=REV`` imports fusepatch from ``.code/REV/`` in place of the working tree's (an older commit's package:
    ``mkdir -p .code/REV && git archive REV fusepatch | tar -x -C .code/REV``): a before/after pair from one run.
    Returns (base, env, flags, package root)."""
    base, *settings = label.split("+")
    if base not in CONFIGS:
        raise ValueError(f"unknown configuration {base!r} in {label!r}; known: {', '.join(CONFIGS)}")
    env, flags, root = {}, [], ROOT
    for setting in settings:
        if setting in FLAGS:
            flags += FLAGS[setting]
            continue
        name, sep, value = setting.partition("=")
        if not sep or not name:
            raise ValueError(f"{label!r}: expected NAME=VALUE or one of {', '.join(FLAGS)} after '+', got {setting!r}")
        if name == "code":
            root = os.path.join(ROOT, ".code", value)
            if not os.path.isdir(os.path.join(root, "fusepatch")):
                raise ValueError(
                    f"{label!r}: no {root}/fusepatch; make it with "
                    f"`mkdir -p .code/{value} && git archive {value} fusepatch | tar -x -C .code/{value}`"
                )
            continue
        env[name] = value
    return base, env, flags, root


def run_one(label: str, args) -> dict:
    base, overrides, flags, root = parse_label(label)
    config, fla, tilelang = CONFIGS[base]
    paths = [root] + ([args.site_fla] if fla else []) + ([args.site_tl] if tilelang else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), FLA_FLASH_QLA="0", **overrides)
    stem = f"{args.shape}-{re.sub(r'[^A-Za-z0-9.+=_-]', '_', label)}"  # a label may hold '/' (FUSEPATCH_SKIP)
    out = os.path.join(args.workdir, f"{stem}.json")
    cmd = [
        sys.executable,
        os.path.join(HERE, "train_step.py"),
        "--config",
        config,
        "--label",
        label,
        "--shape",
        args.shape,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--json-out",
        out,
    ]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.checkpointing:
        cmd.append("--checkpointing")
    if args.vary_seq:
        cmd += ["--vary-seq", str(args.vary_seq)]
    if args.packed_docs:
        cmd += ["--packed-docs", str(args.packed_docs)]
    if args.sft:
        cmd += ["--sft", "--doc-tokens", str(args.doc_tokens)]
    if args.lora:
        cmd += ["--lora", str(args.lora)]
    cmd += flags
    if args.prompt:
        cmd += ["--prompt", str(args.prompt)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as cut:
        # what the process printed before it was stopped: a compiled first step's heartbeat says how far it got
        stdout, stderr = _text(cut.stdout), _text(cut.stderr)
        last = [line for line in stderr.splitlines() if line.startswith("[")][-1:]
        result = {"config": label, "error": f"timed out after {args.timeout}s" + (f"; last: {last[0]}" if last else "")}
    else:
        if os.path.exists(out):
            with open(out) as fh:
                result = json.load(fh)
        else:
            result = {"config": label, "error": f"exit {proc.returncode}: {stderr[-800:]}"}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(args.workdir, f"{stem}.log"), "w") as fh:
        fh.write(stdout[-20000:] + "\n--- stderr ---\n" + stderr[-20000:])
    return result


def _text(output: bytes | str | None) -> str:
    """A stopped process's captured output: bytes on POSIX, whatever ``text=True`` asked for."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _event_timed(r: dict, base: dict | None, prefix: str) -> tuple[str, str, str]:
    """tokens/s, the ratio to the baseline and the median step of one event-timed loop, "-" where not run."""
    if f"{prefix}_tokens_per_s" not in r:
        return "-", "-", "-"
    ratio = "-"
    if base and f"{prefix}_tokens_per_s" in base:
        ratio = f"{r[f'{prefix}_tokens_per_s'] / base[f'{prefix}_tokens_per_s']:.3f}x"
    return f"{r[f'{prefix}_tokens_per_s']:,.0f}", ratio, str(r[f"{prefix}_median_step_ms"])


def table(results: list[dict], baseline: str = "hf-fast") -> str:
    base = next((r for r in results if r.get("config") == baseline and "error" not in r), None)
    lines = [
        "| config | tokens/s | vs hf-fast | median step ms | slowest step ms | back-to-back tokens/s | vs hf-fast | back-to-back median ms | Trainer-loop tokens/s | vs hf-fast | Trainer-loop median ms | peak GiB | peak reserved GiB | aten ops/step | GPU kernels/step | GPU busy | MFU | SM MHz / W (median) | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} |{' - |' * 17} fails: {r['error'][:160]} |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        # the same steps with no host wait between them, and with the Trainer's one wait after the backward
        # (train_step.back_to_back, train_step.trainer_loop)
        b2b, b2b_ratio, b2b_ms = _event_timed(r, base, "b2b")
        trainer, trainer_ratio, trainer_ms = _event_timed(r, base, "trainer")
        notes = list(r.get("fallbacks", [])[:2])
        if r.get("triton_builds"):  # kernels built during the timed steps: each one cost a compile or a load
            kernels = ", ".join(f"{k} {n}" for k, n in r.get("triton_builds_by_kernel", {}).items())
            notes.append(f"{r['triton_builds']} Triton builds in the timed steps ({kernels})")
        note = "; ".join(notes)[:240]
        clocks = r.get("gpu_clocks") or {}
        power = f"{clocks['sm_mhz_median']:.0f} / {clocks['power_w_median']:.0f}" if "sm_mhz_median" in clocks else "-"
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['median_step_ms']} | "
            f"{r.get('max_step_ms', max(r.get('step_ms') or [0]))} | {b2b} | {b2b_ratio} | {b2b_ms} | {trainer} | {trainer_ratio} | {trainer_ms} | {r['peak_mem_gib']} | {r.get('peak_reserved_gib', '-')} | "
            f"{r['aten_ops_per_step']:,} | {r['gpu_kernels_per_step']:,} | {r['gpu_busy_fraction']:.2f} | {r['mfu']:.2f} | {power} | {note} |"
        )
    return "\n".join(lines)


def _section(results: list[dict], key: str, header: str, render, absent: str = "") -> str:
    """One section under the table from a per-row diagnostic ``key``: ``render(row, found)`` gives each row's lines;
    a row whose diagnostic failed (``<key>_error``) says so, as ``absent``; no lines, no section."""
    lines = []
    for r in results:
        if r.get(f"{key}_error"):
            lines.append(f"- {r['config']}: {absent} ({r[f'{key}_error']})")
        if r.get(key):
            lines += render(r, r[key])
    return f"\n{header}\n" + "\n".join(lines) if lines else ""


def memory_lines(results: list[dict]) -> str:
    """Each configuration's peak by phase (step_diagnostics.memory_by_phase): which part of the step holds the peak
    that the table's peak column reports, and what is allocated when that part ends."""

    def render(r: dict, found: dict) -> list[str]:
        phases = {k: v for k, v in found.items() if isinstance(v, dict)}
        if not phases:
            return []
        parts = ", ".join(f"{name} {v['peak_gib']} / {v['end_gib']}" for name, v in phases.items())
        return [f"- {r['config']}: {parts}; the peak in {r.get('peak_phase')}"]

    return _section(
        results, "memory_by_phase", "Peak memory by phase (GiB: the phase's peak / allocated at its end):", render
    )


def host_lines(results: list[dict]) -> str:
    """Each configuration's host and GPU time by phase (step_diagnostics.host_time_by_phase) and the forward's host
    time by layer class: where the CPU, not the GPU, sets a synced step's pace."""

    def render(r: dict, found: dict) -> list[str]:
        parts = []
        for name, v in found["phases"].items():
            gpu = "-" if v["gpu_ms"] is None else v["gpu_ms"]
            parts.append(f"{name} {v['host_ms']} / {gpu}" + ("" if v["clean"] else " (waited for the GPU)"))
        layers = "; ".join(f"{name} {ms} ({n})" for name, (ms, n) in found["forward_host_by_layer_ms"].items())
        # a forward that outran the GPU's sleep or filled the launch queue waited somewhere in it: that wait lands in
        # whichever layer was queuing then (one layer class can look slow that is not)
        waited = any(not found["phases"].get(name, {"clean": True})["clean"] for name in ("layers", "forward"))
        caveat = " (the forward waited for the GPU: a class's time includes that wait)" if waited else ""
        return [
            f"- {r['config']}: {', '.join(parts)}"
            + (f"; forward host ms by layer (calls){caveat}: {layers}" if layers else "")
        ]

    header = "Host / GPU ms by phase (each phase queued behind a GPU sleep; host above GPU: the CPU sets the pace):"
    return _section(results, "host_vs_gpu", header, render, absent="not measured")


def profile_lines(results: list[dict], top: int = 14) -> str:
    """Each profiled configuration's forward by Python function (step_diagnostics.host_profile, BENCH_HOST_PROFILE=1):
    self time by package, then the functions with the most self time."""

    def render(r: dict, found: dict) -> list[str]:
        packages = ", ".join(f"{k} {v}" for k, v in found["by_package_ms"].items())
        head = f"- {r['config']}: forward {found['forward_ms']} ms under cProfile; self ms by package: {packages}"
        return [head] + [
            f"    {ms:8.2f} ms self {total:8.2f} total {calls:6d} calls  {fn}"
            for fn, ms, total, calls in found["self"][:top]
        ]

    header = "The forward's Python (cProfile; times inflated, read them as a ranking):"
    return _section(results, "host_profile", header, render, absent="not profiled")


def sync_lines(results: list[dict], top: int = 6) -> str:
    """Where each configuration's host waited for the GPU in one step (step_diagnostics.host_syncs): counts by
    phase, then the sites that waited most."""

    def render(r: dict, found: dict) -> list[str]:
        phases = ", ".join(f"{k} {v}" for k, v in found["by_phase"].items()) or "none"
        head = f"- {r['config']}: {phases}; allocator retries {found['allocator_retries']}"
        return [head] + [f"    {count:5d}  {site}" for site, count in found["sites"][:top]]

    return _section(results, "host_syncs", "Host waits for the GPU in one step (sync debug mode):", render, "not read")


def load_lines(results: list[dict]) -> str:
    """Each configuration's host CPU over its timed steps (train_step's ``host_load``): cores busy, its own share,
    other processes'. A row whose host was shared (other processes on a core or more) is marked: its synced
    figure is not comparable with a quiet host's where the forward is CPU-bound."""

    def render(r: dict, found: dict) -> list[str]:
        if found.get("error"):
            return [f"- {r['config']}: not measured ({found['error']})"]
        mark = " **shared host**" if found.get("shared") else ""
        return [
            f"- {r['config']}: {found['busy_cores']} of {found['cores']} cores busy, this process {found['own_cores']}, "
            f"other processes {found['other_cores']}; load average {found['load_1min']}{mark}"
        ]

    return _section(results, "host_load", "Host CPU over the synced steps (cores, on average):", render)


def record_rows(
    results: list[dict], *, code: str, command: str, args: argparse.Namespace, note: str = "", date: str | None = None
) -> list[dict]:
    """The record rows (``benchmarks/records/*.jsonl``, what the docs' figures are checked against) of one run's
    results: one per configuration, in the fields and units the records use. A ``+code=REV`` configuration's row
    names REV as its code; a configuration that failed keeps its error, and where it left no results (timed out,
    exited early) its place from the run: the options' shape and depth, the date and GPU of a configuration that
    ran (the same machine), else ``date``."""
    steps = (
        f"median of {args.steps} timed steps after {args.warmup} warm-up steps, every configuration its own "
        "process, one sequence on one machine"
    )
    ran = next((r for r in results if r.get("date")), {})
    spec = SHAPES.get(args.shape, {})
    layers = args.layers or spec.get("layers")
    run = {"date": ran.get("date", date), "gpu": ran.get("gpu"), "shape": args.shape, "layers": layers}
    run.update(seq=spec.get("seq"), batch=spec.get("batch"))
    rows = []
    for r in results:
        label = r.get("config") or r.get("label")
        older = re.search(r"\+code=([^+]+)", label or "")  # not parse_label: that package need not be here
        row = {
            "benchmark": "train_step",
            "date": r.get("date", run["date"]),
            "gpu": r.get("gpu", run["gpu"]),
            "code": older.group(1) if older else code,
            "versions": r.get("versions"),
            "steps": steps,
            "command": command,
            **{k: r.get(k, run[k]) for k in ("shape", "layers", "seq", "batch")},
            "config": label,
        }
        settings = ("lora_rank", "trainable", "sft", "packed_docs", "prompt", "params")
        row.update({k: r[k] for k in settings if r.get(k) is not None})
        if args.vary_seq:
            row["vary_seq"] = args.vary_seq
        if args.checkpointing:
            row["checkpointing"] = True
        if "error" in r or r.get("tokens_per_s") is None:
            rows.append({**row, "error": str(r.get("error", "no result"))[-2000:], "note": note})
            continue
        pauses, idle = r.get("host_pauses") or {}, r.get("gpu_idle") or {}
        row.update(
            tokens_per_s_synced=round(r["tokens_per_s"]),
            median_step_ms=r.get("median_step_ms"),
            step_ms=r.get("step_ms"),
            tokens_per_s_back_to_back=round(r["b2b_tokens_per_s"]) if r.get("b2b_tokens_per_s") else None,
            tokens_per_s_trainer_loop=round(r["trainer_tokens_per_s"]) if r.get("trainer_tokens_per_s") else None,
            peak_gib=r.get("peak_mem_gib"),
            peak_reserved_gib=r.get("peak_reserved_gib"),
            gpu_busy=round(r["gpu_busy_fraction"], 3) if r.get("gpu_busy_fraction") is not None else None,
            mfu=round(r["mfu"], 3) if r.get("mfu") is not None else None,
            aten_ops_per_step=r.get("aten_ops_per_step"),
            gpu_kernels_per_step=r.get("gpu_kernels_per_step"),
            kernel_ms_per_step=r.get("kernel_ms_total"),
            gc_ms_over_timed_steps=pauses.get("gc_ms"),
            gc_collections_over_timed_steps=pauses.get("gc_collections"),
            gpu_idle_gaps=idle.get("gaps"),
            gpu_idle_ms=idle.get("gap_ms_total"),
            gpu_idle_ms_by_phase=idle.get("by_phase"),
            note=note,
        )
        if r.get("kernel_split"):  # the profiled step's GEMMs, optimizer and rest (step_diagnostics.kernel_split)
            row["kernel_split"] = r["kernel_split"]
        if r.get("host_syncs"):  # where the host waited for the GPU in one more step (step_diagnostics.host_syncs)
            row["host_syncs"] = r["host_syncs"]
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--configs", default="hf-fast,fusepatch,liger,eager,fusepatch-no-tilelang,hf-fast-no-tilelang")
    parser.add_argument("--site-fla", default="")
    parser.add_argument("--site-tl", default="")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument(
        "--vary-seq", type=float, default=0.0, help="each timed step's length from [seq*(1-F), seq] (train_step.py)"
    )
    parser.add_argument(
        "--packed-docs", type=int, default=0, help="K documents of random lengths in every row (train_step.py)"
    )
    parser.add_argument(
        "--prompt", type=float, default=0.0, help="the first F of every row's labels -100 (train_step.py)"
    )
    parser.add_argument("--sft", action="store_true", help="packed chat-SFT rows (train_step.py, sft_rows.py)")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="--sft: the documents' mean length")
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA of this rank on every linear (train_step.py)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--workdir", default=".")
    parser.add_argument("--out", default=None)
    parser.add_argument("--record", default=None, help="append the run's record rows to this JSON-lines file")
    parser.add_argument("--commit", default=None, help="the code's commit for --record (default: git's HEAD)")
    parser.add_argument("--note", default="", help="--record: what the rows measured, in words")
    parser.add_argument("--command", default=None, help="--record: the command the rows name (default: this one)")
    parser.add_argument(
        "--from-json", default=None, help="no run: write --record from an earlier run's --out (same options)"
    )
    args = parser.parse_args()
    if args.from_json and not args.record:
        parser.error("--from-json writes record rows: give --record FILE")
    if args.from_json and not args.command:  # the default would name this conversion, not the run that measured
        parser.error("--from-json: give --command, the command that measured the results")
    commit = (args.commit or provenance.code() or "unknown") if args.record else ""
    command = args.command or provenance.command(__file__)

    def record(results: list[dict], last: int | None = None) -> None:
        rows = record_rows(results, code=commit, command=command, args=args, note=args.note, date=provenance.today())
        provenance.append_rows(args.record, rows[-last:] if last else rows)

    if args.from_json:
        with open(args.from_json) as fh:
            record(json.load(fh))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    labels = args.configs.split(",")
    for label in labels:  # a typo fails here, not after an hour of the configurations before it
        parse_label(label)
    results = []
    for label in labels:
        results.append(run_one(label, args))
        r = results[-1]
        print(f"{label}: {r.get('tokens_per_s', r.get('error'))} (wall {r.get('wall_s')} s)", flush=True)
        if args.out:  # after every configuration: a run cut off by its time limit keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=2)
        record(results, last=1)  # its record row too
    print(f"\nshape {args.shape}, command: {' '.join(sys.argv)}")
    print(table(results))
    print(memory_lines(results))
    print(load_lines(results))
    print(host_lines(results))
    print(profile_lines(results))
    print(sync_lines(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
