"""A weight's fingerprint on the GPU, checked against the one held without the host: what tells a prepared weight
(``ops/prepared.py``: a kernel's quantized copy of a frozen weight) that the weight changed under it.

One pass over every 32-bit word of the weight (``fingerprint_spec``: two lanes of mixed words, positions mixed in),
each program's sums added with atomics; the last program to finish compares the total with the fingerprint held,
sets the state's stale flag and holds the new one. No sync: a step stays asynchronous, and a CUDA graph that captured
the check runs it at every replay (the candidate's refresh reads the flag on the device too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepatch.kernels.fingerprint_spec import (
    DONE,
    HELD,
    MIX_A,
    MIX_B,
    OFFSET_B,
    POSITION_A,
    POSITION_B,
    STALE,
    SUMS,
    words,
)

WARPS = 4
_A1, _A2, _A3, _A4, _A5 = (tl.constexpr(c) for c in MIX_A)
_B1, _B2, _B3, _B4, _B5 = (tl.constexpr(c) for c in MIX_B)
_POSITION_A, _POSITION_B, _OFFSET_B = tl.constexpr(POSITION_A), tl.constexpr(POSITION_B), tl.constexpr(OFFSET_B)
_HELD, _SUMS, _DONE, _STALE = tl.constexpr(HELD), tl.constexpr(SUMS), tl.constexpr(DONE), tl.constexpr(STALE)

WORDS_BLOCK, WORDS_STEPS = 1024, 32  # 32-bit words per program: a block of a step, times the steps


@triton.jit
def _mix(x, S1: tl.constexpr, M1: tl.constexpr, S2: tl.constexpr, M2: tl.constexpr, S3: tl.constexpr):
    """A bijective 32-bit multiply-xorshift mixer (``fingerprint_spec.MIX_A``, ``MIX_B``) of unsigned 32-bit ``x``."""
    x = x ^ (x >> S1)
    x = (x * M1).to(tl.uint32)
    x = x ^ (x >> S2)
    x = (x * M2).to(tl.uint32)
    return x ^ (x >> S3)


@triton.jit
def _fingerprint(words, count, state, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Each program sums its words' two mixed lanes into ``state``'s sums (atomics); the last program to finish
    compares the total with the fingerprint held, sets the stale flag, holds the new fingerprint and zeroes the
    sums and the count for the next call (the state is left as it was found: a graph replays it)."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * STEPS)
    lane_a = tl.zeros((BLOCK,), dtype=tl.uint32)
    lane_b = tl.zeros((BLOCK,), dtype=tl.uint32)
    for step in range(STEPS):
        index = start + step * BLOCK + tl.arange(0, BLOCK)
        mask = index < count
        word = tl.load(words + index, mask=mask, other=0).to(tl.uint32, bitcast=True)
        position = index.to(tl.uint32)
        a = _mix(word ^ (position * _POSITION_A).to(tl.uint32), _A1, _A2, _A3, _A4, _A5)
        b = _mix(word ^ (position * _POSITION_B + _OFFSET_B).to(tl.uint32), _B1, _B2, _B3, _B4, _B5)
        lane_a += tl.where(mask, a, 0).to(tl.uint32)
        lane_b += tl.where(mask, b, 0).to(tl.uint32)
    tl.atomic_add(state + _SUMS, tl.sum(lane_a, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
    tl.atomic_add(state + _SUMS + 1, tl.sum(lane_b, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
    done = tl.atomic_add(state + _DONE, 1, sem="acq_rel")  # after this program's sums (release)
    if done == tl.num_programs(0) - 1:  # every other program's sums are in (acquire)
        total_a = tl.atomic_xchg(state + _SUMS, 0, sem="acq_rel")
        total_b = tl.atomic_xchg(state + _SUMS + 1, 0, sem="acq_rel")
        changed = (total_a != tl.load(state + _HELD)) | (total_b != tl.load(state + _HELD + 1))
        tl.store(state + _HELD, total_a)
        tl.store(state + _HELD + 1, total_b)
        tl.store(state + _STALE, changed.to(tl.int32))
        tl.atomic_xchg(state + _DONE, 0, sem="acq_rel")


def fingerprint(x: torch.Tensor, state: torch.Tensor) -> None:
    """Check ``x``'s contents against the fingerprint ``state`` holds (int32 ``[fingerprint_spec.STATE_WORDS]``, zeros
    before the first check): on the device, the stale flag set where they differ and the new fingerprint held.
    ``x``'s rows must hold a multiple of 4 bytes (``fingerprint_spec.words``)."""
    values = words(x)
    count = values.numel()
    if count:
        programs = triton.cdiv(count, WORDS_BLOCK * WORDS_STEPS)
        _fingerprint[(programs,)](values, count, state, BLOCK=WORDS_BLOCK, STEPS=WORDS_STEPS, num_warps=WARPS)
