"""CUDA graphs over whole decoder layers, for training steps of one shape: ``apply(model, cuda_graphs=True)``.

Why: at the 0.8-2B sizes the host cannot queue a layer's aten ops and Triton launches as fast as the GPU runs them,
and the GPU idles through the forward. Replayed from graphs, every layer costs the host one launch forward and one
backward, so the small shapes become GPU-bound; a step that already keeps the GPU busy (27B with LoRA) gains
nothing. The measured speed-ups are in docs/benchmarks.md.

How: the layers run as usual while a step's shape settles (kernel choices, self-tests, autotuning). Once
``WARM_CALLS`` training steps in a row gave every layer the same signature (shapes, dtypes, which inputs need
gradients, autocast, the plain positions), the next call captures all layers (``_capture_stack``: one memory
pool; forwards in call order, then backwards in reverse, as a step replays them; the parameters seen through
fresh leaves, so that a loop still holding the last step's loss does not matter), checks the first layer's
replay against its own forward, and replays from then on. A call of another signature runs as usual; a new
steady signature is captured in turn, up to ``MAX_CAPTURES`` per model. Parameters moved or replaced
(``model.to``, ``load_state_dict(assign=True)``) or frozen since, and a weight an op's kernel prepared (a frozen
weight's quantized copy) prepared into a new handle (a new version: an in-place load), drop the graphs; a write that
keeps the version (peft's merges, through ``.data``) is seen by the handle's own check, which the graph captured and
runs at every replay.

Calls that run without graphs, said once each with the fix: activation checkpointing (it exists to drop the
activations a graph keeps), hooks on a layer's modules (they would run once, at capture), FSDP2's sharded
parameters (gathered anew each step), autocast over parameters of another dtype (its cast cache is per region),
packed, padded or cached calls (document boundaries and masks decide work on the host), and a capture or check
that fails (a kernel that waits for the host or runs on another stream), and training off the GPU. Inference
and ``torch.compile`` tracing run as usual, silently.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fusepatch.layers.support.hooks import autocast_dtype, hooked
from fusepatch.layers.support.positions import is_plain
from fusepatch.layers.support.signature import CACHE_NAMES

logger = logging.getLogger("fusepatch")

WARM_CALLS = 2  # same-signature training steps before the capture (the first also chooses and self-tests kernels)
MAX_CAPTURES = 4  # signatures captured per model: each keeps a pool of one step's activations
ATTRIBUTE = "_fusepatch_graphs"  # on each decoder layer: (LayerGraphs, index)
# arguments the layers pass on without computing with them: the Trainer's token count for the loss's mean
IGNORED = ("num_items_in_batch",)
DEVICES = ("cuda",)  # where the layers are captured (the tests add "cpu", with a stand-in capture)

FIXES = {
    "checkpointing": "activation checkpointing is on, and a graph keeps every activation it would drop. Fix: "
    "model.gradient_checkpointing_disable(), or leave cuda_graphs off for this run",
    "hooks": "a module of the layer has hooks, which a graph would run once, at capture. Fix: remove them (a "
    "profiler's or a debugger's), or leave cuda_graphs off",
    "sharded": "the layer's parameters are FSDP2 shards, gathered anew each step. Fix: leave cuda_graphs off under "
    "FSDP2 (it targets single-GPU runs of small models)",
    "autocast": "autocast casts parameters of another dtype, and its cast cache cannot live in a graph. Fix: load "
    "the model in the autocast dtype (torch_dtype=torch.bfloat16)",
    "cached": "the training forward fills a cache (use_cache=True, Qwen3.5 configs' default), which a replay cannot "
    "update. Fix: pass use_cache=False (or set model.config.use_cache = False) when training",
    "packed": "the call is packed, padded or cached, or its positions were not made by fusepatch's loss (given "
    "position_ids, an attention mask, a cache: they decide work on the host). Fix: none needed; such calls run "
    "without graphs",
    "output": "the layer returned more than its hidden states. Fix: none needed; the layers run without graphs",
    "device": "the layers train off the GPU, and CUDA graphs need a CUDA device. Fix: move the model to a GPU "
    "(model.to('cuda')), or leave cuda_graphs off",
}


class _Call(torch.nn.Module):
    """One layer as a function of tensors alone: the hidden states and the rotary tables in, the hidden states out;
    its other arguments as a recorded call passed them. It calls the patched forward itself, past the graph
    dispatch; ``run`` with ``aliases`` computes with those in place of the layer's trainable parameters."""

    def __init__(self, layer: torch.nn.Module, forward: Callable[..., Any], kwargs: dict) -> None:
        super().__init__()
        self.layer, self.kwargs, self._forward = layer, kwargs, forward
        named = [(name, p) for name, p in layer.named_parameters() if p.requires_grad]
        self.names = [f"layer.{name}" for name, _ in named]
        self.params = [p for _, p in named]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._forward(self.layer, hidden, position_embeddings=(cos, sin), **self.kwargs)

    def run(self, hidden, cos, sin, aliases: list[torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(self, dict(zip(self.names, aliases)), (hidden, cos, sin), strict=False)


def _patched(layer: torch.nn.Module) -> tuple:
    """The states of a layer's patched modules, walked once a capture (a replay reads their generations)."""
    return tuple(state for module in layer.modules() if (state := module.__dict__.get("_fusepatch")) is not None)


def _reads(params: Iterable[torch.nn.Parameter], states: tuple) -> tuple:
    """What a layer's graphs read: per parameter its pointer, dtype, ``requires_grad`` and, frozen, its version (an
    in-place load gives a prepared weight a new handle, made outside a graph); and per patched module the
    generation of the handle its ops' dispatchers keep for its own weight (``ops/prepared.py``: a handle made anew
    frees the memory the graph reads; another weight's, a copy's, leaves this one's as it was)."""
    tensors = tuple((p.data_ptr(), p.dtype, p.requires_grad, None if p.requires_grad else p._version) for p in params)
    handles = tuple(
        d.generation_of(getattr(state.owner, "weight", None)) if hasattr(d, "generation_of") else 0
        for state in states
        for d in state.ops.values()
    )
    return tensors, handles


class LayerGraphs:
    """The graphs of one decoder stack: the signatures of the last step's calls, and the captures made."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        self.recorded: dict[int, tuple] = {}  # layer index -> (kwargs, forward) of its last call run as usual
        self.current: list[tuple] = []  # this step's signatures so far, one per layer called
        self.previous: tuple | None = None  # the last complete step's signatures
        self.steady = 0  # complete steps in a row with ``previous``'s signatures
        self.graphs: dict[tuple, list] = {}  # step signatures -> graphed callables, one per layer
        self.active: list | None = None  # this step's graphs: those of ``previous``, looked up once per step
        self.params: list[tuple] = []  # what the graphs read, per layer (``_reads``)
        self.patched: list[tuple] = []  # the states of each layer's patched modules at the capture (``_patched``)
        self.disabled = False
        self.said: set[str] = set()

    # copies (EMA models, TRL's reference model) and pickles start without graphs: those hold the GPU's memory
    def __deepcopy__(self, memo: dict) -> LayerGraphs:
        copied = memo[id(self)] = LayerGraphs.__new__(LayerGraphs)  # one holder for the copy's layers, as here
        copied.__init__(copy.deepcopy(self.layers, memo))
        return copied

    def __getstate__(self) -> dict:
        return {"layers": self.layers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layers"])

    def say(self, key: str) -> None:
        if key not in self.said:
            self.said.add(key)
            logger.warning("fusepatch: CUDA graphs: some calls run without graphs: %s", FIXES[key])

    def call(self, index: int, forward: Callable[..., Any], layer: torch.nn.Module, args: tuple, kwargs: dict):
        """Layer ``index``'s call: replayed when its step was captured, else run as usual (and recorded)."""
        if self.disabled:  # turned off for good: no signature to take (it walks the layer's modules) at each call
            return forward(layer, *args, **kwargs)
        signature, reason, hidden, cos, sin, rest, params = _signature(layer, args, kwargs)
        if signature is None:
            if reason:
                self.say(reason)
            return forward(layer, *args, **kwargs)
        if index == 0:
            self._step_starts(signature)
        if len(self.current) == index:  # layers called out of order (or twice) belong to no step
            self.current.append(signature)
        graphed = self.active
        if graphed is not None and index < len(self.previous) and self.previous[index] == signature:
            # checked here, layer by layer, rather than for every layer when the step starts: by now the GPU is
            # busy with the layers before, so the walk over the parameters costs the step nothing
            if _reads(params, self.patched[index]) == self.params[index]:
                return graphed[index](hidden, cos, sin).clone()  # the output buffer is rewritten by the next replay
            self._drop()  # moved, replaced, frozen or re-quantized since the capture; the layers before replayed theirs
        out = forward(layer, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            self.say("output")
            self.disabled = True
            return out
        self.recorded[index] = (rest, forward)
        return out

    def _drop(self) -> None:
        """Parameters changed since the capture: no graph replays until the layers are steady and captured again."""
        self.graphs.clear()
        self.active = None
        self.steady = min(self.steady, 1)

    def _step_starts(self, signature: tuple) -> None:
        """Layer 0's call closes the step before: count the steady steps, and capture once ``WARM_CALLS`` steps in
        a row had this step's signatures."""
        last = tuple(self.current) if len(self.current) == len(self.layers) else None
        self.current = []
        if last is not None and last == self.previous:
            self.steady += 1
        else:
            self.previous, self.steady = last, (1 if last is not None else 0)
        wanted = (
            last is not None
            and signature == last[0]
            and self.steady >= WARM_CALLS
            and last not in self.graphs
            and len(self.graphs) < MAX_CAPTURES
            and len(self.recorded) == len(self.layers)
        )
        if wanted:
            self._capture(last)
        self.active = self.graphs.get(self.previous) if self.previous is not None else None

    def _capture(self, step: tuple) -> None:
        start = time.perf_counter()
        patched = [_patched(layer) for layer in self.layers]
        params = [_reads(layer.parameters(), states) for layer, states in zip(self.layers, patched)]
        if self.graphs and params != self.params:
            self.graphs.clear()  # other shapes' graphs read parameters moved or replaced since (not replayed yet)
        calls, samples = [], []
        for index, layer in enumerate(self.layers):
            rest, forward = self.recorded[index]
            calls.append(_Call(layer, forward, rest))
            samples.append(tuple(_sample(meta) for meta in step[index][:3]))
        self.recorded.clear()  # the recorded calls' tensors are not kept past the capture
        cast = step[0][4]
        device = step[0][0][2]
        # autocast's cast cache cannot live in a graph; the parameters are in the autocast dtype (checked)
        region = torch.autocast(device.type, dtype=cast, cache_enabled=False) if cast else contextlib.nullcontext()
        try:
            with region:
                graphed = _capture_stack(calls, samples, device)
                _check(calls[0], graphed[0], samples[0])
        except Exception as exc:  # any kernel that cannot be captured: the layers run as before, and say why
            self.disabled = True
            logger.warning(
                "fusepatch: CUDA graphs: the capture of the decoder layers failed (%s: %s); they run without "
                "graphs from now on. Fix: if a kernel named here waits for the host or runs on its own stream, "
                "leave cuda_graphs off and report it",
                type(exc).__name__,
                (str(exc).splitlines() or [""])[0][:300],
            )
            return
        read = [_reads(layer.parameters(), states) for layer, states in zip(self.layers, patched)]
        if read != params:  # the capture's forward prepared a frozen weight anew: older captures read the old handle
            self.graphs.clear()
        self.graphs[step] = list(graphed)
        self.params, self.patched = read, patched
        shape, dtype = step[0][0][:2]
        logger.info(
            "fusepatch: CUDA graphs: %d decoder layers captured for hidden states %s %s in %.1f s; replayed from "
            "this call on",
            len(self.layers),
            list(shape),
            str(dtype).removeprefix("torch."),
            time.perf_counter() - start,
        )


class _CudaGraph:
    """One function captured as a CUDA graph: replays rewrite the tensors its capture returned."""

    def __init__(self, pool) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn: Callable[[], tuple], stream) -> tuple:
        with torch.cuda.graph(self.graph, pool=self.pool, stream=stream):
            self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        self.graph.replay()


class _Rerun:
    """A stand-in for :class:`_CudaGraph` off the GPU (the tests): a replay runs the function again and copies its
    results into the tensors its capture returned, which is what a replay leaves there."""

    def __init__(self, pool) -> None:
        pass

    def capture(self, fn: Callable[[], tuple], stream) -> tuple:
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        with torch.enable_grad():  # as captured (a replay happens inside an autograd function's forward)
            rerun = self.fn()
        for kept, new in zip(self.outputs, rerun):
            if kept is not None:
                kept.copy_(new)


GRAPH: type = _CudaGraph  # the tests put _Rerun here to run the capture's logic on the CPU
WARMUP = 2  # uncaptured runs of every layer's forward and backward on the capture stream before the capture


class _LayerGraph:
    """One layer's forward and backward graphs and their static buffers."""

    def __init__(self, call: _Call, sample: tuple) -> None:
        self.call = call
        self.hidden, self.cos, self.sin = (t.detach().clone().requires_grad_(t.requires_grad) for t in sample)
        # fresh leaves over the parameters' memory: the backward capture must not reach the parameters' own
        # gradient accumulators, which an earlier step's autograd graph still held by the caller (a loop's last
        # loss) ties to the stream that step ran on, where a capture cannot wait
        self.aliases = [p.detach().requires_grad_(True) for p in call.params]
        self.inputs = ([self.hidden] if self.hidden.requires_grad else []) + self.aliases
        self.out: torch.Tensor | None = None

    def run_forward(self) -> tuple:
        self.out = self.call.run(self.hidden, self.cos, self.sin, self.aliases)
        return (self.out,)

    def run_backward(self) -> tuple:
        if not self.inputs:  # nothing here needs a gradient (a frozen layer over a frozen embedding)
            return ()
        grads = torch.autograd.grad((self.out,), self.inputs, (self.grad_out,), allow_unused=True)
        return tuple(grads)


class _Replay(torch.autograd.Function):
    """A layer replayed: its inputs copied into the graph's, the forward graph replayed; in the backward, the
    output's gradient copied in and the backward graph replayed. Gradients leave as copies: a parameter's
    ``.grad`` may keep the tensor it is given (gradient accumulation would then add into the graph's buffer)."""

    @staticmethod
    def forward(ctx, graph: _LayerGraph, hidden, cos, sin, *params):
        for static, given in ((graph.hidden, hidden), (graph.cos, cos), (graph.sin, sin)):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        graph.fwd.replay()
        ctx.graph = graph
        return graph.fwd.outputs[0].detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        graph = ctx.graph
        graph.grad_out.copy_(grad_out)
        graph.bwd.replay()
        grads = [g.clone() if g is not None else None for g in graph.bwd.outputs]
        hidden = grads.pop(0) if graph.hidden.requires_grad else None
        return (None, hidden, None, None, *grads)


class _Replayed:
    def __init__(self, graph: _LayerGraph) -> None:
        self.graph = graph

    def __call__(self, hidden, cos, sin) -> torch.Tensor:
        return _Replay.apply(self.graph, hidden, cos, sin, *self.graph.call.params)


def _capture_stack(calls: list[_Call], samples: list[tuple], device: torch.device) -> list[_Replayed]:
    """Every layer's forward graph in call order, then every backward graph in reverse, in one memory pool: the
    order a training step replays them in, so that no replay rewrites memory another still needs."""
    graphs = [_LayerGraph(call, sample) for call, sample in zip(calls, samples)]
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    pool = torch.cuda.graph_pool_handle() if cuda else None
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for _ in range(WARMUP):  # kernels' first launches (lazy loads, allocator growth) outside the capture
            for graph in graphs:
                graph.grad_out = None
                (out,) = graph.run_forward()
                graph.grad_out = torch.ones_like(out)
                graph.run_backward()
        for graph in graphs:
            graph.out, graph.grad_out = None, None
        for graph in graphs:
            graph.fwd = GRAPH(pool)
            (out,) = graph.fwd.capture(graph.run_forward, stream)
            graph.grad_out = torch.empty_like(out)
        for graph in reversed(graphs):
            graph.bwd = GRAPH(pool)
            graph.bwd.capture(graph.run_backward, stream)
    if cuda:
        torch.cuda.current_stream(device).wait_stream(stream)
    return [_Replayed(graph) for graph in graphs]


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _draw(shape: tuple, device: torch.device, scale: float) -> torch.Tensor:
    """Random values from a generator of its own: the capture leaves the user's random streams (dropout, data
    order) where they were, so a seeded run draws the same numbers with graphs as without."""
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    return torch.randn(shape, device=device, generator=generator) * scale


def _sample(meta: tuple) -> torch.Tensor:
    """A capture input of a recorded signature: values do not matter to the graph, only shape and layout."""
    shape, dtype, device, requires_grad = meta
    return _draw(shape, device, 0.02).to(dtype).requires_grad_(requires_grad)


CHECK_TOL = 1e-2  # relative (norm) difference of the check: the same kernels on the same input, expected 0


def _check(call: torch.nn.Module, graphed: Callable, sample: tuple) -> None:
    """The first layer's replay against its own forward on a new input of unit scale: a capture that baked in a
    host-side choice or reads a stale buffer shows here, before any step uses it."""
    hidden = sample[0]
    inputs = [_draw(hidden.shape, hidden.device, 1.0).to(hidden.dtype).requires_grad_(hidden.requires_grad)]
    inputs += sample[1:]
    with torch.no_grad():
        want = call(*inputs).float()
        got = graphed(*inputs).float()
    off = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not off <= CHECK_TOL:  # also NaN
        raise RuntimeError(
            f"the first layer's graph replay differs from its forward by {off:.3g} (relative norm, bound {CHECK_TOL})"
        )


def sharded(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether FSDP2 shards a layer's parameters (gathered anew each step: no graph can keep them)."""
    return any(type(p).__name__ == "DTensor" for p in params)


def _signature(layer: torch.nn.Module, args: tuple, kwargs: dict):
    """``(signature, None, hidden, cos, sin, other kwargs, the layer's parameters)`` for a call the graphs may
    take, else ``(None, reason or None, ...)``: a reason for the calls a user should hear about, None for the ones
    that run as usual silently (inference, tracing)."""
    none = (None, None, None, None, None, None, None)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        return none
    if not (torch.is_grad_enabled() and layer.training) or torch.compiler.is_compiling():
        return none
    if hidden.device.type not in DEVICES:  # a training step off the GPU: said once, it may be the whole run
        return (None, "device", *none[2:])
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():  # inside a capture (ours, or the caller's)
        return none
    if getattr(layer, "gradient_checkpointing", False):
        return (None, "checkpointing", *none[2:])
    # the layer's own hooks run around this forward at every call, graphed or not; its modules' would run once
    if any(hooked(module) for module in layer.modules() if module is not layer):
        return (None, "hooks", *none[2:])
    params = list(layer.parameters())  # one walk for every check below and the replay's
    if sharded(params):
        return (None, "sharded", *none[2:])
    cast = autocast_dtype(hidden)
    if cast is not None and any(p.is_floating_point() and p.dtype != cast for p in params):
        return (None, "autocast", *none[2:])
    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    table = rest.pop("position_embeddings", None)
    if len(args) > 1 or not (isinstance(table, tuple) and len(table) == 2):
        return (None, "packed", *none[2:])
    cos, sin = table
    if any(rest.get(name) is not None for name in CACHE_NAMES):
        return (None, "cached", *none[2:])
    # positions fusepatch's loss made: the call was given no positions, mask or cache, so its rows hold one
    # document each, and a mask transformers built for it (the causal one) depends on the shape alone
    made = is_plain(rest.get("position_ids"))
    plain = {}
    for name, value in rest.items():
        if name in IGNORED:
            continue
        if name == "position_ids" and made:
            plain[name] = (tuple(value.shape), value.device)
        elif name == "attention_mask" and made and isinstance(value, torch.Tensor):
            plain[name] = (tuple(value.shape), value.dtype)
        elif value is None or isinstance(value, (bool, int, float, str)):
            plain[name] = value
        else:  # positions of documents, a padding mask, a cache, or an argument this layer does not know
            return (None, "packed", *none[2:])
    signature = (_meta(hidden), _meta(cos), _meta(sin), tuple(sorted(plain.items())), cast)
    return signature, None, hidden, cos, sin, rest, params


def status(model: torch.nn.Module) -> dict | None:
    """What ``apply(cuda_graphs=True)`` holds for ``model``: step shapes captured, layers under graphs, whether
    they turned themselves off; None when the model has no layer graphs."""
    holders = {id(h[0]): h[0] for m in model.modules() if (h := m.__dict__.get(ATTRIBUTE))}
    if not holders:
        return None
    return {
        "captures": sum(len(h.graphs) for h in holders.values()),
        "layers": sum(len(h.layers) for h in holders.values()),
        "disabled": any(h.disabled for h in holders.values()),
    }


def drop(model: torch.nn.Module) -> None:
    """The graphs of ``model`` dropped: its layers were patched anew or reverted in part since the capture (what a
    replay would run is not what the layers run now); they are captured again once the steps are steady."""
    for module in model.modules():
        held = module.__dict__.get(ATTRIBUTE)
        if held is not None:
            held[0]._drop()


def install(layers: list[torch.nn.Module]) -> LayerGraphs:
    """Attach one :class:`LayerGraphs` to ``layers`` (a model's decoder stack, in call order)."""
    graphs = LayerGraphs(layers)
    for index, layer in enumerate(layers):
        layer.__dict__[ATTRIBUTE] = (graphs, index)
    return graphs
