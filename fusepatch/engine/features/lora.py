"""peft's LoRA adapters fused into the projections' GEMMs (``layers/support/lora.py``): the plan counts those that
can be, in the dtype the layers compute in, and the report says why the others cannot."""

from __future__ import annotations

import dataclasses

from fusepatch.engine.features.base import Feature
from fusepatch.engine.plan import Plan, Request
from fusepatch.layers.support import lora


class Lora(Feature):
    name = "lora"

    def plan(self, plan: Plan, request: Request) -> Plan:
        adapters = lora.survey(plan.model, plan.compute, plan.cast)  # in the dtype the layers compute in
        return dataclasses.replace(plan, adapters=adapters if adapters["linears"] else {})


FEATURE = Lora()
