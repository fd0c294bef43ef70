"""A benchmark variant: every ``torch._scaled_mm`` call of the process with ``use_fast_accum=True`` unless it says
otherwise, so that fusepatch's FP8 projections run their GEMMs with fast accumulation (as torchao's float8
forward does).

Why a variant and not a library setting: alone, on random operands, fast accumulation takes 8% less GEMM time at
the same error against fp32 (``gemm_bench.py --fp8``); whether a training run follows the same loss curve with it
is what ``text_curves.py --fast-accum`` measures, and its step time ``train_step.py --fast-accum`` (label word
``fastaccum``), before the library would adopt it.
"""

from __future__ import annotations

import functools

import torch


def use_fast_accumulation() -> None:
    """Make ``use_fast_accum=True`` the default of ``torch._scaled_mm`` for this process (idempotent)."""
    original = torch._scaled_mm
    if getattr(original, "fast_accumulation", False):
        return

    @functools.wraps(original)
    def scaled_mm(*args, **kwargs):
        kwargs.setdefault("use_fast_accum", True)
        return original(*args, **kwargs)

    scaled_mm.fast_accumulation = True
    torch._scaled_mm = scaled_mm
