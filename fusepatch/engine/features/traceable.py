"""torch.compile over a patched model: dynamo traces a patched forward only where ``apply`` found that no op runs
a fused kernel, on a device type where the tests check the traced path (``TRACED_DEVICES``); any other call runs
outside dynamo, as it runs uncompiled, said once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusepatch.base.log import logger
from fusepatch.base.state import current as process_state
from fusepatch.engine.features.base import Feature
from fusepatch.engine.plan import Plan, Request, Resolved
from fusepatch.engine.reporting import PatchReport

OUTSIDE_DYNAMO = (
    "fusepatch: torch.compile: the patched model runs outside dynamo, on its fused kernels; the rest compiles "
    "as usual. Its kernels are not traceable ops yet: every call of one would split the graph, and a step compiled "
    "around them is slower than the uncompiled patched step"
)
UNCHECKED_TRACE = (
    "fusepatch: torch.compile: the patched model runs outside dynamo on {device}, eagerly as it runs uncompiled; "
    "the rest compiles as usual. On a GPU, inductor compiles transformers' Qwen3.5 rotary embedding to wrong "
    "cos/sin tables (transformers' own Qwen3.5 compiled gives logits far outside the bf16 bound). Patched "
    "forwards are traced only on the CPU, where the tests check the trace"
)
# the device types on which dynamo may trace a patched forward without fused kernels: those where the tests
# compare the traced model with the uncompiled one and it matches (on a GPU, everything but the Qwen3.5 rotary
# embedding matched when traced)
TRACED_DEVICES = ("cpu",)


def traceable(state: Any, args: tuple, kwargs: dict) -> bool:
    """Whether dynamo may trace this call of a patched forward: only on the device type where ``apply`` found
    that no op runs a fused kernel. A model patched on the CPU and moved to a GPU afterwards chooses its kernels
    at its first call there, so a call on another device type is kept outside too. (Traced through the fused
    kernels or not, a Qwen3.5 mini model gave wrong logits on a GPU, from inductor's compile of transformers'
    rotary embedding: the GPU tests keep that checked.)"""
    if state.traceable_on is None:
        return False
    device = next((v.device.type for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return device is None or device == state.traceable_on


@torch.compiler.disable
def outside_dynamo(function: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """A patched forward that torch.compile reached, run as it runs uncompiled; said once per process, with the
    reason that holds for this model: its fused kernels, or a device where the traced path is not checked."""
    if process_state().said.first("patched forward outside dynamo"):
        untraced = module._fusepatch.untraced_on
        logger.warning(UNCHECKED_TRACE.format(device=untraced) if untraced else OUTSIDE_DYNAMO)
    return function(module, *args, **kwargs)


class Traceable(Feature):
    name = "traceable"
    # the device type on which torch.compile may trace the forward, set where no op runs a fused kernel (None: it
    # always runs outside dynamo); and the one apply found without fused kernels where dynamo still may not trace
    slots = {"traceable_on": None, "untraced_on": None}

    def finish(self, plan: Plan, resolved: Resolved, report: PatchReport, request: Request, newly: int) -> None:
        # dynamo traces the patched forwards only where no op runs a kernel it cannot trace (on meta: chosen
        # later), on a device type where the traced path is checked
        eager_on = None if report.fused_ops or plan.on_meta else report.device
        traceable_on = eager_on if eager_on in TRACED_DEVICES else None
        for modules in plan.found.values():
            for module in modules:
                state = module.__dict__.get("_fusepatch")  # a trainer-owned head or a row without a forward: none
                if state is not None:
                    state.traceable_on = traceable_on
                    state.untraced_on = eager_on if traceable_on is None else None

    def runs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Callable | None:
        if torch.compiler.is_compiling() and not traceable(module._fusepatch, args, kwargs):
            return outside_dynamo
        return None


FEATURE = Traceable()
