"""transformers' module-level names that patched layers hold (``layers/support/bindings.py``): those a collected
model left bound go back before each plan, and a reverted module holds none."""

from __future__ import annotations

import torch

from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.plan import Plan, Request
from fusepatch.layers.support import bindings


class Bindings(Feature):
    name = "bindings"

    def plan(self, plan: Plan, request: Request) -> Plan:
        bindings.sweep()  # names a model collected during a torch.compile left bound go back first
        return plan

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        for module, _ in patched:  # transformers' module-level names back once no patched layer holds them
            bindings.release(module)


FEATURE = Bindings()
