"""Load and patch in one call, as ``from_pretrained(..., use_kernels=True)`` loads and kernelizes."""

from __future__ import annotations

from typing import Any

from fusepatch.base.env import require_transformers
from fusepatch.engine.patch import apply
from fusepatch.engine.plan import check_apply_kwargs


def from_pretrained(
    name_or_path: str, *args: Any, auto_class: Any = None, apply_kwargs: dict | None = None, **kwargs: Any
):
    """``AutoModelForCausalLM.from_pretrained(name_or_path, *args, **kwargs)``, then :func:`fusepatch.apply`.

    Args:
        name_or_path: a Hub id or a local checkpoint folder.
        auto_class: the transformers auto class to load with (default ``AutoModelForCausalLM``; e.g.
            ``AutoModelForImageTextToText`` for Qwen3.5 image-text checkpoints).
        apply_kwargs: keyword arguments for :func:`fusepatch.apply` (``ops``, ``exclude``, ``prefer``, ``strict``,
            ``compute_dtype``, ``cuda_graphs``, ``verbose``, ``precision``, ``drop_frozen_weights``), checked before
            the model loads.
        **kwargs: for ``from_pretrained`` (``dtype``, ``device_map``, ``attn_implementation``, ...).

    Returns:
        The patched model; ``fusepatch.report(model)`` gives the report ``apply`` logged.

    Example::

        >>> model = fusepatch.from_pretrained("Qwen/Qwen3.5-27B", dtype="bfloat16", device_map="cuda")  # doctest: +SKIP
    """
    check_apply_kwargs(apply_kwargs or {})  # before a download and load of many GB, not after
    transformers = require_transformers()
    loader = auto_class or transformers.AutoModelForCausalLM
    model = loader.from_pretrained(name_or_path, *args, **kwargs)
    apply(model, **(apply_kwargs or {}))
    return model
