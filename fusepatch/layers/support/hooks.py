"""Whether a module's parts may be called directly: the hooks a fused path would skip, the dtypes its GEMM would
meet, and autocast's dtype."""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module


def _active(hooks, gathering: bool = False) -> bool:
    """Whether ``hooks`` (a module's or the global hook dict) holds one that must see the module's call. The
    profiler labels of ``fusepatch.diagnostics.profile.label_layers`` are marked passive: skipping them only moves the ops
    into the enclosing label, and honouring them would make the profiled step differ from the timed ones. With
    ``gathering``, so are DeepSpeed's hooks: ZeRO-3's gather and free the module's parameters (defined in
    ``deepspeed.runtime.zero``, most wrapped by ``deepspeed.utils.nvtx``, whose wrapper names its own module)."""
    return any(
        not getattr(hook, "_fusepatch_passive", False)
        and not (gathering and str(getattr(hook, "__module__", "")).startswith("deepspeed."))
        for hook in (hooks or {}).values()
    )


def hooked(module: torch.nn.Module, gathering: bool = False) -> bool:
    """Whether calling ``module``'s parts directly would skip a hook (its own or a global one). Asked for every
    projection of every forward, so the usual case, no hook anywhere, is answered from the dicts' truth alone:
    a generator over all eight hook dicts made ``plain_linears`` a visible share of a host-bound forward.
    ``gathering``: the caller reads the module's parameters through ``backends.deepspeed.gather`` (or the module
    has none), so ZeRO-3's hooks, which every module has under it, need not run; a user's hook still counts."""
    every = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        getattr(module, "_backward_pre_hooks", None),
        _module._global_forward_hooks,
        _module._global_forward_pre_hooks,
        _module._global_backward_hooks,
        getattr(_module, "_global_backward_pre_hooks", None),
    )
    return any(every) and any(_active(hooks, gathering) for hooks in every)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def in_dtype(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether a linear's weight and bias (if any) are in ``dtype``: outside autocast, its GEMM then takes an input
    of that dtype as the module itself would."""
    return linear.weight.dtype == dtype and (linear.bias is None or linear.bias.dtype == dtype)


def runs_own_forward(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs its class's forward, or the one ``apply`` gave it: no forward another hand set
    on the instance (a wrapper set after ``apply`` would not run where a fused path does the module's work). A wrapper
    made with ``functools.update_wrapper`` (accelerate's hook) copies the binding's ``__func__`` and ``__self__``, and
    is told by its ``__wrapped__``."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return True
    state = module.__dict__.get("_fusepatch")
    if state is None or getattr(forward, "__func__", None) is not state.row.forward:
        return False
    return getattr(forward, "__self__", None) is module and not hasattr(forward, "__wrapped__")


def may_bypass(module: torch.nn.Module, gathering: bool = False) -> bool:
    """Whether a fused path may do ``module``'s work without calling it: its own forward and no hook that must see
    the call (``gathering``: as for ``hooked``). That its class computes what the fused path does is the caller's to
    check."""
    return runs_own_forward(module) and not hooked(module, gathering)


def same_family(part: torch.nn.Module, owner: torch.nn.Module) -> bool:
    """Whether ``part``'s class comes from ``owner``'s modeling file (a Qwen decoder layer's own RMSNorm, not a module
    swapped in after the model was built: another norm, or ``nn.Identity``). The owner's bases count: FSDP2's
    ``fully_shard`` gives a module a class of its own made in torch, over the model's."""
    return any(type(part).__module__ == base.__module__ for base in type(owner).__mro__)
