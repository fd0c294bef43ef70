"""``FUSEPATCH_MLP_RECOMPUTE=1``: the SwiGLU MLPs (``Row.role`` "mlp") recompute their product in the backward
(``layers/mlp_recompute.py``); the setting of the apply that patched an MLP stays with it."""

from __future__ import annotations

from fusepatch.base.log import logger
from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.reporting import PatchReport

SAID = (
    "fusepatch: FUSEPATCH_MLP_RECOMPUTE=1: the SwiGLU MLPs' down projections recompute their input in the "
    "backward instead of keeping it (less activation memory, one more SwiGLU kernel per MLP a step); one "
    "that cannot (a trained down projection under apply(precision=...), autocast or torch.compile) is said at its first training step"
)


class MlpRecompute(Feature):
    name = "mlp_recompute"
    slots = {"mlp_recompute": False}  # read by the MLP's forward at each call

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        for _, state in patched:
            state.mlp_recompute = request.mlp_recompute
        return ""

    def kept(self, plan: Plan, request: Request, states: list) -> list[str]:
        kept = [s.mlp_recompute for s in states if s.row.role == "mlp" and s.mlp_recompute != request.mlp_recompute]
        return [f"{len(kept)} MLPs keep FUSEPATCH_MLP_RECOMPUTE {'on' if kept[0] else 'off'}"] if kept else []

    def finish(self, plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
        if newly and request.mlp_recompute and any(row.role == "mlp" for row in resolved.dispatches):
            logger.info(SAID)


FEATURE = MlpRecompute()
