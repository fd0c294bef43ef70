"""A forward set on a module's instance before ``apply``: composed with where fusepatch can, else left running.

accelerate's hook (``add_hook_to_module``: ``device_map``, offload) calls whatever ``module._old_forward`` holds, so
the fused forward goes there and the hook still runs around it. A module's own forward bound to it (what
``remove_hook_from_module`` leaves) is its class's forward: patched as usual. accelerate's mixed-precision wrapper
(``Accelerator.prepare``) calls the class's forward function itself: the fused forward replaces it, as before, and
says so (``FusePatchCallback`` puts the Trainer's autocast back around it). Any other instance forward (a user's
wrapper, ``torch.compile`` of the bound forward, transformers' debugging wrappers) calls the forward it closed over,
which fusepatch cannot reach: that module is not patched and keeps running it, said at WARNING with the fix.
``revert`` puts back what the fused forward took the place of, wherever it sits then (accelerate moves it to
``forward`` when its hook is removed, and to ``_old_forward`` when a hook is added after ``apply``).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from fusepatch.backends import accelerate
from fusepatch.base.log import logger

FIX = "fix: set that forward after fusepatch.apply (it then wraps the fused forward), or do without it"


def _named(forward: Any) -> str:
    """A forward's name without its address, so that modules wrapped alike are listed together."""
    return (
        getattr(forward, "__qualname__", None)
        or getattr(getattr(forward, "func", None), "__qualname__", None)
        or type(forward).__name__
    )


def refusal(module: torch.nn.Module) -> str | None:
    """Why a module a row matched is left as it is for a forward set on its instance; None: patch it."""
    forward = module.__dict__.get("forward")
    if forward is None or "_fusepatch" in module.__dict__:
        return None
    if accelerate.own_forward(module, forward) or accelerate.mixed_precision(module):
        return None
    if accelerate.hooked(module):
        inner = module.__dict__[accelerate.HOOKED_FORWARD]
        if accelerate.own_forward(module, inner):
            return None
        return (
            f"accelerate's hook (add_hook_to_module) wraps a forward set on the instance before it ({_named(inner)}), "
            f"which fusepatch cannot run its fused forward inside; {FIX}"
        )
    hint = ""
    if accelerate.HOOK in module.__dict__:
        hint = f" (an accelerate hook not as accelerate {', '.join(accelerate.NAMES.checked)} sets it)"
    return (
        f"a forward set on the instance before apply ({_named(forward)}{hint}) calls the forward it holds, which "
        f"fusepatch cannot replace; {FIX}"
    )


def bind(module: torch.nn.Module, fused: Any, unset: Any) -> Any:
    """Put the fused forward in its seat: accelerate's ``_old_forward`` under its hook, else ``forward``; returns
    what the seat held (``unset``: nothing). In place of accelerate's mixed-precision wrapper it is also the forward
    the wrapper kept, so that ``unwrap_model(model, keep_fp32_wrapper=False)``, which puts that one back where it
    finds it as the forward, keeps the fused one."""
    name = accelerate.HOOKED_FORWARD if accelerate.hooked(module) else "forward"
    replacing_wrapper = name == "forward" and accelerate.mixed_precision(module)
    if replacing_wrapper:
        logger.info(
            "fusepatch: %s: the fused forward replaces accelerate's mixed-precision wrapper (Accelerator.prepare), "
            "so its calls run in autocast only where the caller sets one (FusePatchCallback does); revert restores "
            "the wrapper; fix: call fusepatch.apply before accelerator.prepare",
            type(module).__name__,
        )
    held = module.__dict__.get(name, unset)
    setattr(module, name, fused)
    if replacing_wrapper:
        setattr(module, accelerate.MIXED_PRECISION_ORIGINAL, fused)
    return held


def put_back(module: torch.nn.Module, before: Any, fused: type, unset: Any) -> None:
    """Put ``before`` (``unset``: none was on the instance) where the fused forward (an instance of ``fused``) sits:
    the instance's ``forward``, else accelerate's ``_old_forward``. Where neither holds it, another hand replaced
    ``forward`` after ``apply`` (a wrapper of it, such as ``Accelerator.prepare``'s): ``forward`` gets ``before``, as
    ``revert`` always did, said at WARNING since the wrapper goes with it (its autocast, for accelerate's). A
    mixed-precision wrapper gets its own forward back; one taken off after ``apply`` (``unwrap_model``) stays off."""

    state = module.__dict__.get("_fusepatch")  # the module's PatchState: revert drops it after this
    row_forward = None if state is None else state.row.forward

    def ours(value: Any) -> bool:
        if isinstance(value, fused):
            return value.__self__ is module
        # the fused function bound to the module as a plain method: what accelerate's unwrap_model leaves of a
        # mixed-precision wrapper set after apply (it follows the wrapper's __wrapped__ links to the function)
        return isinstance(value, types.MethodType) and value.__self__ is module and value.__func__ is row_forward

    own = types.MethodType(type(module).forward, module)
    if ours(module.__dict__.get(accelerate.MIXED_PRECISION_ORIGINAL)):
        setattr(module, accelerate.MIXED_PRECISION_ORIGINAL, own)
    elif accelerate.wraps_own_forward(module, before) and accelerate.MIXED_PRECISION_ORIGINAL not in module.__dict__:
        before = unset  # the wrapper was taken off while patched: the model's own forward, as unwrapping leaves it
    current = module.__dict__.get("forward")
    if not ours(current) and ours(module.__dict__.get(accelerate.HOOKED_FORWARD)):
        setattr(module, accelerate.HOOKED_FORWARD, own if before is unset else before)
        return
    if current is not None and not ours(current) and current is not before:
        logger.warning(
            "fusepatch: revert: %s's forward was set after apply (%s, e.g. Accelerator.prepare's mixed-precision "
            "wrapper), so it may call the fused forward; it is removed with it, and the module runs %s without it; "
            "fix: revert before setting that forward (call accelerator.prepare after fusepatch.revert)",
            type(module).__name__,
            _named(current),
            "its own forward" if before is unset else f"the forward it had before apply ({_named(before)})",
        )
    if before is unset:
        module.__dict__.pop("forward", None)
    else:
        module.forward = before
