"""CUDA-graph replay of a fixed-shape op whose kernels cost the CPU more to launch than the GPU to run.

fla's chunked gated delta rule launches ~30 Triton/TileLang kernels per layer and step (forward and backward),
each behind Python: autotuner lookups, backend dispatch, argument binding. That host time outside any aten op
can exceed the layer's GPU work, so at small shapes the GPU idles through the linear-attention layers.

``GraphedOp(split)`` runs an op given as two functions of tensors (a ``Split``): ``forward(*inputs)`` returning
``(output, saved)`` and ``backward(inputs, saved, grad_output, needs_grad)`` returning the input gradients.
Each is captured once per input signature (shapes, dtypes, device, which inputs need gradients) as a CUDA graph
over static buffers; a call copies its inputs in, replays, and clones the output and the saved tensors out, and
its backward copies its own inputs, saved tensors and output gradient back in before replaying the backward
graph. So every layer of a model shares one pair of graphs and one memory pool, and calls interleave freely
(forward of layer 1, forward of layer 2, backward of layer 2, ...). ``recompute(fn)`` makes a split of any
differentiable function (nothing saved; the backward graph runs ``fn`` again under autograd: one more forward
on the GPU).

Packed calls (the caller routes them around), calls during another capture, in inference mode or under
``torch.compile`` tracing, and new signatures beyond ``MAX_SIGNATURES`` run the op without graphs. A capture that
fails (a kernel that synchronises or launches off the current stream) disables graphs for the op and says why
once; the call then runs without graphs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusepatch.base.saved_tensors import own_saved_tensors

logger = logging.getLogger("fusepatch")

MAX_SIGNATURES = 4  # per op: each holds static inputs and outputs (~260 MB at the 27B shape); varying lengths stop here


@dataclass(frozen=True)
class Split:
    """An op as ``forward(*inputs) -> (output, saved tensors)`` and ``backward(inputs, saved, grad_output,
    needs_grad) -> gradients`` (one per input that needs one, in order). Neither may synchronise the host.

    ``backward_inputs``: the indices of the inputs the backward reads (None: all). Only those are kept from the
    forward to the backward; the others reach the backward as None (or, replayed, stale): an input that is a view
    of a larger tensor would otherwise keep all of that tensor alive until the backward."""

    forward: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
    backward: Callable[..., tuple[torch.Tensor, ...]]
    backward_inputs: tuple[int, ...] | None = None

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The op without graphs, differentiable through the same two functions."""
        return _Direct.apply(self, *inputs)

    def kept(self, count: int) -> tuple[int, ...]:
        return tuple(range(count)) if self.backward_inputs is None else self.backward_inputs


def _spread(count: int, kept: tuple[int, ...], values) -> list:
    """The kept inputs back in their places among ``count``, None elsewhere."""
    spread = [None] * count
    for index, value in zip(kept, values):
        spread[index] = value
    return spread


def recompute(fn: Callable[..., torch.Tensor]) -> Split:
    """A split of a differentiable ``fn``: nothing saved, the backward runs ``fn`` again under autograd."""

    def forward(*inputs):
        with torch.no_grad():
            return fn(*inputs), ()

    def backward(inputs, saved, grad_output, needs_grad):
        leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs_grad)]
        with torch.enable_grad():
            out = fn(*leaves)
            return torch.autograd.grad(out, [leaf for leaf, n in zip(leaves, needs_grad) if n], grad_output)

    return Split(forward, backward)


def _gradients(needs_grad, grads) -> tuple:
    found = iter(grads)
    return tuple(next(found) if needed else None for needed in needs_grad)


class _Direct(torch.autograd.Function):
    """A split run directly (no graphs): what calls that cannot be graphed get."""

    @staticmethod
    def forward(ctx, split: Split, *inputs):
        output, saved = split.forward(*inputs)
        ctx.split, ctx.count, ctx.kept = split, len(inputs), split.kept(len(inputs))
        ctx.save_for_backward(*[inputs[i] for i in ctx.kept], *saved)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        tensors = ctx.saved_tensors
        kept = len(ctx.kept)
        inputs, saved = _spread(ctx.count, ctx.kept, tensors[:kept]), tensors[kept:]
        needs = tuple(ctx.needs_input_grad[1:])
        grads = ctx.split.backward(inputs, saved, grad_output.contiguous(), needs)
        return (None, *_gradients(needs, grads))


@dataclass
class _Entry:
    """The captured graphs and static buffers of one input signature."""

    inputs: list[torch.Tensor]
    needs_grad: tuple[bool, ...]
    forward: object
    output: torch.Tensor
    saved: tuple[torch.Tensor, ...] = ()
    backward: object | None = None
    grad_output: torch.Tensor | None = None
    grads: tuple[torch.Tensor, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, tensors, saved=(), indices=None) -> None:
        """Copy ``tensors`` into the static inputs (at ``indices``, or all in order) and ``saved`` into the static
        saved tensors."""
        for index, tensor in zip(indices if indices is not None else range(len(tensors)), tensors):
            self.inputs[index].copy_(tensor)
        for static, tensor in zip(self.saved, saved):
            static.copy_(tensor)

    def run_forward(self, backend, tensors, keep_saved: bool):
        """Replay the forward graph on ``tensors``: (the output, and the saved tensors when asked), the caller's
        own copies, which the next replay does not overwrite."""
        with self.lock:
            self.load(tensors)
            backend.replay(self.forward)
            return self.output.clone(), [t.clone() for t in self.saved] if keep_saved else []


class CudaGraphs:
    """Capture and replay with torch.cuda's graphs (the tests substitute a stand-in that runs on the CPU)."""

    def __init__(self) -> None:
        self._pools: dict[int, object] = {}

    def pool(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._pools:
            self._pools[index] = torch.cuda.graph_pool_handle()
        return self._pools[index]

    def warm_up(self, device: torch.device, run: Callable[[], None]) -> None:
        """Run once outside any capture, on a side stream (compiles, autotunes, lazy initialisation)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)

    def capture(self, device: torch.device, run: Callable[[], object]):
        """(graph, what ``run`` returned while captured)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (DataParallel replicas, the autograd engine's) may allocate meanwhile
        with torch.cuda.graph(graph, pool=self.pool(device), capture_error_mode="thread_local"):
            result = run()
        return graph, result

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    @staticmethod
    def capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: GraphedOp, entry: _Entry, *tensors):
        output, saved = entry.run_forward(op.backend, tensors, keep_saved=True)
        ctx.op, ctx.entry, ctx.kept = op, entry, op.split.kept(len(tensors))
        ctx.save_for_backward(*[tensors[i] for i in ctx.kept], *saved)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        op, entry = ctx.op, ctx.entry
        # Unpack before taking the lock: under activation checkpointing unpacking re-runs the forward (and so
        # this op's forward replay, which takes the same lock).
        tensors = ctx.saved_tensors
        kept = len(ctx.kept)
        with entry.lock:
            entry.load(tensors[:kept], tensors[kept:], indices=ctx.kept)
            entry.grad_output.copy_(grad_output)
            op.backend.replay(entry.backward)
            grads = [g.clone() for g in entry.grads]
        return (None, None, *_gradients(entry.needs_grad, grads))


class GraphedOp:
    """A ``Split`` op replayed from CUDA graphs per input signature (module docstring)."""

    def __init__(self, split: Split, name: str, backend: CudaGraphs | None = None) -> None:
        self.split = split
        self.name = name
        self.backend = backend or CudaGraphs()
        self.entries: dict[tuple, _Entry] = {}
        self.disabled: str | None = None
        self._lock = threading.Lock()
        self._said_full = False

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        entry = self._entry(tensors)
        if entry is None:
            return self.split.run(*tensors)
        if entry.backward is None:  # nothing to differentiate: no autograd node, no saved tensors
            return entry.run_forward(self.backend, tensors, keep_saved=False)[0]
        return _Replay.apply(self, entry, *tensors)

    def _signature(self, tensors) -> tuple | None:
        device = tensors[0].device
        if any(not isinstance(t, torch.Tensor) or t.device != device for t in tensors):
            return None
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        needs = tuple(grad and t.requires_grad for t in tensors)
        return (str(device), needs, tuple((tuple(t.shape), t.dtype) for t in tensors))

    def _entry(self, tensors) -> _Entry | None:
        if (
            self.disabled is not None
            or torch.is_inference_mode_enabled()  # static buffers made here would be inference tensors
            or torch.compiler.is_compiling()
            or self.backend.capturing()
        ):
            return None
        key = self._signature(tensors)
        if key is None:
            return None
        found = self.entries.get(key)
        if found is not None:
            return found
        with self._lock:
            if key in self.entries:
                return self.entries[key]
            if self.disabled is not None:
                return None
            if len(self.entries) >= MAX_SIGNATURES:
                if not self._said_full:
                    self._said_full = True
                    logger.info(
                        "fusepatch: %s: %d input shapes already captured as CUDA graphs; new shapes run without "
                        "graphs (lengths that change every step: pad to a few fixed lengths to keep them)",
                        self.name,
                        MAX_SIGNATURES,
                    )
                return None
            try:
                entry = self._capture(tensors, key[1])
            except Exception as exc:  # noqa: BLE001 - any capture failure: run the op itself, say why once
                self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                logger.warning(
                    "fusepatch: %s: CUDA graph capture failed (%s); running it without graphs from now on "
                    "(FUSEPATCH_SKIP=%s keeps the candidate off altogether)",
                    self.name,
                    self.disabled,
                    self.name,
                )
                return None
            self.entries[key] = entry
            return entry

    def _capture(self, tensors, needs_grad: tuple[bool, ...]) -> _Entry:
        device = tensors[0].device
        inputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        split = self.split
        # The kernels take their inputs' dtypes as they are; autocast stays off inside the graphs so that nothing
        # it caches (cast weights) is baked into them.
        quiet = torch.autocast(device.type, enabled=False)

        def forward():
            with torch.no_grad(), quiet:
                return split.forward(*inputs)

        def backward(saved, grad_output):
            with torch.no_grad(), quiet:
                return tuple(split.backward(inputs, saved, grad_output, needs_grad))

        def warm_up():
            output, saved = forward()
            if any(needs_grad):
                backward(saved, torch.ones_like(output))

        # A first call inside an activation-checkpointed forward: autograd graphs made here (a recompute split's
        # backward) keep their saved tensors (the checkpoint's hooks would drop them and re-run the layer).
        with own_saved_tensors():
            self.backend.warm_up(device, warm_up)
            graph, (output, saved) = self.backend.capture(device, forward)
            entry = _Entry(inputs=inputs, needs_grad=needs_grad, forward=graph, output=output, saved=tuple(saved))
            if any(needs_grad):
                entry.grad_output = torch.empty_like(output)
                entry.backward, entry.grads = self.backend.capture(
                    device, lambda: backward(entry.saved, entry.grad_output)
                )
        logger.debug("fusepatch: %s: captured CUDA graphs for %s", self.name, [tuple(t.shape) for t in tensors])
        return entry
