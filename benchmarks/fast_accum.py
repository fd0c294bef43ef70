"""A benchmark variant: every ``torch._scaled_mm`` call of the process with ``use_fast_accum=True`` unless it says
otherwise, so that fusepatch's FP8 projections run their GEMMs with fast accumulation (as torchao's float8
forward does).

The variant measured fast accumulation before the library adopted it: alone, on random operands, 8% less GEMM
time at the same error against fp32 (``gemm_bench.py --fp8``); a 300-step loss curve on unrepeated text as far
from bf16's as without it, inside bf16's seed-to-seed spread in 5 of 12 windows against 4 without it
(``text_curves.py --fast-accum``, record ``2026-12-06-fp8-text-curves-h100.jsonl``). fusepatch's FP8 op now
passes ``use_fast_accum=True`` itself (``ops/fp8_linear/scaled_mm.py``), so the variant changes only rows of
older code (``+code=REV``) and other callers of ``torch._scaled_mm``.
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
