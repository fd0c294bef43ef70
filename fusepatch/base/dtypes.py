"""Dtype helpers the ops, the layers and the engine share."""

from __future__ import annotations

import torch


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the form choices are keyed and reported by."""
    return str(dtype).removeprefix("torch.")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype an active autocast computes in on ``device_type``, or None when autocast is off there."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def fsdp_compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """FSDP2's MixedPrecisionPolicy.param_dtype, if the model is sharded with one. The Trainer keeps sharded
    parameters in fp32 and computes in bf16: self-testing fp32 there compiles kernels training never calls
    (minutes at 27B shapes) and reports choices for a dtype that never runs."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
            return getattr(policy, "param_dtype", None)
    return None
