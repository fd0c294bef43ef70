"""What this machine can run: every candidate of every op, ok or rejected with the reason and the fix."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time

from fusepatch import backends
from fusepatch.base import options
from fusepatch.base.env import Environment, capture
from fusepatch.base.known_issues import KNOWN_ISSUES
from fusepatch.base.op import Op
from fusepatch.base.release import __version__
from fusepatch.base.versions import SUPPORT, version_in
from fusepatch.engine.features import FEATURES
from fusepatch.engine.registry import all_ops, all_rows
from fusepatch.engine.resolve import PREFERABLE, candidate_names, evaluate, first_verdict, ordered, preferred_sources
from fusepatch.engine.selftest import COMPILED_S

logger = logging.getLogger("fusepatch")

# The versions fusepatch's GPU tests and benchmarks ran with: what doctor pins (base/versions.py's table).
TESTED_VERSIONS = {name: entry.pin for name, entry in SUPPORT.items() if entry.pin}


def recommendations(env: Environment) -> list[str]:
    """What to install at container build time for this machine, pinned to the versions fusepatch was run with."""
    if not env.cuda_available or not env.gpus:
        return ["no CUDA GPU here: fusepatch runs eager on this machine; install the kernels on the GPU machines"]
    out = []
    fla = env.version("fla-core")
    if fla is None or env.import_error("fla.ops.gated_delta_rule"):
        out.append(f'pip install "flash-linear-attention[cuda]=={TESTED_VERSIONS["flash-linear-attention"]}"')
    if env.version("causal-conv1d") is None or env.import_error("causal_conv1d"):
        out.append(
            f"python -m fusepatch build causal-conv1d --sdist causal_conv1d-{TESTED_VERSIONS['causal-conv1d']}.tar.gz"
            "   # for this GPU only"
        )
    probed = env.with_imports(["tilelang"]) if env.version("tilelang") else env
    if any(issue.unless_importable == "tilelang" and issue.matches(probed) for issue in KNOWN_ISSUES) or (
        fla is None and env.capability and env.capability[0] == 9 and env.triton and version_in(env.triton, "<3.7.1")
    ):
        out.append(f"pip install tilelang=={TESTED_VERSIONS['tilelang']}   # fla's Hopper backward on Triton < 3.7.1")
    if env.triton is None:
        out.append("pip install triton   # fla's kernels are Triton kernels (torch's CUDA wheels bring it)")
    out.append(
        "python -m fusepatch warmup <model_type or config> --seq-len <L> --micro-batch <B>   # fill the compile caches"
    )
    return out


def _target(env: Environment) -> tuple[str, str]:
    return ("cuda", "bfloat16") if env.cuda_available and env.gpus else ("cpu", "float32")


def examine_op(
    op: Op,
    env: Environment,
    device: str,
    dtype: str,
    prefer: tuple[str, ...],
    static_only: bool = False,
    every: bool = False,
) -> dict:
    """Every candidate's verdict for ``device``/``dtype``: self-tests run where the checks pass (a first run
    compiles and autotunes, minutes on a fresh GPU machine, so each is logged as it finishes), or, with
    ``static_only``, the version/device/dtype checks alone, without loading anything.

    Self-tests stop at the candidate ``apply`` would choose (the first that passes); the ones after it get the
    checks only, unless ``every``: on the H200 a cold doctor spent minutes autotuning backup kernels (fla's
    SwiGLU after fusepatch's) that no model would run."""
    candidates = []
    chosen = None
    for candidate in ordered(op, prefer):
        started = time.perf_counter()
        static, env = first_verdict(op, candidate, env)
        checks_only = static_only or (chosen is not None and not every)
        verdict, _ = evaluate(op, candidate, static, device, dtype, checks_only=checks_only)
        seconds = time.perf_counter() - started
        status = "ok" if verdict.ok else "rejected"
        if verdict.ok and checks_only and not static_only:
            status = "passes the checks (not self-tested: an earlier candidate is chosen)"
        logger.info("doctor: %s/%s %s (%.1f s)", op.name, candidate.name, status, seconds)
        candidates.append(
            {
                "name": candidate.name,
                "source": candidate.source,
                "provides": candidate.provides,
                "ok": verdict.ok,
                "reason": verdict.reason,
                "fix": verdict.fix,
                # each failed check's reason and fix: render() says a reason most candidates share once
                "parts": [list(p) for p in (verdict.parts or ((verdict.reason, verdict.fix),))]
                if not verdict.ok
                else [],
                "checked": "static" if checks_only or not static.ok else "self-test",
                "seconds": round(seconds, 2),
            }
        )
        if verdict.ok and chosen is None:
            chosen = candidate.name
    candidates.append(
        {
            "name": "eager",
            "source": "eager",
            "provides": op.reference.__qualname__,
            "ok": True,
            "reason": "",
            "fix": "",
            "checked": "reference",
            "seconds": 0.0,
        }
    )
    return {"summary": op.summary, "chosen": chosen or "eager", "candidates": candidates}


def variables() -> dict:
    """The ``FUSEPATCH_*`` variables as ``apply`` reads them: those set, each bad value with the values it takes
    (``apply`` raises for it and patches nothing), the retired ones, and whether ``FUSEPATCH_DISABLE`` is on."""
    problems = options.environment_problems(candidate_names(), PREFERABLE)
    return {
        "set": options.given(),
        "problems": problems,
        "retired": {name: instead for name, instead in options.RETIRED.items() if os.environ.get(name)},
        "disabled": "FUSEPATCH_DISABLE" not in problems and options.switch("FUSEPATCH_DISABLE"),
    }


# What a launcher sets for each process (torchrun, accelerate launch, deepspeed): shown where set
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENGINE_PACKAGES = ("accelerate", "deepspeed")

# What fusepatch does under each engine, the reason with each difference: the engine's own lines here (the compute
# dtype read from FSDP2's MixedPrecisionPolicy), then each feature's (``Feature.under``: the CUDA graphs' rules,
# where a frozen projection's prepared copy lives)
UNDER_ENGINES = {
    "fsdp2": (
        "patch before or after fully_shard (accelerate's FSDP2 plugin, the Trainer's fsdp arguments, torchrun); the "
        "module tree and instance forwards are what FSDP2's hooks see",
        "kernels are chosen and self-tested for the MixedPrecisionPolicy's param_dtype (the compute dtype), not the "
        "fp32 shards' dtype",
    ),
    "deepspeed": (),
}


def under_engines() -> dict[str, list[str]]:
    """Per engine, what fusepatch does under it: its own lines, then every feature's."""
    return {
        engine: [*lines, *(line for feature in FEATURES for line in feature.under.get(engine, ()))]
        for engine, lines in UNDER_ENGINES.items()
    }


def distributed(environ: dict | None = None) -> dict:
    """What multi-process training runs on here: torch.distributed and its backends, the launcher's variables of
    this process (where set), FSDP2's ``fully_shard``, the engines' packages, and what fusepatch does under each."""
    from importlib import metadata

    environ = os.environ if environ is None else environ
    info: dict = {"available": False, "backends": {}, "fully_shard": None}
    try:
        import torch.distributed as dist
    except ImportError as exc:  # a torch build without distributed
        info["reason"] = str(exc)
        dist = None
    if dist is not None and dist.is_available():
        info["available"] = True
        info["backends"] = {
            "nccl": dist.is_nccl_available(),
            "gloo": dist.is_gloo_available(),
            "mpi": dist.is_mpi_available(),
        }
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401

            info["fully_shard"] = "torch.distributed.fsdp.fully_shard"
        except ImportError as exc:
            info["fully_shard_missing"] = f"{exc}; fix: pip install 'torch>=2.6' (FSDP2's fully_shard)"
    info["launch"] = {name: environ[name] for name in LAUNCH_VARIABLES if name in environ}
    packages = {}
    for name in ENGINE_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    info["packages"] = packages
    info["under"] = under_engines()
    return info


def distributed_lines(info: dict | None) -> list[str]:
    """The report's distributed section; a blank line after."""
    if info is None:
        return []
    lines = ["Distributed"]
    if not info["available"]:
        lines.append(
            f"  torch.distributed: not available in this torch build ({info.get('reason', 'is_available() is False')})"
        )
    else:
        backends = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in info["backends"].items())
        lines.append(f"  torch.distributed: available; backends: {backends}")
        lines.append(f"  FSDP2: {info['fully_shard'] or info.get('fully_shard_missing')}")
    launch = info["launch"]
    lines.append(
        "  this process: " + (" ".join(f"{k}={v}" for k, v in launch.items()) if launch else "not launched as a rank")
    )
    packages = ", ".join(f"{name} {version or 'not installed'}" for name, version in info["packages"].items())
    lines.append(f"  engines' packages: {packages}")
    for engine, said in info["under"].items():
        lines.append(f"  under {'FSDP2' if engine == 'fsdp2' else 'DeepSpeed ZeRO-3'}:")
        lines += [f"    - {line}" for line in said]
    return [*lines, ""]


@contextlib.contextmanager
def _unset(names):
    """The variables ``names`` unset for the diagnosis, then back: a bad value makes ``apply`` raise, and the ops
    are checked as they would run once it is fixed (the report says so)."""
    kept = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(kept)


def diagnose(
    *,
    model_types: list[str] | None = None,
    prefer: tuple[str, ...] | None = None,
    static_only: bool = False,
    every: bool = False,
) -> dict:
    """The doctor report as a JSON-serialisable dict."""
    found = variables()
    with _unset(found["problems"]):
        report = _diagnose(model_types, prefer, static_only, every)
    return {**report, "variables": found, "distributed": distributed()}


def _diagnose(model_types: list[str] | None, prefer: tuple[str, ...] | None, static_only: bool, every: bool) -> dict:
    env = capture()
    prefer = preferred_sources(prefer)
    device, dtype = _target(env)
    rows = [r for r in all_rows() if not model_types or set(r.model_types) & set(model_types)]
    if model_types and not rows:
        known = sorted({t for r in all_rows() for t in r.model_types})
        raise ValueError(f"no fusepatch rows for model_type {model_types}; known: {', '.join(known)}")
    table = all_ops()
    op_names = [name for name in table if any(name in r.ops for r in rows)]
    ops = {name: examine_op(table[name], env, device, dtype, prefer, static_only, every) for name in op_names}
    families: dict[str, dict] = {}
    fallbacks: list[str] = []
    fixes: list[str] = []
    for row in rows:
        for model_type in row.model_types:
            layer = families.setdefault(model_type, {}).setdefault(row.layer, {})
            for name in row.ops:
                layer[name] = {
                    "kernel": ops[name]["chosen"],
                    "status": "fused" if ops[name]["chosen"] != "eager" else "fallback",
                }
    for name in sorted({n for r in rows for n in r.ops}):
        if ops[name]["chosen"] == "eager":
            wired = [c for c in ops[name]["candidates"] if c["source"] != "eager"]
            reasons = "; ".join(f"{c['name']}: {c['reason']}" for c in wired)
            fallbacks.append(f"{name} -> eager ({reasons})")
            for c in wired:
                if c["fix"] and c["fix"] not in fixes:
                    fixes.append(c["fix"])
    probed = env.with_imports([i.unless_importable for i in KNOWN_ISSUES if i.unless_importable])
    matching = [issue for issue in KNOWN_ISSUES if issue.matches(probed)]
    return {
        "fusepatch": __version__,
        "target": {"device": device, "dtype": dtype},
        "self_tests": not static_only,
        "self_tested": "none" if static_only else ("every candidate" if every else "up to the one chosen"),
        "environment": probed.to_dict(),
        "known_issues": [dict(issue.to_dict(), affects_this_machine=issue in matching) for issue in KNOWN_ISSUES],
        "ops": ops,
        "families": families,
        "fallbacks": fallbacks,
        "fixes": fixes,
        "recommended": recommendations(probed),
        # imported beyond --static, where importing them is harmless (some need a GPU: each table says)
        "private_names": [t.to_dict(probe=not static_only, gpu=device == "cuda") for t in backends.tables()],
        "drift": list(backends.drifted()),
    }


SHARED = 5  # a reason at least this many candidates give is listed once, above the ops

DISABLED = (
    "FUSEPATCH_DISABLE is on: fusepatch.apply patches nothing, and every model runs as transformers ships it "
    "(the ops below are what apply would choose without it); fix: unset FUSEPATCH_DISABLE"
)


def variable_lines(found: dict | None) -> list[str]:
    """The report's ``FUSEPATCH_*`` section: each variable set, ok or the values it takes; a blank line after."""
    if found is None:
        return []
    lines = ["FUSEPATCH_* variables"]
    if found["disabled"]:
        lines.append(f"  {DISABLED}")
    if found["problems"]:
        lines.append(
            f"  fusepatch.apply raises ValueError for {len(found['problems'])} of them and patches nothing; the ops "
            "below are checked as if they were unset"
        )
    for name, value in found["set"].items():
        if name in found["problems"]:
            lines.append(f"  BAD {found['problems'][name]}")
        elif name in found["retired"]:
            lines.append(f"  {name}={value!r}: no longer read: {found['retired'][name]}; fix: unset it")
        else:
            lines.append(f"  ok  {name}={value!r}")
    if not found["set"]:
        lines.append("  none set")
    return [*lines, ""]


def render(report: dict) -> str:
    env = report["environment"]
    gpus = ", ".join(f"{g['name']} ({g['arch']})" for g in env["gpus"]) or "none"
    lines = [
        f"fusepatch {report['fusepatch']} doctor",
        "",
        "Environment",
        f"  python {env['python']}  torch {env['torch']} (CUDA {env['torch_cuda'] or 'none: CPU build'})",
        f"  GPU: {gpus}",
        f"  triton {env['triton'] or '-'}  transformers {env['transformers'] or '-'}",
        "  packages: " + (", ".join(f"{k} {v}" for k, v in sorted(env["distributions"].items())) or "-"),
        f"  checked for: {report['target']['device']}/{report['target']['dtype']}"
        + ("" if report.get("self_tests", True) else " (--static: checks only; no kernel loaded or self-tested)"),
        "",
        *variable_lines(report.get("variables")),
        *distributed_lines(report.get("distributed")),
        "Known-bad stacks",
    ]
    for issue in report["known_issues"]:
        mark = "AFFECTS THIS MACHINE" if issue["affects_this_machine"] else "not this machine"
        major = issue["capability_major"]
        lines.append(
            f"  [{mark}] {issue['package']} {issue['package_spec']} + triton {issue['triton_spec'] or 'any'} on "
            f"{f'sm_{major}x' if major is not None else 'any GPU'}: "
            f"{issue['what']} ({issue['link']}); fix: {issue['fix']}"
        )
    lines += ["", "Private names of foreign packages (backends/)"]
    for table in report.get("private_names", []):
        count = sum(len(a) or 1 for a in table["names"].values())
        checked = ", ".join(table["checked"])
        if table["installed"] is None:
            lines.append(f"  {table['distribution']}: not installed ({count} names, checked on {checked})")
            continue
        state = "a checked version" if table["checked_here"] else f"NOT a checked version ({checked})"
        missing = table.get("missing")
        if missing is None:
            names = f"not probed ({table.get('not_probed') or 'not asked'})"
        else:
            names = "all present" if not missing else f"MISSING {missing}"
            skipped = table.get("skipped") or {}
            names += "".join(f"; {module} not probed: {why}" for module, why in skipped.items())
        lines.append(f"  {table['distribution']} {table['installed']}: {state}; {count} names: {names}")
    for line in report.get("drift", []):
        lines.append(f"  drift: {line}")
    counts = collections.Counter(
        tuple(part) for op in report["ops"].values() for c in op["candidates"] for part in c.get("parts", [])
    )
    shared = [part for part, n in counts.items() if n >= SHARED]  # a machine-wide reason (no GPU): said once
    if shared:
        lines += ["", "Reasons most candidates share (said once here, [shared N] below)"]
        for i, (reason, fix) in enumerate(shared, 1):
            lines.append(f"  [shared {i}] {reason}" + (f"; fix: {fix}" if fix else ""))
    lines += ["", "Ops (candidates in priority order)"]
    for name, op in report["ops"].items():
        lines.append(f"  {name}: {op['chosen']}   -- {op['summary']}")
        for c in op["candidates"]:
            if c["source"] == "eager":
                continue
            status = "ok" if c["ok"] else "rejected"
            detail = ""
            if not c["ok"]:
                parts = [tuple(p) for p in c.get("parts") or [(c["reason"], c["fix"])]]
                own = [p for p in parts if p not in shared]
                marks = [f"[shared {shared.index(p) + 1}]" for p in parts if p in shared]
                fixes = " && ".join(dict.fromkeys(f for _, f in own if f))
                detail = ": " + "; ".join([r for r, _ in own] + marks) + (f"  [fix: {fixes}]" if fixes else "")
            if c["ok"] and c.get("checked") == "static" and report.get("self_tests", True):
                status, detail = (
                    "checks",
                    ": passes the checks; not self-tested (a candidate before it is chosen; --all)",
                )
            slow = c.get("checked") == "self-test" and c["seconds"] >= COMPILED_S
            took = f" [self-test {c['seconds']:.0f} s]" if slow else ""
            lines.append(f"    {status:8s} {c['name']} ({c['source']}){took}{detail}")
    lines += ["", "Families"]
    for model_type, layers in report["families"].items():
        parts = []
        for layer, ops in layers.items():
            for name, info in ops.items():
                parts.append(f"{layer}.{name}={info['kernel']}")
        lines.append(f"  {model_type}: " + ", ".join(parts))
    lines += ["", "Would fall back"]
    fixes: list[str] = []
    for name, op in report["ops"].items():
        if op["chosen"] != "eager" or not any(name in ops for layers in report["families"].values() for ops in
                                             layers.values()):  # fmt: skip
            continue
        reasons: list[str] = []
        for c in op["candidates"]:
            if c["source"] == "eager":
                continue
            for part in map(tuple, c.get("parts") or [(c["reason"], c["fix"])]):
                label = f"[shared {shared.index(part) + 1}]" if part in shared else part[0]
                reasons += [label] if label not in reasons else []
                fixes += [f for f in part[1].split(" && ") if f and f not in fixes]
        lines.append(f"  {name}: " + "; ".join(reasons))
    if report.get("variables", {}).get("disabled"):
        lines.append("  every op: FUSEPATCH_DISABLE is on, so apply patches nothing")
    if len(lines) and lines[-1] == "Would fall back":
        lines.append("  nothing")
    if fixes:
        lines += ["", "Fix"] + [f"  {f}" for f in fixes]
    lines += ["", "Recommended at container build time (pinned to the versions fusepatch was run with)"]
    lines += [f"  {r}" for r in report["recommended"]]
    return "\n".join(lines)
