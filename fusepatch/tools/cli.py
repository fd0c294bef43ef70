"""``python -m fusepatch doctor | list | demo``: the command line prints; the library only logs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap

from fusepatch.base.env import MissingDependency, require_transformers
from fusepatch.base.known_issues import KNOWN_ISSUES

WIDTH = 100  # what the printed lines fit unless --wide
FP8_NEEDS = "FP8 runs on NVIDIA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell), with CUDA torch"


class CommandError(Exception):
    """A request the machine cannot serve (``--device cuda`` without a GPU): one line with the fix."""


def fit(text: str, wide: bool, width: int = WIDTH) -> str:
    """Each line of ``text`` wrapped at ``width`` columns, continuations indented under its first word."""
    if wide:
        return text
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * min(len(line) - len(line.lstrip()) + 4, 40)
        out.extend(textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""])
    return "\n".join(out)


def _doctor(args: argparse.Namespace) -> int:
    from fusepatch.tools.doctor import diagnose, render

    require_transformers()  # every model fusepatch patches is transformers': without it nothing here can run
    prefer = tuple(args.prefer.split(",")) if args.prefer else None
    try:
        report = diagnose(model_types=args.model_type or None, prefer=prefer, static_only=args.static, every=args.all)
    except ValueError as exc:
        print(f"fusepatch doctor: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else fit(render(report), args.wide))
    found = report["variables"]
    return 1 if args.strict and (report["fallbacks"] or found["problems"] or found["disabled"]) else 0


def _unknown_model_types(given: list[str] | None) -> str:
    """Why ``given`` names a model_type fusepatch has no rows for (with the supported ones), or ``""``."""
    from fusepatch.engine.registry import known_model_types

    known = known_model_types()
    unknown = [t for t in given or [] if t not in known]
    if not unknown:
        return ""
    return f"no fusepatch rows for model_type {', '.join(map(repr, unknown))}; supported: {', '.join(known)}"


def _list(args: argparse.Namespace) -> int:
    from fusepatch.engine.registry import all_ops, all_rows
    from fusepatch.engine.resolve import ordered, preferred_sources

    unknown = _unknown_model_types(args.model_type)
    if unknown:
        raise CommandError(f"--model-type: {unknown}")
    prefer = preferred_sources(None)

    rows = [r for r in all_rows() if not args.model_type or set(r.model_types) & set(args.model_type)]
    if args.json:
        payload = {
            "rows": [r.to_dict() for r in rows],
            "ops": {
                n: [f"{c.name} ({c.source})" for c in ordered(op, prefer)] + ["eager"] for n, op in all_ops().items()
            },
            "known_issues": [i.to_dict() for i in KNOWN_ISSUES],
        }
        print(json.dumps(payload, indent=2))
        return 0
    lines = [f"{'model types':28s} {'layer class':36s} {'forward':12s} ops [candidates in order]"]
    for row in rows:
        ops = []
        for name in row.ops:
            ops.append(f"{name} [{' > '.join(c.name for c in ordered(all_ops()[name], prefer))} > eager]")
        if not ops and row.note:  # a forward with no kernel op (the rotary tables): what it does instead
            ops.append(f"({row.note})")
        elif row.precision:  # a row that only an apply asking for its precision selects
            ops.append(f"(when asked: {row.note})")
        patched = "patched" if row.forward is not None else "not patched"
        lines.append(f"{'/'.join(row.model_types):28s} {row.layer:36s} {patched:12s} {'; '.join(ops)}")
    print(fit("\n".join(lines), args.wide))
    return 0


def _no_gpu() -> str:
    """Why torch sees no GPU here, or ``""``."""
    import torch

    if torch.cuda.is_available():
        return ""
    build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
    return f"torch {torch.__version__} is {build}"


def _demo(args: argparse.Namespace) -> int:
    from fusepatch.tools.demo import run

    if args.device == "cuda" and _no_gpu():
        raise CommandError(f"--device cuda: {_no_gpu()}; fix: run on a GPU machine or drop it")
    if not args.verbose:  # the report printed below holds every fallback's reason and fix
        logging.getLogger("fusepatch").setLevel(logging.ERROR)
    result = run(
        model_type=args.model_type, steps=args.steps, seq_len=args.seq_len, device=args.device, precision=args.precision
    )
    print(fit(str(result["report"]), args.wide))
    print()
    precision, fell_back = "", False
    if args.precision:  # what the request came to: the FP8 GEMMs, or the fallback the report's row explains
        fp8 = [c for layer in result["report"].layers for c in layer.choices if c.op == "fp8_linear"]
        fell_back = not any(c.fused for c in fp8)
        ran = "fell back (the fp8_linear row above says why)" if fell_back else "FP8 GEMMs"
        precision = f", precision {args.precision}: {ran}"
    print(f"device {result['device']} / {result['dtype']}, {args.steps} training steps, seq {args.seq_len}{precision}")
    if fell_back:  # the row's reason may be the machine's (a CPU-only torch), not what FP8 itself needs
        print(FP8_NEEDS)
    print(
        "eager   losses: "
        + " ".join(f"{x:.4f}" for x in result["eager_losses"])
        + f"   {result['eager_steps_per_s']:.2f} steps/s"
    )
    print(
        "patched losses: "
        + " ".join(f"{x:.4f}" for x in result["patched_losses"])
        + f"   {result['patched_steps_per_s']:.2f} steps/s"
    )
    gap = max(abs(a - b) for a, b in zip(result["eager_losses"], result["patched_losses"]))
    print(f"largest loss difference: {gap:.2e}")
    return 0


class _CompileBar:
    """A tqdm bar over ninja's compile steps, made when the first step reports the total."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar = None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm  # transformers' dependency: present wherever fusepatch runs

            self.bar = tqdm(total=total, desc=self.description, unit="file", file=sys.stderr)
        self.bar.total = max(self.bar.total or 0, total)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fusepatch.base.env import capture
    from fusepatch.tools.build import BuildError, plan_build, run_build

    try:
        plan = plan_build(
            args.package,
            capture(),
            sdist=args.sdist,
            arch=args.arch,
            jobs=args.jobs,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        )
        if args.dry_run:
            print(plan.describe())
            return 0
        bar = _CompileBar(f"compiling {plan.package.distribution}")
        try:
            run_build(plan, install=not args.no_install, progress=bar.update)
        finally:
            bar.close()
    except BuildError as exc:
        print(f"fusepatch build: {exc}", file=sys.stderr)
        return 1
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from fusepatch.tools.warmup import cache_locations, dockerfile_hint, warmup, warmup_config

    try:
        warmup_config(args.source)  # an unknown model type: said before any device question
    except (ValueError, OSError) as exc:  # OSError: a folder without a readable config.json
        raise CommandError(str(exc).splitlines()[0]) from None
    caches = " and ".join(f"{variable}={path}" for _, variable, path in cache_locations())
    where = f"fix: run it where the GPU is (a GPU build step of the container image), keeping {caches} in the image"
    if args.device == "cpu":
        raise CommandError(
            "--device cpu: warmup compiles and autotunes the fused GPU kernels; on a CPU every op runs eager, so "
            f"there is nothing to warm; {where}"
        )
    if _no_gpu():
        flag = "--device cuda" if args.device == "cuda" else "no CUDA device"
        raise CommandError(f"{flag}: {_no_gpu()}, and the fused kernels compile on the GPU they run on; {where}")
    results = warmup(
        args.source,
        dtype=args.dtype,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        packed=args.packed,
        device="cuda",
        progress=lambda text: print(f"warmup: {text}", file=sys.stderr, flush=True),
    )
    print(
        f"warm-up of {args.source} ({args.dtype}, seq {args.seq_len}, micro-batch {args.micro_batch}{', packed' if args.packed else ''})"
    )
    for r in results:
        status = "eager: nothing to compile" if r.kernel == "eager" else ("compiled" if r.compiled else "from cache")
        print(
            f"  {r.layer:28s} {r.op:24s} {r.kernel:18s} self-test {r.ready_s:7.2f} s, first call {r.first_s:7.2f} s, "
            f"then {r.second_s:.3f} s  ({status})"
        )
    print("compile caches (keep these in the image):")
    for what, variable, path in cache_locations():
        print(f"  {variable}={path}   # {what}")
    print("Dockerfile:\n" + dockerfile_hint(args.source, args.seq_len, args.micro_batch))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _model_types() -> list[str]:
    from fusepatch.tools.tiny import FAMILIES

    return sorted(FAMILIES)


def main(argv: list[str] | None = None) -> int:
    from fusepatch.base.release import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="show fusepatch's log as it works")
    common.add_argument("--wide", action="store_true", help=f"do not wrap lines at {WIDTH} columns")
    parser = argparse.ArgumentParser(
        prog="python -m fusepatch", description="Fused kernels for Qwen fine-tuning.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"fusepatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", parents=[common], help="what this machine can run, what falls back, the fix")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any op would fall back to eager, a FUSEPATCH_* value is bad, or FUSEPATCH_DISABLE is on",
    )
    doctor.add_argument("--model-type", action="append", help="only the rows of this model_type (repeatable)")
    doctor.add_argument("--prefer", help="kernel source priority, e.g. pip,hub")
    doctor.add_argument(
        "--static",
        action="store_true",
        help="version, device and dtype checks only: no kernel is loaded or self-tested (seconds, not minutes)",
    )
    doctor.add_argument(
        "--all",
        action="store_true",
        help="self-test every candidate, not only up to the one apply would choose (backups compile too: slower)",
    )
    doctor.set_defaults(func=_doctor)

    listing = sub.add_parser("list", parents=[common], help="the registry: layer class -> ops -> candidates")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--model-type", action="append")
    listing.set_defaults(func=_list)

    demo = sub.add_parser("demo", parents=[common], help="tiny Qwen3.5, a few training steps eager vs patched")
    demo.add_argument("--model-type", default="qwen3_5_text", choices=_model_types())
    demo.add_argument("--steps", type=_positive, default=5)
    demo.add_argument("--seq-len", type=_positive, default=128)
    demo.add_argument("--device", default=None, choices=["cpu", "cuda"])
    demo.add_argument("--precision", default=None, choices=["fp8"], help="train the projections in FP8 (docs/fp8.md)")
    demo.set_defaults(func=_demo)

    build = sub.add_parser("build", parents=[common], help="build a kernel package for this GPU, cache, install it")
    build.add_argument("package", help="e.g. causal-conv1d")
    build.add_argument("--sdist", help="the package's .tar.gz (default: the cache's sdist folder)")
    build.add_argument("--arch", help="GPU architecture, e.g. 9.0 (default: the visible GPU's)")
    build.add_argument("--jobs", type=_positive, default=None, help="parallel compile jobs (MAX_JOBS)")
    build.add_argument(
        "--cache-dir",
        default=None,
        help="wheel cache (default: $FUSEPATCH_CACHE, else $XDG_CACHE_HOME/fusepatch or ~/.cache/fusepatch)",
    )
    build.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    build.add_argument("--no-install", action="store_true", help="build and cache the wheel only")
    build.set_defaults(func=_build)

    warm = sub.add_parser("warmup", parents=[common], help="compile the fused kernels for a model's shapes ahead")
    warm.add_argument("source", help="a model_type (qwen3_5_text) or a local config path")
    warm.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    warm.add_argument("--seq-len", type=_positive, default=4096)
    warm.add_argument("--micro-batch", type=_positive, default=1)
    warm.add_argument("--packed", action="store_true", help="also the packed (varlen) kernel variants")
    warm.add_argument(
        "--device", default=None, choices=["cpu", "cuda"], help="cuda (the default); cpu has nothing to warm: refused"
    )
    warm.set_defaults(func=_warmup)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("fusepatch").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except (MissingDependency, CommandError) as exc:  # one line with the fix, not a traceback
        print(f"python -m fusepatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
