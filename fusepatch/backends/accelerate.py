"""accelerate's forward wrappers on a module's instance, which a patched module keeps running.

``accelerate.hooks.add_hook_to_module`` (what ``device_map``, ``dispatch_model``, ``cpu_offload`` and
``init_empty_weights`` loading put on modules) keeps the module's forward as ``module._old_forward``, the hook as
``module._hf_hook``, and sets ``module.forward`` to ``functools.partial(new_forward, module)``, where
``new_forward`` (a function defined inside ``add_hook_to_module``) runs ``_hf_hook.pre_forward``, then whatever
``module._old_forward`` holds at that call, then ``_hf_hook.post_forward``. A forward put in ``_old_forward`` thus
runs inside the hook (its device alignment, its offloaded weights loaded and freed), as transformers' own
``keep_accelerate_hooks`` (transformers/integrations/accelerate.py) puts a replaced forward there.
``remove_hook_from_module`` sets ``module.forward = module._old_forward`` and deletes ``_old_forward``.

``Accelerator.prepare_model`` with mixed precision keeps the model's forward as ``model._original_forward`` and sets
``model.forward`` to a wrapper (autocast, outputs to fp32) that calls the class's forward function itself, through
``__wrapped__`` links (what accelerate's ``extract_model_from_parallel`` follows to take it off).

accelerate is never imported here: what is read is the instance attributes and the wrapper's ``__module__`` and
``__name__``, as set by the versions in the table.
"""

from __future__ import annotations

import functools
import types

import torch

from fusepatch.base.private_names import PrivateNames

HOOK = "_hf_hook"  # the module's ModelHook
HOOKED_FORWARD = "_old_forward"  # what the hook's forward calls, read at each call
MIXED_PRECISION_ORIGINAL = "_original_forward"  # the model's forward before Accelerator.prepare wrapped it

NAMES = PrivateNames(
    distribution="accelerate",
    checked=("1.16.0",),
    # and the instance attributes _hf_hook, _old_forward and _original_forward, and new_forward's name and module
    names={"accelerate.hooks": ("add_hook_to_module", "remove_hook_from_module")},
    fix='pip install "accelerate>=1.16,<1.17"',
)


def hooked(module: torch.nn.Module) -> bool:
    """Whether ``module``'s instance forward is the one ``add_hook_to_module`` set, calling ``_old_forward``."""
    forward = module.__dict__.get("forward")
    return (
        isinstance(forward, functools.partial)
        and forward.args == (module,)
        and getattr(forward.func, "__module__", None) == "accelerate.hooks"
        and getattr(forward.func, "__name__", None) == "new_forward"
        and HOOK in module.__dict__
        and HOOKED_FORWARD in module.__dict__
    )


def own_forward(module: torch.nn.Module, forward: object) -> bool:
    """Whether ``forward`` is ``module``'s class forward bound to it (what ``add_hook_to_module`` keeps as
    ``_old_forward``, and ``remove_hook_from_module`` leaves as the instance's forward)."""
    return (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and forward.__func__ is type(module).forward
    )


def mixed_precision(module: torch.nn.Module) -> bool:
    """Whether ``module``'s instance forward is ``Accelerator.prepare``'s mixed-precision wrapper around the class's
    forward (its ``__wrapped__`` links reach that function, and the forward it wrapped is the module's own)."""
    if not own_forward(module, module.__dict__.get(MIXED_PRECISION_ORIGINAL)):
        return False
    return wraps_own_forward(module, module.__dict__.get("forward"))


def wraps_own_forward(module: torch.nn.Module, forward: object) -> bool:
    """Whether ``forward``'s ``__wrapped__`` links reach ``module``'s class forward (a decorator's wrapper of it)."""
    inner, target = forward, type(module).forward
    for _ in range(8):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None or inner is target:
            return inner is target
    return False
