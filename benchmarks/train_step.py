"""One training step (fwd + bwd + AdamW) of a Qwen3.5 model at real layer shapes, timed and profiled.

Run one configuration per process (the driver, ``run_all.py``, does that):

    python benchmarks/train_step.py --config fusepatch --shape 27b --json-out result.json

Configurations: ``eager`` (transformers' reference paths; the caller makes fla/causal-conv1d unimportable),
``hf-fast`` (transformers with fla + causal-conv1d importable, no fusepatch), ``fusepatch`` (the same plus
``fusepatch.apply``). Reports the median step time of ``--steps`` timed steps after ``--warmup`` steps,
tokens/s, peak memory, and from one profiled step: aten ops dispatched, GPU kernels, GPU busy fraction.

``--vary-seq F`` gives every timed step its own length, drawn from ``[seq * (1 - F), seq]`` (the same draws for
every configuration), as packed rows of a fine-tuning run have: a kernel that compiles or autotunes per size
shows up in the step times (the fixed-length tables cannot show it; the H200 run of 2026-11-29). tokens/s is then
all timed tokens over all timed step time, and the slowest step is reported beside the median.

``--prompt F`` sets the first F of every row's labels to -100 (chat SFT's masked prompt: fusepatch's loss then
runs on the labelled rows only; transformers' runs on every row).

``--packed-docs K`` packs every row with K documents of random lengths (``position_ids`` restarting at 0, new
cut points every step, the same for every configuration), as padding-free SFT batches are: transformers then
builds a block-causal mask for sdpa, and fusepatch routes full attention to its varlen kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_clocks import ClockSampler  # noqa: E402
from host_load import HostLoad  # noqa: E402
from shapes import SHAPES, build_config  # noqa: E402

from fusepatch.compiles import CompileCounter  # noqa: E402
from fusepatch.profile import (  # noqa: E402
    flops_per_token,
    host_waits,
    in_backward,
    label_layers,
    registry_modules,
    summarize,
)

PEAK_TFLOPS = 790.0  # bf16 dense, measured on this workplace's H200s (device KINDS.md)


def _versions() -> dict:
    import importlib.metadata as md

    found = {}
    for name in (
        "torch",
        "triton",
        "transformers",
        "fla-core",
        "causal-conv1d",
        "tilelang",
        "liger-kernel",
        "fusepatch",
    ):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def gpu_time_by_op(events, top: int = 40) -> list[tuple[str, float]]:
    """GPU time by the aten op that launched it, as "parent op > op | kernel": which calls the copy, fill and
    reduction kernels of the kernel table come from (kernels launched outside any aten op, Triton's, are not here)."""
    totals: Counter[str] = Counter()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU and event.kernels:
            parent = event.cpu_parent.name if event.cpu_parent is not None else "-"
            for launched in event.kernels:
                totals[f"{parent} > {event.name} | {launched.name[:60]}"] += launched.duration / 1000.0
    return [(key, round(ms, 3)) for key, ms in totals.most_common(top)]


# A/B knobs of the benchmark only, each turning one fusepatch mechanism off for a comparison row: environment
# variable -> (module, attribute, value set before apply).
AB_KNOBS = {
    # the shared-input projections (one accumulated input gradient) and the residual GEMM off, every projection
    # through its module as in hf-fast (H200 run of 2026-11-30: the same GEMM kernels took ~3.5% longer in fusepatch's step)
    "BENCH_PLAIN_PROJECTIONS": ("fusepatch.layers.projections", "DEVICES", ()),
    # the forward's packed-rows checks read the GPU as before (transformers' `.all()`, fusepatch's `nonzero`), for
    # batches given no positions (layers/positions.py)
    "BENCH_KEEP_SYNCS": ("fusepatch.layers.positions", "ENABLED", False),
    # the rotary cos/sin of plain positions recomputed every step, as transformers does (layers/rotary_embedding.py)
    "BENCH_NO_ROPE_TABLES": ("fusepatch.layers.rotary_embedding", "ENABLED", False),
    # the delta rule's q/k/w/g gradients at fla's own tiling (ops/dqkwg.py)
    "BENCH_FLA_DQKWG": ("fusepatch.ops.dqkwg", "ENABLED", False),
    # fla's functions through its per-call backend dispatch, as fla exports them (ops/fla_direct.py)
    "BENCH_FLA_DISPATCH": ("fusepatch.ops.fla_direct", "ENABLED", False),
    # causal-conv1d through the package's function and its torch.library custom ops (ops/causal_conv1d.py)
    "BENCH_CONV_CUSTOM_OPS": ("fusepatch.ops.causal_conv1d", "DIRECT", False),
    # the labelled-row count queued before the forward, not after the first decoder layer (layers/causal_lm.py)
    "BENCH_COUNT_FIRST": ("fusepatch.layers.causal_lm", "COUNT_AFTER_FIRST_LAYER", False),
    # the delta rule's per-token inputs and their gradients through fla's functions (ops/fla_saved_states.py)
    "BENCH_GDN_INPUTS_FLA": ("fusepatch.ops.fla_saved_states", "FUSED_INPUTS", False),
}


class HostPauses:
    """What else stalls the host during the timed steps: Python's garbage collections (count and time by
    generation, from ``gc.callbacks``) and the CUDA caching allocator's device allocations (``cudaMalloc`` calls,
    and retries that free cached blocks, which waits for the GPU). In a steady state both should be ~0 a step; a
    step that still allocates device memory, or collects generation 2, pays it while the GPU may be waiting."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.collections = Counter()
        self.seconds = Counter()
        self._started = 0.0
        self._before: dict = {}

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def _allocator(self) -> dict:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}

    def __enter__(self) -> HostPauses:
        self._before = self._allocator()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
        after = self._allocator()
        self.allocator = {key: after[key] - self._before[key] for key in after}

    def summary(self, steps: int) -> dict:
        return {
            "gc_collections": {str(g): n for g, n in sorted(self.collections.items())},
            "gc_ms": {str(g): round(s * 1000, 2) for g, s in sorted(self.seconds.items())},
            "allocator_over_timed_steps": self.allocator,
            "timed_steps": steps,
        }


def back_to_back(step, lengths: list[int], batch: int, sync, prefix: str = "b2b") -> dict:
    """The same steps again with no host wait between them: each step's time from CUDA events recorded between
    steps, i.e. from the GPU finishing the step before to it finishing this one. The timed loop above waits for
    the GPU before and after every step, so each of its steps starts on an empty queue and the GPU idles while
    the CPU queues the step's first kernels; here the CPU queues the next step while the GPU still runs this one,
    unless a read of the GPU inside the step (a ``.item()``, a ``nonzero``) makes it wait for everything queued.
    One step first, untimed: it starts from an empty queue as the synced ones do. ``trainer_loop`` passes a step
    that waits where transformers' Trainer waits."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(lengths) + 2)]
    losses = []
    sync()
    marks[0].record()
    step(lengths[0])
    for mark, length in zip(marks[1:], lengths):
        mark.record()
        losses.append(step(length).detach())
    marks[-1].record()
    sync()
    times = [marks[i].elapsed_time(marks[i + 1]) / 1000.0 for i in range(1, len(marks) - 1)]
    median = statistics.median(times)
    return {
        f"{prefix}_step_ms": [round(t * 1000, 2) for t in times],
        f"{prefix}_median_step_ms": round(median * 1000, 2),
        # tokens over the steps' summed time (one length: the same as tokens over the median, within noise)
        f"{prefix}_tokens_per_s": round(batch * sum(lengths) / sum(times), 1),
        f"{prefix}_median_tokens_per_s": round(batch * statistics.median(lengths) / median, 1),
        f"{prefix}_losses": [round(float(x), 4) for x in losses],
    }


@contextlib.contextmanager
def passive_hooks(pre=(), post=()):
    """Forward pre-hooks and hooks, ``(module, hook)`` pairs, for one more step, removed after it. Marked passive:
    fusepatch's fused paths, which step aside for a hook, ignore them (fusepatch.profile's labels are so too), so
    the step runs what the timed ones run."""
    handles = []
    try:
        for module, hook in pre:
            hook._fusepatch_passive = True
            handles.append(module.register_forward_pre_hook(hook))
        for module, hook in post:
            hook._fusepatch_passive = True
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def memory_by_phase(step, length: int, sync, body=None, allocated=None, peak=None, reset=None) -> dict:
    """Which phase of the step holds its peak memory: one more step, untimed, with the allocator's peak reset at
    every phase boundary (``step``'s ``at`` callback, and the end of ``body``'s forward: the decoder stack, before
    the ``lm_head`` and the loss), so that each phase's peak and what is still allocated at its end (GiB) are read
    apart: ``layers`` (every saved activation), ``loss`` (the rest of the forward: fusepatch's fused loss holds one
    chunk's logits beside the ``lm_head`` weight gradient it makes in the forward), ``backward`` (the gradients as
    they accumulate), ``optimizer``. Issue 4 holds the whole step's peak to Liger's; this says which phase to cut.
    Without ``body`` the first phase is ``forward``. ``allocated``/``peak``/``reset`` default to torch.cuda's."""
    allocated = allocated or torch.cuda.memory_allocated
    peak = peak or torch.cuda.max_memory_allocated
    reset = reset or torch.cuda.reset_peak_memory_stats
    phases: dict[str, dict[str, float]] = {}

    def at(phase: str) -> None:
        sync()
        phases["loss" if phase == "forward" and "layers" in phases else phase] = {
            "peak_gib": round(peak() / 2**30, 2),
            "end_gib": round(allocated() / 2**30, 2),
        }
        reset()

    def layers_done(module, args, output) -> None:
        at("layers")

    with passive_hooks(post=[(body, layers_done)] if body is not None else []):
        sync()
        reset()
        start = round(allocated() / 2**30, 2)
        step(length, at=at)
    return {
        "memory_by_phase": {"start_gib": start, **phases},
        "peak_phase": max(phases, key=lambda name: phases[name]["peak_gib"]) if phases else None,
    }


class CudaTimeline:
    """The GPU side of ``host_time_by_phase``: a sleep kernel of about ``ms`` (its cycles calibrated once against
    CUDA events: the SM clock moves with the power cap), timing events, and whether the GPU has passed one."""

    def __init__(self) -> None:
        self.cycles_per_ms: float | None = None

    def sleep(self, ms: float) -> None:
        if self.cycles_per_ms is None:
            start = self.mark()
            torch.cuda._sleep(10_000_000)
            end = self.mark()
            end.synchronize()
            self.cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
        torch.cuda._sleep(int(ms * self.cycles_per_ms))

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def between(start, end) -> float:
        return start.elapsed_time(end)

    @staticmethod
    def passed(event) -> bool:
        return event.query()


def host_time_by_phase(
    step, length: int, sync, body=None, layers=(), sleep_ms: float = 1000.0, gpu=None, clock=None
) -> dict:
    """The CPU's time to queue each phase of a step beside the GPU's time to run it, from one more step whose
    phases are each queued behind a GPU sleep. While the GPU sleeps, the host clock across a phase is the CPU's
    work alone, and the CUDA events around it the GPU's work alone (all of it queued before the GPU got there). A
    phase whose host time exceeds its GPU time is CPU-bound: in a step that starts on an empty queue (the synced
    timing; a Trainer step after its host wait) the GPU idles for about the difference, which the profiler's idle
    time shows inflated by its own overhead. Phases: with ``body`` (the decoder stack), ``preamble`` (the model's
    work before it: not behind a sleep, so that what the loss later reads of it, fusepatch's labelled-row count,
    is ready; host time only), ``layers``, ``loss`` (the rest of the forward), ``backward``, ``optimizer``;
    without, ``forward`` first. A phase is ``clean`` when the GPU was still asleep as the CPU finished queuing it;
    else the launch queue filled or the phase read the GPU, and its times include that wait. ``layers``: modules
    whose forward host time is summed by class (passive hooks: fused paths run as in the timed steps; a class's
    time includes the classes inside it)."""
    gpu = gpu or CudaTimeline()
    clock = clock or time.perf_counter
    phases: dict[str, dict] = {}
    by_layer: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    entered: dict[int, float] = {}
    state: dict = {}
    spans: dict[str, tuple] = {}

    def begin(asleep: bool) -> None:  # the next phase: behind a fresh sleep, or (the preamble) straight on
        if asleep:
            gpu.sleep(sleep_ms)
        state.update(mark=gpu.mark() if asleep else None, since=clock())

    def at(phase: str) -> None:
        took = clock() - state["since"]
        clean = state["mark"] is None or not gpu.passed(state["mark"])
        name = "loss" if phase == "forward" and "layers" in phases else phase
        # the events' times are read after the step: an event the GPU has not reached has none yet
        spans[name] = (state["mark"], gpu.mark())
        phases[name] = {"host_ms": round(took * 1000, 2), "gpu_ms": None, "clean": clean}
        begin(asleep=True)

    def pre(module, args) -> None:
        if not in_backward():  # not an activation checkpoint's recomputation in the backward
            entered[id(module)] = clock()

    def post(module, args, output) -> None:
        began = entered.pop(id(module), None)
        if began is not None:
            by_layer[type(module).__name__] += clock() - began
            calls[type(module).__name__] += 1

    def stack_starts(module, args) -> None:
        at("preamble")

    def stack_ends(module, args, output) -> None:
        at("layers")

    stack = [body] if body is not None else []
    with (
        passive_hooks(
            pre=[(m, pre) for m in layers] + [(m, stack_starts) for m in stack],
            post=[(m, post) for m in layers] + [(m, stack_ends) for m in stack],
        ),
        count_in_preamble(),
    ):
        sync()
        gpu.sleep(0.0)  # calibrates, outside the measured step
        sync()
        begin(asleep=body is None)
        step(length, at=at)
        sync()
    for name, (start, end) in spans.items():
        if start is not None:
            phases[name]["gpu_ms"] = round(gpu.between(start, end), 2)
    return {
        "host_vs_gpu": {
            "phases": phases,
            "forward_host_by_layer_ms": {
                name: [round(seconds * 1000, 2), calls[name]] for name, seconds in by_layer.most_common()
            },
        }
    }


@contextlib.contextmanager
def count_in_preamble():
    """fusepatch's labelled-row count queued before the forward for this measurement only: it is queued after the
    first decoder layer (layers/causal_lm.py), which here is behind the layers phase's GPU sleep, and the loss
    phase would then wait out that sleep to read it (the 2026-12-02 H200 run's rows showed 330-680 ms of "loss" host time)."""
    causal_lm = sys.modules.get("fusepatch.layers.causal_lm")
    if causal_lm is None:  # a configuration without fusepatch
        yield
        return
    before = causal_lm.COUNT_AFTER_FIRST_LAYER
    causal_lm.COUNT_AFTER_FIRST_LAYER = False
    try:
        yield
    finally:
        causal_lm.COUNT_AFTER_FIRST_LAYER = before


def _package(filename: str) -> str:
    """The package a profiled function's code belongs to (``fla``, ``triton``, ``torch``, ...), for totals."""
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins"  # C functions (cProfile names them "~") and generated code
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("site-packages", "dist-packages", "site-fla", "site-tl", "site-local"):
        if anchor in parts[:-1]:
            return parts[parts.index(anchor) + 1].split(".")[0]
    here = next((p for p in ("fusepatch", "benchmarks", "transformers", "torch") if p in parts[:-1]), None)
    return here or "other"


def host_profile(step, length: int, sync, body, sleep_ms: float = 3000.0, gpu=None, top: int = 45) -> dict:
    """Where the CPU's time goes in the forward of the decoder stack (``body``), as Python functions: cProfile
    over one more step's stack forward, queued behind a GPU sleep so that no launch waits for the GPU (the
    forward is what a CPU-bound shape waits on; the backward runs on autograd's thread, which cProfile does not
    see). cProfile adds about a microsecond a Python call, so the times rank; ``host_time_by_phase`` measures.
    ``by_package``: self time summed by the package of each function's code (C functions: ``builtins``)."""
    import cProfile
    import pstats

    gpu = gpu or CudaTimeline()
    profiler = cProfile.Profile()
    state: dict = {}

    def starts(module, args) -> None:
        gpu.sleep(sleep_ms)
        state.update(mark=gpu.mark(), since=time.perf_counter())
        profiler.enable()

    def ends(module, args, output) -> None:
        profiler.disable()
        state["ms"] = (time.perf_counter() - state["since"]) * 1000
        state["clean"] = not gpu.passed(state["mark"])

    with passive_hooks(pre=[(body, starts)], post=[(body, ends)]):
        sync()
        gpu.sleep(0.0)  # calibrates, outside the profiled forward
        sync()
        step(length)
        sync()
    rows = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, self s, total s, callers)}
    by_package: Counter[str] = Counter()
    for (filename, _, _), (_, _, own, _, _) in rows.items():
        by_package[_package(filename)] += own

    def name(key) -> str:
        filename, line, function = key
        return f"{'/'.join(filename.replace(os.sep, '/').split('/')[-2:])}:{line}({function})"

    def ranked(index: int) -> list:
        best = sorted(rows.items(), key=lambda kv: -kv[1][index])[:top]
        return [[name(k), round(v[2] * 1000, 2), round(v[3] * 1000, 2), v[1]] for k, v in best]

    return {
        "host_profile": {
            "forward_ms": round(state.get("ms", 0.0), 2),
            "clean": state.get("clean"),
            "by_package_ms": {k: round(v * 1000, 2) for k, v in by_package.most_common()},
            "self": ranked(2),  # [function, self ms, total ms, calls]
            "total": ranked(3),
        }
    }


def trainer_loop(step, lengths: list[int], batch: int, sync) -> dict:
    """The same steps with the one host wait transformers' Trainer makes in each (5.17 and 5.24 alike): after
    ``training_step`` (forward and backward queued) its ``logging_nan_inf_filter``, on by default, tests the loss
    with ``torch.isnan(loss) or torch.isinf(loss)``, which waits for the backward to finish; the optimizer step
    and the next step's forward are queued after that, so the next step's first launches overlap the optimizer's
    GPU time. The synced timing hides nothing of a step's start, back to back hides it behind the whole previous
    step; this is the loop users of the Trainer run."""
    return back_to_back(lambda length: step(length, wait_after_backward=True), lengths, batch, sync, "trainer")


def gpu_idle_by_op(events, top: int = 30, longest_gaps: int = 40) -> dict:
    """Where the GPU waited inside the profiled step: every gap of at least 1 us between kernels (overlapping
    kernels merged), summed by step phase (the ``bench:`` ranges of ``step``) and by the innermost CPU op, on any
    thread, whose span covers the gap's middle, shown with up to three callers: what the CPU was doing while the GPU
    had nothing queued. ``lead_ms``: from the step's start to its first kernel. ``longest``: the longest gaps in
    step order, [ms from the step's start, us, op]; ``by_window_ms``: idle time per 10 ms of the step. Together they
    say whether the GPU starves once (the step's start, a wait) or all along (a CPU slower than the kernels)."""
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    )
    cpu = [e for e in events if e.device_type != cuda]
    phases = [(e.time_range.start, e.time_range.end, e.name) for e in cpu if e.name.startswith("bench:")]
    ops = [e for e in cpu if not e.name.startswith("bench:")]
    if not kernels or not ops:
        return {}
    gaps, end = [], None
    for start, stop in kernels:
        if end is not None and start - end >= 1.0:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    starts = torch.tensor([e.time_range.start for e in ops], dtype=torch.float64)
    ends = torch.tensor([e.time_range.end for e in ops], dtype=torch.float64)
    spans = ends - starts
    by_op: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    by_phase: Counter[str] = Counter()
    step = next(((a, b) for a, b, n in phases if n == "bench:step"), None)
    origin = step[0] if step else kernels[0][0]
    windows: Counter[int] = Counter()
    named = []
    for begin, stop in gaps:
        middle, length = (begin + stop) / 2, (stop - begin) / 1000.0
        covering = (starts <= middle) & (ends >= middle)
        if bool(covering.any()):
            index = int(torch.where(covering, spans, torch.full_like(spans, float("inf"))).argmin())
            event, chain = ops[index], []
            # three callers up (H200 run of 2026-11-30 read a CPU repeat_interleave in a host-side build as a GPU one in the
            # attention, from "repeat_interleave > repeat_interleave" alone)
            parent = event.cpu_parent
            while parent is not None and len(chain) < 3:
                if not parent.name.startswith("bench:"):
                    chain.insert(0, parent.name[:60])
                parent = parent.cpu_parent
            name = " > ".join([*(chain or ["-"]), event.name[:70]])
        else:
            name = "no op (Python between ops)"
        by_op[name] += length
        counts[name] += 1
        windows[int((begin - origin) // 10_000)] += length
        named.append((stop - begin, begin, name))
        phase = next((n for a, b, n in phases if a <= middle <= b and n != "bench:step"), "outside the phases")
        by_phase[phase] += length
    longest = sorted(sorted(named, reverse=True)[:longest_gaps], key=lambda g: g[1])
    return {
        "gap_ms_total": round(sum(by_op.values()), 3),
        "gaps": len(gaps),
        "lead_ms": round((kernels[0][0] - step[0]) / 1000.0, 3) if step else None,
        "by_phase": {name: round(ms, 3) for name, ms in by_phase.most_common()},
        "by_op": [[name, round(ms, 3), counts[name]] for name, ms in by_op.most_common(top)],
        "longest": [[round((begin - origin) / 1000.0, 3), round(us, 1), name] for us, begin, name in longest],
        "by_window_ms": {f"{10 * w}-{10 * w + 10}": round(ms, 3) for w, ms in sorted(windows.items())},
        "host_waits": host_waits(events, within=step, top=top, skip="bench:"),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, choices=["eager", "hf-fast", "liger", "fusepatch"])
    parser.add_argument("--label", default=None)
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--vary-seq", type=float, default=0.0, help="each timed step's length from [seq*(1-F), seq]")
    parser.add_argument("--packed-docs", type=int, default=0, help="K documents of random lengths in every row")
    parser.add_argument(
        "--prompt", type=float, default=0.0, help="the first F of every row's labels -100, as chat SFT masks prompts"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    spec = SHAPES[args.shape]
    seq, batch = args.seq or spec["seq"], args.batch or spec["batch"]
    result = {
        "config": args.label or args.config,
        "shape": args.shape,
        "seq": seq,
        "batch": batch,
        "versions": _versions(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        result.update(run(args, seq, batch))
    except Exception as exc:  # noqa: BLE001 - a failing configuration is a result, not a crash of the run
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result["traceback"] = traceback.format_exc()[-2000:]
    text = json.dumps(result, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text)
    print(text)
    return 0


def packed_positions(length: int, documents: int, draws: random.Random) -> torch.Tensor:
    """One row's ``position_ids``: ``documents`` documents (fewer if the row is shorter) cut at random points."""
    cuts = sorted(draws.sample(range(1, length), min(documents, length) - 1))
    bounds = [0, *cuts, length]
    return torch.cat([torch.arange(end - start) for start, end in zip(bounds, bounds[1:])])


def cpu_profile(prof, step, sync, activities) -> dict:
    """The CPU side of a step, two ways: aten ops by self CPU time (from the trace already taken) and Python
    functions by self and inclusive time over every thread (one more step traced with Python stacks: the
    backward's Python, custom autograd functions and kernel launchers included, which run on the autograd
    engine's thread). The Python tracer slows Python-heavy code: read the times for ranking."""
    import tempfile
    from collections import defaultdict

    aten = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    with torch.profiler.profile(activities=activities, with_stack=True) as traced:
        sync()
        step()
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        traced.export_chrome_trace(fh.name)
        with open(fh.name) as trace:
            events = json.load(trace)
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")]
    by_thread = defaultdict(list)
    for event in spans:
        event["child"] = 0.0
        by_thread[event["tid"]].append(event)
    own, total, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for event in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            if stack:
                stack[-1]["child"] += event["dur"]
            stack.append(event)
        for event in thread:
            if event["cat"] == "python_function":
                own[event["name"]] += event["dur"] - event["child"]
                total[event["name"]] += event["dur"]
                calls[event["name"]] += 1
    threads = {
        str(t): round(sum(e["dur"] for e in evs if e["cat"] == "cpu_op") / 1000, 1) for t, evs in by_thread.items()
    }

    def rows(values, n):
        ranked = sorted(values.items(), key=lambda kv: -kv[1])[:n]
        return [[name[-110:], round(us / 1000, 2), calls[name]] for name, us in ranked]

    return {
        "cpu_self_by_op": aten,
        "python_self_ms": rows(own, 80),
        "python_total_ms": rows(total, 120),
        "aten_ms_by_thread": threads,
    }


def run(args, seq: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16
    config = build_config(args.shape, args.layers)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    info: dict = {"layers": config.num_hidden_layers, "params": sum(p.numel() for p in model.parameters())}
    if args.config == "liger":  # the peer: hf-fast plus Liger's norms, SwiGLU and fused loss (its rope raises for 3.5)
        import liger_kernel.transformers as liger

        patch = {
            "qwen3_5_text": liger.apply_liger_kernel_to_qwen3_5,
            "qwen3_5_moe_text": liger.apply_liger_kernel_to_qwen3_5_moe,
            "qwen3": liger.apply_liger_kernel_to_qwen3,
        }[config.model_type]
        # Liger's rope raises for Qwen3.5 (partial rotary); where it works (qwen3) the peer gets all of Liger
        patch(rope=not config.model_type.startswith("qwen3_5"), model=model)
    if args.config == "fusepatch":
        import fusepatch

        for knob, (module, attribute, value) in AB_KNOBS.items():
            if os.environ.get(knob):
                setattr(importlib.import_module(module), attribute, value)
        start = time.perf_counter()
        report = fusepatch.apply(model)
        info["apply_s"] = round(time.perf_counter() - start, 1)  # loads + self-tests: first-use compiles
        info["report"] = report.to_dict()["layers"]
        info["fallbacks"] = report.log_lines()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # the same token batches for every configuration, whatever patching drew from the global generators (until
    # the H200 run of 2026-11-30 fusepatch's self-tests drew a cotangent there, so its batches were not hf-fast's and liger's)
    torch.manual_seed(1)

    cuts = random.Random(4321)  # document boundaries of packed rows, the same for every configuration

    def step(length: int = seq, wait_after_backward: bool = False, at=None):
        """One training step; ``at(phase)``, where given, is called at the end of each phase (memory_by_phase)."""
        mark = at or (lambda phase: None)

        ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
        labels = ids
        if args.prompt:  # the same positions for every configuration
            labels = ids.clone()
            labels[:, : int(args.prompt * length)] = -100
        extra = {}
        if args.packed_docs > 1:
            rows = [packed_positions(length, args.packed_docs, cuts) for _ in range(batch)]
            extra["position_ids"] = torch.stack(rows).to(device)
        # phase ranges: the profiled step's GPU idle time is attributed to them (gpu_idle_by_op)
        with torch.profiler.record_function("bench:step"):
            with torch.profiler.record_function("bench:forward"):
                loss = model(input_ids=ids, labels=labels, use_cache=False, **extra).loss
            mark("forward")
            with torch.profiler.record_function("bench:backward"):
                loss.backward()
            mark("backward")
            if wait_after_backward:  # as the Trainer's NaN/inf filter does (trainer_loop)
                detached = loss.detach()
                bool(torch.isnan(detached) or torch.isinf(detached))
            with torch.profiler.record_function("bench:optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            mark("optimizer")
        return loss

    first = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    sync()
    info["warmup_s"] = time.perf_counter() - first
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    draws = random.Random(1234)  # the same lengths for every configuration
    lengths = [
        draws.randint(max(1, int(seq * (1 - args.vary_seq))), seq) if args.vary_seq else seq for _ in range(args.steps)
    ]
    times, losses = [], []
    builds = CompileCounter()  # Triton kernels built (compiled or loaded from disk) during the timed steps
    builds.install()
    clocks = ClockSampler(device)  # the SM clock and power over the timed steps (gpu_clocks.py says why)
    pauses = HostPauses(device)
    load = HostLoad()  # whether other processes shared the CPU with the timed steps (host_load.py says why)
    try:
        with clocks, pauses, load:
            for length in lengths:
                sync()
                start = time.perf_counter()
                loss = step(length)
                sync()
                times.append(time.perf_counter() - start)
                losses.append(float(loss.detach()))
    finally:
        builds.remove()
    info["gpu_clocks"] = clocks.summary()
    info["host_pauses"] = pauses.summary(len(lengths))
    info["host_load"] = load.summary()
    if device.type == "cuda":
        info.update(back_to_back(step, lengths, batch, sync))
        info.update(trainer_loop(step, lengths, batch, sync))
        # the whole run's peaks so far: memory_by_phase resets the allocator's peak statistics
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        info.update(memory_by_phase(step, seq, sync, body=getattr(model, "model", None)))
        try:  # a diagnostic: its failure must not cost the row what the steps above measured
            info.update(
                host_time_by_phase(step, seq, sync, body=getattr(model, "model", None), layers=registry_modules(model))
            )
        except Exception as exc:  # noqa: BLE001
            info["host_vs_gpu_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if os.environ.get("BENCH_HOST_PROFILE") and getattr(model, "model", None) is not None:
            try:  # the forward's Python by function: what host_vs_gpu says the CPU-bound forward spends
                info.update(host_profile(step, seq, sync, model.model))
            except Exception as exc:  # noqa: BLE001
                info["host_profile_error"] = f"{type(exc).__name__}: {exc}"
    info["triton_builds"] = sum(builds.counts.values())
    info["triton_builds_by_kernel"] = dict(builds.counts.most_common(6))
    median = statistics.median(times)
    tokens = batch * seq
    if args.vary_seq:
        info.update(lengths=lengths, max_step_ms=round(max(times) * 1000, 2))
    if args.packed_docs > 1:
        info["packed_docs"] = args.packed_docs
    if args.prompt:
        info["prompt"] = args.prompt

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Forward aten ops attributed to the registry's layer classes (the same ranges as FusePatchCallback): run at
    # two sequence lengths, this shows which layers' op counts grow with the length and which do not.
    with label_layers(model), torch.profiler.profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        step()
        sync()
        window = time.perf_counter() - start
    if os.environ.get("BENCH_CPU_PROFILE"):  # where the CPU's time goes, for shapes the CPU holds back
        info.update(cpu_profile(prof, step, sync, activities))
    # The same trace arithmetic as FusePatchCallback (fusepatch.profile), over the profiled step's wall time.
    # every kernel's total, so the recorded top 60 can be read against the step's whole GPU time
    profiled = summarize(prof.events(), step=0, wall_s=window, tokens=tokens, flops=None, peak_tflops=None, top=10**6)
    if args.vary_seq:  # every step its own size: all tokens over all time, FLOPs per step at its length
        rate = batch * sum(lengths) / sum(times)
        flops_per_s = sum(flops_per_token(model, n) * batch * n for n in lengths) / sum(times)
    else:
        rate = tokens / median
        flops_per_s = flops_per_token(model, seq) * tokens / median
    flops = flops_per_token(model, seq) * tokens
    info.update(
        step_ms=[round(t * 1000, 2) for t in times],
        median_step_ms=round(median * 1000, 2),
        tokens_per_s=round(rate, 1),
        peak_mem_gib=round(max(peaks[0], torch.cuda.max_memory_allocated()) / 2**30, 2)
        if device.type == "cuda"
        else None,
        # reserved: the caching allocator's whole holding, CUDA-graph memory pools included (their blocks are
        # not "allocated" between replays, so the allocated peak alone would hide them)
        peak_reserved_gib=round(max(peaks[1], torch.cuda.max_memory_reserved()) / 2**30, 2)
        if device.type == "cuda"
        else None,
        aten_ops_per_step=profiled.cpu_ops,
        gpu_kernels_per_step=profiled.gpu_kernels,
        gpu_busy_fraction=round(profiled.gpu_busy_fraction or 0.0, 3),
        mfu=round(flops_per_s / (PEAK_TFLOPS * 1e12), 3),
        tflop_per_step=round(flops / 1e12, 2),
        losses=[round(x, 4) for x in losses],
        kernel_ms_total=round(sum(ms for _, ms in profiled.top_kernels), 2),
        gpu_ms_by_op=gpu_time_by_op(prof.events()),
        gpu_idle=gpu_idle_by_op(prof.events()) if device.type == "cuda" else {},
        top_kernels_ms=profiled.top_kernels[:60],
        forward_ops_by_layer=profiled.ops_by_layer[:15],
        idle_gaps=profiled.idle_gaps,
    )
    return info


if __name__ == "__main__":
    sys.exit(main())
