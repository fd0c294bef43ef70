"""A transformers ``TrainerCallback``: apply the patches, log the report, and (opt-in) profile one step.

Steps that are not profiled run as they would without the callback: no device sync and no tensor read back to
the host (either one drains the GPU's queue). The profiled step is logged through the Trainer's own logging
(``state.log_history``, console, and the reporters that run after this callback; ``fusepatch.attach(trainer)``
puts it first so that TensorBoard and W&B see the metrics too).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from fusepatch.base import options
from fusepatch.diagnostics import profile as profiling
from fusepatch.diagnostics.collector import CollectorPauses, LongLivedFreeze
from fusepatch.diagnostics.compiles import CompileCounter, describe
from fusepatch.engine.features.cuda_graphs import decoder_stacks
from fusepatch.engine.patch import apply, report
from fusepatch.engine.plan import check_apply_kwargs
from fusepatch.layers import layer_graphs

logger = logging.getLogger("fusepatch")
GC_NOTE_MS = 1.0  # a profiled step's garbage collections said in its summary from this long


def _patched(model: torch.nn.Module) -> bool:
    return any("_fusepatch" in m.__dict__ for m in model.modules())


def _lacks_precision(model: torch.nn.Module, precision: str | None) -> bool:
    """Whether ``apply_kwargs`` ask for a ``precision`` whose rows patch none of ``model``'s modules yet."""
    wanted = options.precision(precision)
    return wanted is not None and not any(
        "_fusepatch" in m.__dict__ and m.__dict__["_fusepatch"].row.precision == wanted for m in model.modules()
    )


def _mixed_precision(args) -> torch.dtype | None:
    """The dtype the Trainer's mixed precision computes in (``bf16=True`` / ``fp16=True``: autocast)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _keep_autocast(model: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """The Trainer's accelerate wraps ``model.forward`` in autocast when training starts, before this callback
    runs; patching the model's head then replaced that wrapper, and the whole model ran in its weights' dtype
    (fp32 weights: fp32 instead of bf16, seen on CPU with a fused stand-in loss). Put autocast back around the
    patched forward. Returns whether it did."""
    if dtype is None or "_original_forward" not in model.__dict__ or "_fusepatch" not in model.__dict__:
        return False
    patched = model.forward
    device = next((p.device.type for p in model.parameters()), "cpu")

    @functools.wraps(patched)
    def forward(*args, **kwargs):
        with torch.autocast(device, dtype=dtype):
            return patched(*args, **kwargs)

    model.forward = forward
    return True


class _Stopwatch:
    """The time the device took from ``start`` to ``stop``, read without making the host wait for it: CUDA events
    where CUDA runs (read once the GPU has passed the stop), the host clock elsewhere."""

    def __init__(self) -> None:
        self._seconds: float | None = None
        self._stopped = False
        self._events = None
        if torch.cuda.is_available():
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._started = time.perf_counter()

    def stop(self) -> None:
        self._stopped = True
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._started

    def seconds(self, *, wait: bool = False) -> float | None:
        """None before the stop, or while the GPU has not reached it; ``wait``: wait for it (once training is over)."""
        if self._seconds is None and self._events is not None and self._stopped:
            start, end = self._events
            if wait:
                end.synchronize()
            elif not end.query():
                return None
            self._seconds = start.elapsed_time(end) / 1000.0
        return self._seconds


def graphs_advice(model: torch.nn.Module) -> str:
    """For a step whose GPU waited for the host: what CUDA graphs over the decoder layers would do, or why they did
    not; empty where they cannot help (no dense patched decoder stack, activation checkpointing, FSDP2)."""
    found = layer_graphs.status(model)
    if found is not None:
        if found["disabled"]:
            return ". The decoder layers' CUDA graphs turned themselves off (the reason was logged then)"
        if not found["captures"]:
            return (
                ". CUDA graphs are on, but no step was captured: the layers' calls changed shape, or were packed, "
                "padded or cached (each reason is logged once)"
            )
        return ""
    stacks, _ = decoder_stacks(model)
    first = stacks[0][0] if stacks else None
    if first is None or getattr(first, "gradient_checkpointing", False) or layer_graphs.sharded(first.parameters()):
        return ""
    return (
        ". Replaying the decoder layers from CUDA graphs takes the host out of them for fixed-shape batches, so "
        'the GPU stays busy: FusePatchCallback(apply_kwargs={"cuda_graphs": True}), or '
        "fusepatch.apply(model, cuda_graphs=True)"
    )


class FusePatchCallback(TrainerCallback):
    """Apply fusepatch when training begins, log the report, and on request show what a torch trace of one step
    shows.

    By default no step is profiled and no step waits for the device: the first two steps are timed with CUDA
    events (read once the GPU has passed them) to say when the first one compiled kernels.

    Args:
        apply_patches: call ``fusepatch.apply`` on the model if it is not patched yet (or was patched without the
            ``precision`` that ``apply_kwargs`` asks for).
        apply_kwargs: keyword arguments for ``fusepatch.apply`` (``ops``, ``exclude``, ``prefer``, ``strict``,
            ``cuda_graphs``, ``precision``, ``drop_frozen_weights``), checked here as ``apply`` checks them (an
            unknown name or a value it does not take raises what ``apply`` raises). A model patched before the
            callback keeps its patches; only a ``precision`` it lacks is added, and the other arguments are said
            to be unused.
        profile: profile one optimizer step with ``torch.profiler`` (default: only when ``profile_step`` is
            given). What it costs: that step syncs the device at both ends and runs slower, since the profiler
            records every op (a tiny model on CPU: 2.1x the median step); its tokens/s and MFU are measured over
            that step's wall time, so where the profiler's overhead is large they understate the steady rate.
        profile_step: which optimizer step (1-based) to profile (default 5: warm-up and autotuning are behind).
        trace_dir: also write the Chrome trace of that step there.
        peak_tflops: the GPU's peak for MFU; default from the GPU name (datasheet dense bf16), none on CPU.
        time_steps: time every optimizer step for ``steady_state()``: the median over the steps after the first
            two (compiling) and the profiled one (profiler overhead). Off by default: it syncs the device at
            both ends of every step, which drains the GPU's queue each time.
        freeze_gc: after the second optimizer step a run makes (a resumed run's too), collect once and move every
            Python object then alive (the model, the imported packages, compiled kernels) out of the garbage
            collector's later walks (``gc.freeze()``), until training ends. A full collection otherwise walks them
            all while the host enqueues nothing: 376 to 507 ms every 8 steps at Qwen3.5-27B's full depth with LoRA
            on one H100. Where the program had frozen objects itself, all stay frozen after training
            (``gc.unfreeze`` cannot tell them apart); a training that raised leaves its objects frozen until the
            next one begins. The end of training says how long the collector paused either way.

    Example::

        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[FusePatchCallback()])  # doctest: +SKIP
        >>> profiled = FusePatchCallback(profile_step=20, trace_dir="traces")  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        apply_patches: bool = True,
        apply_kwargs: dict | None = None,
        profile: bool | None = None,
        profile_step: int | None = None,
        trace_dir: str | None = None,
        peak_tflops: float | None = None,
        time_steps: bool = False,
        freeze_gc: bool = True,
    ) -> None:
        if profile_step is not None and profile_step < 1:
            raise ValueError(f"profile_step counts optimizer steps from 1, got {profile_step}")
        self.apply_patches = apply_patches
        self.apply_kwargs = dict(apply_kwargs or {})
        if apply_patches:  # what apply would raise at the first step, raised here (a name or value it does not take)
            check_apply_kwargs(self.apply_kwargs)
        self.profile = profile_step is not None if profile is None else profile
        self.profile_step = 5 if profile_step is None else profile_step
        self.trace_dir = trace_dir
        self.peak_tflops = peak_tflops
        self.report = None
        self.last_profile: profiling.StepProfile | None = None
        self._pending: dict[str, float] = {}
        self._seq_len = 0
        self._hook = None
        self._profiler = None
        self._labels = None
        self._start = 0.0
        self.time_steps = time_steps
        self.step_times: dict[int, tuple[float, int]] = {}  # optimizer step -> (wall s, tokens on this rank)
        self._step_start = 0.0
        # tokens of this step, counted only in a timed or profiled step; a padded batch's count stays a device
        # tensor until the step's closing sync
        self._counting = False
        self._step_tokens: int | torch.Tensor = 0
        self._first_steps: dict[int, _Stopwatch] = {}  # steps 1 and 2, until the first step is reported
        # Triton kernel builds per step: after the first two steps they mean sizes that keep changing
        self.compiles = CompileCounter()
        self.late_builds: collections.Counter[str] = collections.Counter()  # builds in steps 3 and later
        self._late_steps = 0
        self._builds_before: collections.Counter[str] = collections.Counter()
        self.freeze_gc = freeze_gc
        self.gc_pauses = CollectorPauses()  # Python's garbage collections during training, by generation
        self._gc_before = self.gc_pauses.total()
        self._freeze = LongLivedFreeze()
        self._steps_run = 0  # optimizer steps ended in this run (a resumed run starts past step 2)

    # -- training begins: patch, report, start counting tokens ---------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._steps_run = 0
        self.gc_pauses.reset()
        thawed = LongLivedFreeze.thaw_abandoned()
        if thawed:
            logger.info(
                "fusepatch: unfroze %s Python objects a training that ended without on_train_end (it raised) had "
                "frozen (gc.freeze) after its second step",
                f"{thawed:,}",
            )
        if model is None:
            return
        # Mixed precision (autocast) over fp32 weights: kernels are chosen and self-tested for the dtype the
        # layers compute in, not for the weights' storage dtype.
        amp = _mixed_precision(args)
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        compute = amp if amp is not None and weights == torch.float32 else None
        patched = _patched(model)
        if self.apply_patches and (not patched or _lacks_precision(model, self.apply_kwargs.get("precision"))):
            # the table is logged once, below; apply itself logs only the fallbacks
            self.report = apply(model, **{"compute_dtype": compute, "verbose": False, **self.apply_kwargs})
            if patched:  # apply added the precision rows to the patched model: the whole model's report
                self.report = report(model, self.apply_kwargs.get("compute_dtype", compute))
            if _keep_autocast(model, amp):
                logger.info("fusepatch: kept the Trainer's %s autocast around the patched forward", amp)
        else:
            unused = sorted(set(self.apply_kwargs) - {"compute_dtype", "verbose"})
            if patched and unused:
                logger.warning(
                    "fusepatch: FusePatchCallback: the model was patched before training began, so apply_kwargs %s "
                    "were not used; fix: pass them to the apply that patched it, or fusepatch.revert(model) first",
                    ", ".join(unused),
                )
            self.report = report(model, self.apply_kwargs.get("compute_dtype", compute))
        logger.info("%s", self.report)
        self._pending.update(
            {"fusepatch/fused_ops": len(self.report.fused_ops), "fusepatch/fallbacks": len(self.report.fallbacks())}
        )
        self._hook = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        self._model = model
        self.compiles.install()
        self.gc_pauses.install()

    def _count_tokens(self, module, args, kwargs):
        if not module.training or not self._counting:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            shape = None if ids is None else ids.shape[:2]
        else:
            shape = ids.shape
        if shape is None:
            return
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            self._step_tokens = mask.sum() + self._step_tokens  # no read: the host would wait for the GPU
        else:
            self._step_tokens += int(shape[0] * shape[-1])
        self._seq_len = int(shape[-1])

    # -- one profiled step -------------------------------------------------------------------------------
    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._builds_before = self.compiles.counts.copy()
        if self._hook is None:
            return
        step = state.global_step + 1
        if step <= 2:
            self._first_steps[step] = _Stopwatch()
        profiled = self.profile and step == self.profile_step
        self._counting = self.time_steps or profiled
        if not self._counting:
            return
        self._sync()  # the step's time and profile start from an empty queue
        self._step_start = time.perf_counter()
        self._step_tokens = 0
        if not profiled:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.reset_peak_memory_stats()
        # the Trainer's torch_compile wraps the model where this callback does not see it
        self._labels = profiling.label_layers(self._model, compiled=bool(getattr(args, "torch_compile", False)))
        self._labels.__enter__()
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._gc_before = self.gc_pauses.total()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._end_step(args, state, control)
        self._steps_run += 1
        if self.freeze_gc and self._steps_run == 2:  # after the step's timing and profile: no part of them
            self._freeze_long_lived()

    def _end_step(self, args, state, control) -> None:
        if state.global_step in self._first_steps:
            self._first_steps[state.global_step].stop()
        self._first_step_timed()
        builds = self.compiles.since(self._builds_before)
        if builds and state.global_step > 2:
            self._late_builds(state.global_step, builds)
        if not self._counting:
            return
        self._counting = False
        self._sync()
        ended = time.perf_counter()
        prof = self._profiler
        if prof is not None:
            prof.__exit__(None, None, None)
            self._labels.__exit__(None, None, None)
            self._profiler = self._labels = None
        tokens = int(self._step_tokens)  # after the sync (nothing left to wait for) and outside the trace
        if self.time_steps:
            self.step_times[state.global_step] = (ended - self._step_start, tokens)
        if prof is None:
            return
        wall = ended - self._start
        peak = self.peak_tflops
        if peak is None and torch.cuda.is_available():
            peak = profiling.peak_tflops_for(torch.cuda.get_device_name())
        flops = profiling.flops_per_token(self._model, self._seq_len) if self._seq_len else None
        result = profiling.summarize(
            prof.events(), step=state.global_step, wall_s=wall, tokens=tokens, flops=flops, peak_tflops=peak
        )
        self.last_profile = result
        self._pending.update(result.metrics())
        summary = result.summary()
        collected = self.gc_pauses.since(self._gc_before)  # a trace shows it only as a gap without ops
        self._pending["fusepatch/gc_ms"] = round(collected.seconds * 1000, 3)
        if collected.seconds * 1000 >= GC_NOTE_MS:
            advice = "" if self.freeze_gc else "; freeze_gc=True keeps the objects alive after step 2 out of its walks"
            summary += (
                f". Python's garbage collector paused the host {collected.seconds * 1000:.0f} ms in this step "
                f"({collected.count} collections, the oldest of generation {collected.oldest}{advice})"
            )
        if result.cpu_bound:
            summary += graphs_advice(self._model)
        if self.compiles.active:
            self._pending["fusepatch/triton_builds"] = sum(builds.values())
            if builds:
                summary += f" During this step: {describe(builds)}."
        (logger.warning if result.cpu_bound or builds else logger.info)("%s", summary)
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            # one file per rank: under torchrun every rank profiles the same step into the same folder
            rank = f"-rank{dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
            path = os.path.join(self.trace_dir, f"fusepatch-step{state.global_step}{rank}.json")
            prof.export_chrome_trace(path)
            logger.info("fusepatch: trace of step %d written to %s", state.global_step, path)
        control.should_log = True  # the Trainer logs right after this step; on_log adds the metrics

    def steady_state(self) -> dict[str, float]:
        """Median step time and tokens/s on this rank over the timed steps after the first two and other than
        the profiled one; empty before there are any."""
        steady = [
            t for step, t in self.step_times.items() if step > 2 and not (self.profile and step == self.profile_step)
        ]
        if not steady:
            return {}
        rates = [tokens / wall for wall, tokens in steady if wall > 0]
        return {
            "steps": len(steady),
            "median_step_s": round(statistics.median(wall for wall, _ in steady), 4),
            "median_tokens_per_s": round(statistics.median(rates), 1) if rates else 0.0,
        }

    def _freeze_long_lived(self) -> None:
        counting = self.gc_pauses.active
        self.gc_pauses.remove()  # its collection is said here, not as a pause of the training's
        started = time.perf_counter()
        frozen = self._freeze.freeze()
        if counting:
            self.gc_pauses.install()
        logger.info(
            "fusepatch: moved %s long-lived Python objects out of the garbage collector's walks after the second "
            "step (gc.freeze, %.0f ms) %s; FusePatchCallback(freeze_gc=False) leaves them in",
            f"{frozen:,}",
            (time.perf_counter() - started) * 1000,
            "until training ends"
            if self._freeze.ours
            else "for good: the program had frozen objects itself, which gc.unfreeze would unfreeze too",
        )

    def _late_builds(self, step: int, builds: collections.Counter[str]) -> None:
        self.late_builds.update(builds)
        self._late_steps += 1
        if self._late_steps == 1:
            logger.warning(
                "fusepatch: step %d made %s after the warm-up steps. A kernel that specializes on a size that "
                "changes from step to step (a packed row's length) is compiled, and autotuned, again for each new "
                "size; the end of training says how often it happened.",
                step,
                describe(builds),
            )

    def _first_step_timed(self, *, wait: bool = False) -> None:
        """Report the first step once the GPU has passed the end of the second (``wait``: wait for it)."""
        if 2 not in self._first_steps or 1 not in self._first_steps:
            return
        second = self._first_steps[2].seconds(wait=wait)
        first = self._first_steps[1].seconds(wait=wait)
        if first is None or second is None:
            return
        self._first_steps.clear()
        self._report_first_step(first, second)

    def _report_first_step(self, first: float, second: float) -> None:
        self._pending["fusepatch/first_step_s"] = round(first, 3)
        if second > 0 and first > 5 * second and first > 10.0:
            logger.warning(
                "fusepatch: the first step took %.0f s, %.0fx the second: compiling and autotuning kernels for these "
                "shapes. Run `python -m fusepatch warmup` at image build time and keep TRITON_CACHE_DIR and "
                "TILELANG_CACHE_DIR in the image to start warm.",
                first,
                first / second,
            )

    # -- logging -------------------------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        self._first_step_timed()
        if not self._pending:
            return
        if logs is not None:
            logs.update(self._pending)
        if state.log_history:
            state.log_history[-1].update(self._pending)
        self._pending.clear()

    def on_train_end(self, args, state, control, **kwargs):
        self._first_step_timed(wait=True)  # training is over: waiting costs nothing
        steady = self.steady_state()
        if steady:
            logger.info(
                "fusepatch: %d steady steps, median %.1f ms, %.0f tokens/s on this rank",
                steady["steps"],
                steady["median_step_s"] * 1000,
                steady["median_tokens_per_s"],
            )
        if self.late_builds:
            logger.warning(
                "fusepatch: %s in %d steps after the first two. Each costs a compile (or a load from the disk "
                "cache) and, for an autotuned kernel, a benchmark of every configuration; if it keeps happening, "
                "that kernel specializes on a size your batches change (report it; fusepatch's own norm, SwiGLU "
                "and rotary kernels do not).",
                describe(self.late_builds),
                self._late_steps,
            )
        self.compiles.remove()
        self.gc_pauses.remove()
        self._freeze.thaw()
        if self.gc_pauses.counts:
            logger.info("fusepatch: Python's garbage collections during training: %s", self.gc_pauses.describe())
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def attach(trainer, callback: FusePatchCallback | None = None) -> FusePatchCallback:
    """Add ``callback`` (a new FusePatchCallback by default) as the Trainer's first callback, so that every
    reporter (TensorBoard, W&B, ...) receives the metrics it adds to the logs."""
    callback = callback or FusePatchCallback()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
