"""Diagnostics of one training step, for ``train_step.py``: where the host's and the GPU's time go, phase by
phase, and what stalls them. Each function takes the step as a callable and returns a JSON-ready dict; none of
them times the step that ``train_step.py`` reports.

- ``memory_by_phase``: the allocator's peak after the forward, the backward and the optimizer.
- ``host_time_by_phase`` / ``CudaTimeline``: host time against GPU time per phase and per decoder layer.
- ``host_profile`` / ``cpu_profile``: the forward's Python by function, aten ops by self CPU time.
- ``gpu_idle_by_op`` / ``gpu_time_by_op``: which phase and op the GPU waits in, which aten ops launch its kernels.
- ``HostPauses``: garbage collections and device allocations during the timed steps.
- ``host_syncs``: every point of a step where the host waits for the GPU, by phase and by the code that asked.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import sys
import threading
import time
import traceback
import warnings
from collections import Counter

import torch

from fusepatch.diagnostics.profile import host_waits, in_backward  # noqa: E402


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


SYNC_WARNING = "synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message
_TORCH = os.path.dirname(torch.__file__) + os.sep  # torch's own files: not torchao's, nor torch_*'s


def _site(stack: traceback.StackSummary, depth: int = 3) -> str:
    """The innermost ``depth`` frames of ``stack`` outside torch and the warnings machinery: the code that asked
    for a value of the GPU (``fusepatch/...py:120 fn < transformers/...``)."""
    frames = [f for f in stack if not f.filename.startswith(_TORCH) and "warnings" not in os.path.basename(f.filename)]
    return " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-depth:]))


def _short(filename: str) -> str:
    for marker in ("fusepatch/", "transformers/", "peft/", "fla/", "benchmarks/"):
        if marker in filename:
            return marker + filename.rsplit(marker, 1)[1]
    return os.path.basename(filename)


def host_syncs(step, length: int, sync, top: int = 15) -> dict:
    """Every point of one more step where the host waits for the GPU: the synchronizing CUDA calls torch's sync
    debug mode reports (``.item()``, ``nonzero``, a copy to the host, ...) and explicit device, stream and event
    synchronizes, each by phase (forward, backward with any recomputation, optimizer) and by the code that made it.
    A synced step that waits mid-forward empties the GPU's queue there; the GPU then idles for as long as the host
    takes to queue enough work again."""
    sites: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    state = {"phase": "forward"}
    # inside a wrapped synchronize, per thread: the debug mode's warning from within it (a stream's synchronize
    # warns, c10's stream_synchronize) is that call's own, not a second wait
    inside = threading.local()

    def note(kind: str) -> None:
        phases[state["phase"]] += 1
        sites[f"{state['phase']}: {kind} at {_site(traceback.extract_stack()[:-2])}"] += 1

    def at(phase: str) -> None:
        state["phase"] = {"forward": "backward", "backward": "optimizer"}.get(phase, phase)

    def wrap(owner, name: str, kind: str):
        original = getattr(owner, name)

        @functools.wraps(original)
        def waiting(*args, **kwargs):
            note(kind)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth -= 1

        setattr(owner, name, waiting)
        return owner, name, original

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):
            if not getattr(inside, "depth", 0):
                note("sync op")
        else:
            shown(message, category, filename, lineno, file, line)

    sync()
    allocator_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    previous = torch.cuda.get_sync_debug_mode()
    shown = warnings.showwarning
    wrapped = []
    with warnings.catch_warnings():
        # every sync warning shown, each time (not once per place); other warnings keep their filters
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        warnings.showwarning = show
        try:
            for owner, name, kind in (
                (torch.cuda, "synchronize", "torch.cuda.synchronize"),
                (torch.cuda.Event, "synchronize", "event.synchronize"),
                (torch.cuda.Stream, "synchronize", "stream.synchronize"),
            ):  # one at a time: a wrap that fails leaves the ones before it to be put back
                wrapped.append(wrap(owner, name, kind))
            torch.cuda.set_sync_debug_mode("warn")
            step(length, at=at)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            for owner, name, original in reversed(wrapped):
                setattr(owner, name, original)
    sync()
    return {
        "host_syncs": {
            "by_phase": dict(phases),
            "sites": sites.most_common(top),
            "allocator_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - allocator_before,
        }
    }


@contextlib.contextmanager
def passive_hooks(pre=(), post=()):
    """Forward pre-hooks and hooks, ``(module, hook)`` pairs, for one more step, removed after it. Marked passive:
    fusepatch's fused paths, which step aside for a hook, ignore them (fusepatch.diagnostics.profile's labels are so too), so
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
    phase would then wait out that sleep to read it (the 2026-12-02 H200 run's rows showed 330-680 ms of "loss"
    host time). Replaces the hook that queues it for the duration, and puts it back."""
    causal_lm = sys.modules.get("fusepatch.layers.causal_lm")
    if causal_lm is None:  # a configuration without fusepatch
        yield
        return
    hook = causal_lm._count_after_first_layer

    def count_now(model, rows):
        rows.start()
        return None

    causal_lm._count_after_first_layer = count_now
    try:
        yield
    finally:
        causal_lm._count_after_first_layer = hook


@functools.cache
def _roots() -> dict[str, str]:
    """The folders of the packages named by where they are, not by a folder's name: a checkout's own folder may be
    called ``fusepatch`` (``git clone <repo> fusepatch``) and hold tests and benchmarks that are neither."""
    import transformers

    import fusepatch

    roots = {"fusepatch": fusepatch.__file__, "transformers": transformers.__file__, "torch": torch.__file__}
    roots = {name: os.path.dirname(os.path.abspath(path)) for name, path in roots.items()}
    return {**roots, "benchmarks": os.path.dirname(os.path.abspath(__file__))}


def _package(filename: str) -> str:
    """The package a profiled function's code belongs to (``fla``, ``triton``, ``torch``, ...), for totals."""
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins"  # C functions (cProfile names them "~") and generated code
    path = os.path.abspath(filename)
    for name, root in _roots().items():
        if path.startswith(root + os.sep):
            return name
    parts = path.replace(os.sep, "/").split("/")[:-1]
    anchors = [i for i, part in enumerate(parts[:-1]) if part in SITE_FOLDERS]
    return parts[anchors[-1] + 1].split(".")[0] if anchors else "other"


SITE_FOLDERS = ("site-packages", "dist-packages", "site-fla", "site-tl", "site-local")  # installed packages' parents


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


GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "cublas")  # cuBLAS/CUTLASS matmul kernels on Hopper
OPTIMIZER_NAMES = ("multi_tensor", "adam")  # fused AdamW and the foreach helpers


def kernel_split(kernels: list[tuple[str, float]], rest_terms: int = 8) -> dict:
    """A step's GPU kernel time as GEMMs, the optimizer and the rest (ms), with the rest's largest kernels:
    where a GEMM-bound step's remaining time goes."""
    split = {"gemm_ms": 0.0, "optimizer_ms": 0.0, "rest_ms": 0.0}
    rest = []
    for name, ms in kernels:
        low = name.lower()
        if any(word in low for word in GEMM_NAMES):
            split["gemm_ms"] += ms
        elif any(word in low for word in OPTIMIZER_NAMES):
            split["optimizer_ms"] += ms
        else:
            split["rest_ms"] += ms
            rest.append((name[:120], round(ms, 3)))
    rounded = {k: round(v, 2) for k, v in split.items()}
    return {**rounded, "rest_top": sorted(rest, key=lambda r: -r[1])[:rest_terms]}
