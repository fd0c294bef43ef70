"""CUDA-graph replay of a fixed-shape op whose kernels cost the CPU more to launch than the GPU to run.

fla's chunked gated delta rule launches ~30 Triton/TileLang kernels per layer and step (forward and backward),
each behind Python: autotuner lookups, backend dispatch, argument binding. Measured on the H200 (bench-2b and
bench-27b with ``BENCH_CPU_PROFILE=1``, session 9): 1.6 ms of CPU per layer forward and 1.9-3.1 ms per backward
outside any aten op, against 0.4-1.4 ms of GPU work. At the 2B shape that is ~60 ms of a 235 ms step with the
GPU 64% busy; at the 27B shape the GPU idles through every linear-attention layer.

``GraphedOp(fn)`` runs ``fn`` (a function of tensors returning one tensor) from two CUDA graphs per input
signature (shapes, dtypes, device, which inputs need gradients), captured on first sight:

* forward: ``fn`` on static copies of the inputs, no autograd;
* backward: ``fn`` again with autograd on the same static inputs, then ``torch.autograd.grad`` against a
  static output gradient. Recomputing the forward keeps nothing of one call in the graph between its forward
  and backward, so every layer of a model shares one pair of graphs (and one memory pool), at the cost of one
  more forward of the op on the GPU.

Each replay copies its own inputs (or, in the backward, its saved inputs and output gradient) into the static
buffers first and clones the results out after, so calls may interleave freely. Packed (``cu_seqlens``) calls,
calls during another capture or under ``torch.compile`` tracing, and new signatures beyond
``MAX_SIGNATURES`` run ``fn`` itself. A capture that fails (a kernel that synchronises or launches off the
current stream) disables graphs for the op and says why once; the call then runs ``fn``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("fusepatch")

MAX_SIGNATURES = 4  # per op: each holds static inputs and outputs (~260 MB at the 27B shape); varying lengths stop here


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Saved-tensor hook that saves the tensor itself (shadows checkpointing/offloading hooks around)."""
    return tensor


@dataclass
class _Entry:
    """The captured graphs and static buffers of one input signature."""

    inputs: list[torch.Tensor]
    needs_grad: tuple[bool, ...]
    forward: object
    output: torch.Tensor
    backward: object | None = None
    grad_output: torch.Tensor | None = None
    grads: tuple[torch.Tensor, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, tensors) -> None:
        for static, tensor in zip(self.inputs, tensors):
            static.copy_(tensor)


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
        with entry.lock:
            entry.load(tensors)
            op.backend.replay(entry.forward)
            output = entry.output.clone()
        ctx.op, ctx.entry = op, entry
        ctx.save_for_backward(*tensors)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        op, entry = ctx.op, ctx.entry
        # Unpack before taking the lock: under activation checkpointing unpacking re-runs the forward (and so
        # this op's forward replay, which takes the same lock).
        saved = ctx.saved_tensors
        with entry.lock:
            entry.load(saved)
            entry.grad_output.copy_(grad_output)
            op.backend.replay(entry.backward)
            grads = iter([g.clone() for g in entry.grads])
        return (None, None, *[next(grads) if needed else None for needed in entry.needs_grad])


class GraphedOp:
    """``fn(*tensors) -> tensor`` replayed from CUDA graphs per input signature (module docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor], name: str, backend: CudaGraphs | None = None) -> None:
        self.fn = fn
        self.name = name
        self.backend = backend or CudaGraphs()
        self.entries: dict[tuple, _Entry] = {}
        self.disabled: str | None = None
        self._lock = threading.Lock()
        self._noted: set[str] = set()

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        entry = self._entry(tensors)
        if entry is None:
            return self.fn(*tensors)
        if entry.backward is None:
            with entry.lock:
                entry.load(tensors)
                self.backend.replay(entry.forward)
                return entry.output.clone()
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
                self._note(
                    "signatures",
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
        wanted = any(needs_grad)

        # The op's kernels take their inputs' dtypes as they are; autocast stays off inside the graphs so that
        # nothing it caches (cast weights) is baked into them.
        def with_grad(grad_output: torch.Tensor | None):
            leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs_grad)]
            with torch.enable_grad(), torch.autocast(device.type, enabled=False):
                out = self.fn(*leaves)
                grads = torch.autograd.grad(
                    out,
                    [leaf for leaf, n in zip(leaves, needs_grad) if n],
                    grad_output if grad_output is not None else torch.ones_like(out),
                )
            return grads

        def forward_only():
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                return self.fn(*inputs)

        # A first call inside an activation-checkpointed forward: the capture's own autograd graph keeps its
        # saved tensors (the checkpoint's hooks would drop them and re-run the layer from inside its forward).
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            self.backend.warm_up(device, (lambda: with_grad(None)) if wanted else forward_only)
            forward, output = self.backend.capture(device, forward_only)
            entry = _Entry(inputs=inputs, needs_grad=needs_grad, forward=forward, output=output)
            if wanted:
                entry.grad_output = torch.empty_like(output)
                entry.backward, entry.grads = self.backend.capture(device, lambda: with_grad(entry.grad_output))
        logger.debug("fusepatch: %s: captured CUDA graphs for %s", self.name, [tuple(t.shape) for t in tensors])
        return entry

    def _note(self, key: str, message: str, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            logger.info(message, *args)
