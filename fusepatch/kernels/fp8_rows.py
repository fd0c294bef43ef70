"""FP8 rows carried from the kernel that produced a tensor to the FP8 projections that read it, so the input of an
FP8 GEMM is quantized once (``kernels/fp8.quantize_rows``' bits) instead of again by every projection.

How they travel: a *frame* (``frame()``, opened by the layer around a producer and the projections it feeds) holds
records ``tensor -> (q, inverse)``; a producer asked to (``Frame.emitting``) writes the FP8 rows of its rounded
output in the same kernel and records them; an FP8 projection asks ``carried(x)`` before quantizing ``x``. A frame
opened with ``share=True`` (``layers/support/projections.project``: several projections of one input, q/k/v,
gate/up) also records what its first projection quantized, which the others then reuse. Records go with their
frame: nothing outlives the layer's call that made it (no FP8 copy kept beside the activation until the backward).

Why this is certain, never a stale or mismatched FP8 tensor: a record names the one tensor object it was made for
(a weak reference, so an object made later at the same address is not taken for it) and the state it was made in:
its version counter (bumped by every in-place write through the tensor or any view of it: the writes autograd
itself refuses a saved tensor after), its storage address, offset, shape, strides and dtype. Any difference and
the projection quantizes afresh. The writes a version counter does not see (through ``.data`` or
``untyped_storage()``) are the ones autograd does not see either; no library writes activations so.

Why not passed as arguments: between the producer (a norm module's call, the SwiGLU op) and the projections lie
module calls with their hooks (the attention's or Gated DeltaNet's own forward, peft's LoRA layers); a record
asks nothing of them, and where anything between returns another tensor, the projections quantize as before.
Under ``torch.compile`` tracing nothing is recorded or looked up (the traced graph quantizes itself); a CUDA graph
captures the producer's extra stores and the projection's reads of the same buffers, replayed together. An
activation checkpoint's recompute runs the same frames and gives the same bits.

No Triton here: the FP8 op's CPU twin and the tests use it without Triton.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """``x`` quantized along its last dimension: ``q`` float8_e4m3fn ``[rows, columns]``, ``inverse`` fp32
    ``[rows, 1]`` (what ``quantize_rows(x.reshape(-1, columns))`` gives)."""

    q: torch.Tensor
    inverse: torch.Tensor


class Columns:
    """One quantization by columns (the weight gradient's tokens) shared by the projections of one input: made by
    the first backward that needs it, dropped after the last (``users``) or with the graph."""

    def __init__(self) -> None:
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None
        self.users = 0

    def take(self, make) -> tuple[torch.Tensor, torch.Tensor]:
        value = self.value if self.value is not None else make()
        self.users -= 1
        self.value = value if self.users > 0 else None
        return value


class Carried(NamedTuple):
    """What a frame holds for one tensor: its FP8 rows and the by-columns quantization its projections share."""

    rows: Rows
    columns: Columns


class _Record(NamedTuple):
    tensor: weakref.ref
    state: tuple
    carried: Carried


def _state(x: torch.Tensor) -> tuple:
    return (x._version, x.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)


class Frame:
    """The records of one layer call (``frame()``); ``emit``: whether producers called now write FP8 rows."""

    def __init__(self, share: bool) -> None:
        self.share, self.emit = share, False
        self.records: dict[int, _Record] = {}

    @contextmanager
    def emitting(self, wanted: bool = True) -> Iterator[None]:
        """Producers called inside (an RMSNorm, SwiGLU) write the FP8 rows of their output beside it, when
        ``wanted`` (the projections they feed are FP8)."""
        before, self.emit = self.emit, bool(wanted) and not torch.compiler.is_compiling()
        try:
            yield
        finally:
            self.emit = before


_LOCAL = threading.local()


def _frames() -> list[Frame]:
    frames = getattr(_LOCAL, "frames", None)
    if frames is None:
        frames = _LOCAL.frames = []
    return frames


@contextmanager
def frame(share: bool = False) -> Iterator[Frame]:
    """A frame for the records made inside (dropped at its exit); ``share``: the projections called inside record
    what they quantized, for the next projection of the same input."""
    frames = _frames()
    current = Frame(share)
    frames.append(current)
    try:
        yield current
    finally:
        frames.pop()
        current.records.clear()


def emitting() -> bool:
    """Whether a producer called now should write FP8 rows of its output (and ``record`` them)."""
    if torch.compiler.is_compiling():
        return False
    frames = _frames()
    return bool(frames) and frames[-1].emit


def sharing() -> bool:
    """Whether a projection that quantized its input now should ``record`` the rows for the next one."""
    if torch.compiler.is_compiling():
        return False
    frames = _frames()
    return bool(frames) and frames[-1].share


def record(x: torch.Tensor, rows: Rows) -> Carried | None:
    """``rows`` as ``x``'s FP8 rows, as ``x`` is now, in the innermost frame (nothing outside a frame)."""
    if torch.compiler.is_compiling():
        return None
    frames = _frames()
    if not frames:
        return None
    made = Carried(Rows(*rows), Columns())
    frames[-1].records[id(x)] = _Record(weakref.ref(x), _state(x), made)
    return made


def carried(x: torch.Tensor) -> Carried | None:
    """The FP8 rows recorded for this very tensor in its present state, else None (quantize it)."""
    if torch.compiler.is_compiling():
        return None
    frames = _frames()
    for current in reversed(frames):
        found = current.records.get(id(x))
        if found is not None:
            if found.tensor() is x and found.state == _state(x):
                return found.carried
            return None
    return None
