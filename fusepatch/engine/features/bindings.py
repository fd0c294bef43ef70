"""Foreign module-level names that rows declare (``Row.bindings``, ``layers/support/bindings.py``): installed for
every module a call patches or finds patched, and for a copy of one; released by ``revert``. Those that only
models collected without ``revert`` held go back before each plan."""

from __future__ import annotations

import torch

from fusepatch.engine.features.base import Feature, Patched
from fusepatch.engine.plan import Plan, Request
from fusepatch.layers.support import bindings


class Bindings(Feature):
    name = "bindings"

    def plan(self, plan: Plan, request: Request) -> Plan:
        bindings.sweep()  # names held only by models collected without revert go back first
        return plan

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        for row, modules in plan.found.items():
            for module in modules:
                if "_fusepatch" in module.__dict__:  # patched now or before (a trainer's head is left unpatched)
                    bindings.install(row.bindings, module)
        return ""

    def setstate(self, state) -> None:
        bindings.install(state.row.bindings, state.owner)  # a copy holds the names it runs with

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        for module, _ in patched:  # transformers' module-level names back once no patched layer holds them
            bindings.release(module)
        bindings.sweep()  # and those only models collected without revert held, whatever this model held


FEATURE = Bindings()
