"""What an ``apply`` call says beyond its table: what a model patched before keeps from the call that patched it,
an ``ops``/``exclude`` that leaves nothing to fuse, the report's message, ``strict=True``'s error, and the log."""

from __future__ import annotations

from collections import defaultdict

import torch

from fusepatch.base.log import logger
from fusepatch.base.row import Row
from fusepatch.base.state import current as process_state
from fusepatch.engine.features import FEATURES
from fusepatch.engine.plan import Plan, Request
from fusepatch.engine.reporting import PatchReport

META_STRICT = (
    "fusepatch.apply(strict=True): the model is on the meta device, so no kernel can be self-tested; "
    "call apply after materialising it (model.to_empty(device=...) and loading the weights)"
)


def choices_of(request: Request) -> tuple:
    """What of a request chooses kernels: ``ops``, ``exclude``, ``prefer`` (kept on each module it patches)."""
    return (request.ops, request.exclude, request.prefer)


def kept(plan: Plan, request: Request) -> list[str]:
    """What modules patched before keep of the apply that patched them where ``request`` asks otherwise (said at
    WARNING with the fix): a second apply patches only modules not patched yet, so their kernel choices and what
    each feature set on them (``precision``'s rows and ``drop_frozen_weights``, the MLP recompute, the layers' CUDA
    graphs) stay as they were."""
    wanted, choosing, names = choices_of(request), 0, set()
    states = [state for module in plan.model.modules() if (state := module.__dict__.get("_fusepatch")) is not None]
    for state in states:
        if state.choosing and state.choosing != wanted:
            choosing += 1
            names.update(n for n, a, b in zip(("ops", "exclude", "prefer"), state.choosing, wanted) if a != b)
    kept = []
    if choosing:
        kept.append(
            f"{choosing} modules were patched before with other kernel choices and keep them (this call's "
            f"{', '.join(sorted(names))} did not reach them)"
        )
    kept += [line for feature in FEATURES for line in feature.kept(plan, request, states)]
    if kept:
        logger.warning(
            "fusepatch: %s was patched before, and this apply did not change what that one set: %s; fix: "
            "fusepatch.revert(model), then apply with the options wanted (dropped frozen weights come back rounded)",
            type(plan.model).__name__,
            "; ".join(kept),
        )
    return kept


def say_left(plan: Plan) -> None:
    """The modules a row matched but leaves as they are (``Row.fits``), by reason."""
    for why, paths in plan.left.items():
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        logger.warning("fusepatch: %d modules run as before: %s: %s", len(paths), why, shown)


def nothing_selected(plan: Plan, request: Request) -> str:
    """Why ``ops``/``exclude`` leave none of the model's ops to fuse (``ops=[]``: an empty list selects none, where
    ``None`` selects every op), with the fix, said at WARNING; empty when some op is selected."""
    offered = list(dict.fromkeys(op for row in plan.found if row not in plan.owners for op in row.ops))
    chosen = [op for op in offered if (request.ops is None or op in request.ops) and op not in request.exclude]
    if not offered or chosen:
        return ""
    if request.ops == ():
        why = "apply(ops=[]) selects no op (an empty list; ops=None, the default, selects every op)"
    else:
        given = {"ops": None if request.ops is None else list(request.ops), "exclude": list(request.exclude)}
        arguments = ", ".join(f"{name}={value!r}" for name, value in given.items() if value)
        why = f"apply({arguments}) leaves none of this model's ops"
    said = (
        f"nothing will be fused: {why}, so every patched layer runs transformers' arithmetic; fix: leave ops out "
        f"to fuse every op, or name the ops to fuse among this model's: {', '.join(offered)}"
    )
    logger.warning("fusepatch: %s", said)
    return said


def outcome(plan: Plan, newly: int, already: int, kept: list[str], news: list[str]) -> str:
    """The report's message: the meta device's deferred choices; or, for a model patched before, what this call
    added (``news``: what the features' ``bind`` said) and what it did not change."""
    if plan.on_meta:
        return (
            "the model is on the meta device: its layers are patched, and each op's kernel is chosen and "
            "self-tested at its first call on a real device (fusepatch.report(model) shows the choices then)"
        )
    if not already:
        return ""
    if not (newly or news or kept):
        return f"already patched ({already} modules); nothing changed"
    said = [] if newly else [f"already patched ({already} modules)"]
    said += news
    said += [f"kept from before: {'; '.join(kept)}"] if kept else []
    return "; ".join(said)


def strict_refusal(plan: Plan, pending: PatchReport) -> str:
    """``strict=True``'s error: every fallback; for a model patched before, that its patches stay (a second apply
    patches only what is new, so strict cannot take them back) and how to apply strictly."""
    before = sum("_fusepatch" in module.__dict__ for modules in plan.found.values() for module in modules)
    if not before:
        return "fusepatch.apply(strict=True): nothing patched; fallbacks:\n" + "\n".join(pending.log_lines())
    return (
        f"fusepatch.apply(strict=True): nothing patched by this call, and the {before} modules patched before keep "
        "their patches and their fallbacks (strict refuses what a call would patch); fix: fusepatch.revert(model), "
        "then fusepatch.apply(model, strict=True); fallbacks:\n" + "\n".join(pending.log_lines())
    )


def log(report: PatchReport, verbose: bool | None, *, said: bool) -> None:
    """The table (verbose), its totals (default) or nothing; each fallback reason once per process (``said``:
    this call patched something new, or chose nothing yet on meta); the LoRA lines."""
    if verbose:
        logger.info("%s", report)
    elif verbose is None:
        logger.info("%s", report.totals())
    if not said:
        return
    for reason, line in report.fallback_reasons():
        process_state().said.warn(reason, "%s", line)  # once per process: another model, or apply again, says no more
    lines = report.lora_lines()
    if lines:
        logger.info(lines[0])
        for line in lines[1:]:
            logger.warning(line)


def transformers_calls(groups: dict[Row, list[torch.nn.Module]]) -> tuple[str, ...]:
    """Per layer class and reason, how many calls its patched layers handed to transformers' forward."""
    lines = []
    for row, modules in groups.items():
        counts: dict[str, int] = defaultdict(int)
        for module in modules:
            for why, count in module._fusepatch.transformers_calls.items():
                counts[why] += count
        lines += [f"{row.layer}: {count} calls: {why}" for why, count in counts.items()]
    return tuple(lines)
