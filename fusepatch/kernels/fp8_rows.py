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


def _untracked(x: torch.Tensor) -> bool:
    """A tensor whose writes no version counter sees (made under ``torch.inference_mode``), or a trace's: no record."""
    return torch.compiler.is_compiling() or x.is_inference()


def _state(x: torch.Tensor) -> tuple:
    return (x._version, x.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)


class Frame:
    """The records of one layer call (``frame()``); ``emit``: whether producers called now write FP8 rows."""

    def __init__(self, share: bool) -> None:
        self.share, self.emit, self.emit_gradients = share, False, False
        self.records: dict[int, _Record] = {}

    @contextmanager
    def emitting(self, wanted: bool = True, gradients: bool = False) -> Iterator[None]:
        """Producers called inside (an RMSNorm, SwiGLU) write the FP8 rows of their output beside it, when
        ``wanted`` (the projections they feed are FP8); with ``gradients``, their backward also writes those of the
        input gradients it returns (``record_gradient``: the projections that made their inputs are FP8, trained)."""
        compiling = torch.compiler.is_compiling()
        before = self.emit, self.emit_gradients
        self.emit, self.emit_gradients = bool(wanted) and not compiling, bool(gradients) and not compiling
        try:
            yield
        finally:
            self.emit, self.emit_gradients = before


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


def _innermost() -> Frame | None:
    """The frame calls now belong to; None outside one, while tracing, and under ``torch.inference_mode``."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return None
    frames = _frames()
    return frames[-1] if frames else None


def emitting() -> bool:
    """Whether a producer called now should write FP8 rows of its output (and ``record`` them)."""
    current = _innermost()
    return current is not None and current.emit


def emitting_gradients() -> bool:
    """Whether a producer called now should write, in its backward, the FP8 rows of the gradients it returns."""
    current = _innermost()
    return current is not None and current.emit_gradients


def sharing() -> bool:
    """Whether a projection that quantized its input now should ``record`` the rows for the next one."""
    current = _innermost()
    return current is not None and current.share


def fits(dtype: torch.dtype, dim: int) -> bool:
    """Whether an FP8 projection could read rows of this dtype and width (bf16 or fp16, a multiple of 16)."""
    return dtype in (torch.bfloat16, torch.float16) and dim > 0 and dim % 16 == 0


def buffers(like: torch.Tensor) -> Rows:
    """Empty FP8 rows for a tensor of ``like``'s shape, for a producer's kernel to write."""
    dim = like.shape[-1]
    q = torch.empty((like.numel() // dim, dim), device=like.device, dtype=torch.float8_e4m3fn)
    return Rows(q, torch.empty((q.shape[0], 1), device=like.device, dtype=torch.float32))


def record(x: torch.Tensor, rows: Rows) -> Carried | None:
    """``rows`` as ``x``'s FP8 rows, as ``x`` is now, in the innermost frame (nothing outside a frame)."""
    if _untracked(x):
        return None
    frames = _frames()
    if not frames:
        return None
    made = Carried(Rows(*rows), Columns())
    frames[-1].records[id(x)] = _Record(weakref.ref(x), _state(x), made)
    return made


def carried(x: torch.Tensor) -> Carried | None:
    """The FP8 rows recorded for this very tensor in its present state, else None (quantize it)."""
    if _untracked(x):
        return None
    frames = _frames()
    for current in reversed(frames):
        found = current.records.get(id(x))
        if found is not None:
            if found.tensor() is x and found.state == _state(x):
                return found.carried
            return None
    return None


# Gradients' rows, written by a producer's backward for the FP8 projection whose output the gradient is (SwiGLU's
# backward: gate_proj's and up_proj's output gradients). No frame runs in the backward: a record goes with its tensor
# (a weak reference's callback), or is taken by the one projection that reads it.
_GRADIENTS: dict[int, _Record] = {}
_GRADIENTS_LOCK = threading.Lock()


def record_gradient(x: torch.Tensor, rows: Rows) -> None:
    """``rows`` as the FP8 rows of ``x``, a gradient a backward returns, as ``x`` is now."""
    if _untracked(x):
        return
    key = id(x)

    def forget(_, key=key) -> None:
        with _GRADIENTS_LOCK:
            found = _GRADIENTS.get(key)
            if found is not None and found.tensor() is None:
                del _GRADIENTS[key]

    with _GRADIENTS_LOCK:
        _GRADIENTS[key] = _Record(weakref.ref(x, forget), _state(x), Carried(Rows(*rows), Columns()))


def carried_gradient(grad: torch.Tensor) -> Rows | None:
    """The FP8 rows a backward recorded for ``grad``, or for the tensor ``grad`` is a same-layout view of (autograd
    reshapes a gradient on its way back through a ``view``), in its present state; taken (a gradient has one
    reader). None otherwise."""
    if not _GRADIENTS or _untracked(grad):
        return None
    for candidate in (grad, grad._base):
        if candidate is None:
            continue
        with _GRADIENTS_LOCK:
            found = _GRADIENTS.get(id(candidate))
            if found is None or found.tensor() is not candidate:
                continue
            del _GRADIENTS[id(candidate)]
        same_layout = candidate is grad or (
            grad.data_ptr() == candidate.data_ptr()
            and grad.is_contiguous()
            and candidate.is_contiguous()
            and grad.numel() == candidate.numel()
            and grad.shape[-1] == candidate.shape[-1]
        )
        if same_layout and found.state == _state(candidate):
            return found.carried.rows
    return None
