"""The hooks a feature of ``apply`` implements (``engine/features/__init__.py`` says what each is for)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusepatch.base.row import Row
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.reporting import PatchReport
from fusepatch.engine.resolve import Choice

Patched = list[tuple[torch.nn.Module, Any]]  # (module, its PatchState)


class Feature:
    """A feature of ``apply`` that is not kernel choice; every hook does nothing unless the feature overrides it."""

    name: str = ""
    slots: Mapping[str, Any] = {}
    under: Mapping[str, tuple[str, ...]] = {}

    def plan(self, plan: Plan, request: Request) -> Plan:
        return plan

    def owners(self, found: dict[Row, list[torch.nn.Module]]) -> dict[Row, tuple[Choice, ...]]:
        return {}

    def bind(self, plan: Plan, request: Request, patched: Patched) -> str:
        return ""

    def kept(self, plan: Plan, request: Request, states: list) -> list[str]:
        return []

    def finish(self, plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
        return None

    def report(self, report: PatchReport, states: list) -> PatchReport:
        return report

    def revert(self, model: torch.nn.Module, patched: Patched) -> None:
        return None

    def setstate(self, state: Any) -> None:
        return None

    runs: Callable[[torch.nn.Module, tuple, dict], Callable | None] | None = None
