"""What an ``apply`` call says beyond its table: what a model patched before keeps from the call that patched it,
an ``ops``/``exclude`` that leaves nothing to fuse, the report's message, and ``strict=True``'s error."""

from __future__ import annotations

import torch

from fusepatch.engine.plan import Plan, Request
from fusepatch.engine.reporting import PatchReport
from fusepatch.layers import layer_graphs
from fusepatch.layers.simple import swiglu_mlp_forward


def choices_of(request: Request) -> tuple:
    """What of a request chooses kernels: ``ops``, ``exclude``, ``prefer`` (kept on each module it patches)."""
    return (request.ops, request.exclude, request.prefer)


def kept(plan: Plan, request: Request) -> list[str]:
    """What modules patched before keep of the apply that patched them where ``request`` asks otherwise: a second
    apply patches only modules not patched yet, so their kernel choices, their FP8 rows and what those keep
    (``drop_frozen_weights``), the MLP recompute and the layers' CUDA graphs stay as they were."""
    wanted, choosing, names = choices_of(request), 0, set()
    fp8, dropping, recompute, graphed = 0, 0, [], False
    for module in plan.model.modules():
        state = module.__dict__.get("_fusepatch")
        graphed = graphed or layer_graphs.ATTRIBUTE in module.__dict__
        if state is None:
            continue
        if state.choosing and state.choosing != wanted:
            choosing += 1
            names.update(n for n, a, b in zip(("ops", "exclude", "prefer"), state.choosing, wanted) if a != b)
        if state.row.precision is not None and state.row.precision != request.precision:
            fp8 += 1
        elif state.row.precision is not None and state.drop_frozen != request.drop_frozen_weights:
            dropping += 1
        if state.row.forward is swiglu_mlp_forward and state.mlp_recompute != request.mlp_recompute:
            recompute.append(state.mlp_recompute)
    kept = []
    if choosing:
        kept.append(
            f"{choosing} modules were patched before with other kernel choices and keep them (this call's "
            f"{', '.join(sorted(names))} did not reach them)"
        )
    if fp8:
        kept.append(f"{fp8} FP8 projections keep their FP8 GEMMs (this call's precision={request.precision!r})")
    if dropping:
        kept.append(f"{dropping} FP8 projections keep drop_frozen_weights={not request.drop_frozen_weights}")
    if recompute:
        kept.append(f"{len(recompute)} MLPs keep FUSEPATCH_MLP_RECOMPUTE {'on' if recompute[0] else 'off'}")
    if graphed and not request.cuda_graphs:
        kept.append("the decoder layers keep their CUDA graphs (this call's cuda_graphs=False)")
    return kept


def nothing_selected(plan: Plan, request: Request) -> str:
    """Why ``ops``/``exclude`` leave none of the model's ops to fuse (``ops=[]``: an empty list selects none, where
    ``None`` selects every op), with the fix; empty when some op is selected."""
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
    return (
        f"nothing will be fused: {why}, so every patched layer runs transformers' arithmetic; fix: leave ops out "
        f"to fuse every op, or name the ops to fuse among this model's: {', '.join(offered)}"
    )


def outcome(plan: Plan, newly: int, already: int, kept: list[str], graphs: bool) -> str:
    """The report's message: the meta device's deferred choices; or, for a model patched before, what this call
    added and what it did not change."""
    if plan.on_meta:
        return (
            "the model is on the meta device: its layers are patched, and each op's kernel is chosen and "
            "self-tested at its first call on a real device (fusepatch.report(model) shows the choices then)"
        )
    if not already:
        return ""
    if not (newly or graphs or kept):
        return f"already patched ({already} modules); nothing changed"
    said = [] if newly else [f"already patched ({already} modules)"]
    said += ["cuda_graphs=True: the decoder layers are graphed from now on"] if graphs else []
    said += [f"kept from before: {'; '.join(kept)}"] if kept else []
    return "; ".join(said)


def graphed(model: torch.nn.Module) -> bool:
    return any(layer_graphs.ATTRIBUTE in module.__dict__ for module in model.modules())


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
