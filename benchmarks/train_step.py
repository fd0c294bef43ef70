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
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_clocks import ClockSampler  # noqa: E402
from host_load import HostLoad  # noqa: E402
from provenance import gpu_name, today, versions  # noqa: E402
from sft_rows import conversations, packed_batch  # noqa: E402
from sft_rows import shape as sample_shape  # noqa: E402
from shapes import SHAPES, build_config  # noqa: E402
from step_diagnostics import (  # noqa: E402
    HostPauses,
    cpu_profile,
    gpu_idle_by_op,
    gpu_time_by_op,
    host_profile,
    host_syncs,
    host_time_by_phase,
    kernel_split,
    memory_by_phase,
)

from fusepatch.diagnostics.compiles import CompileCounter  # noqa: E402
from fusepatch.diagnostics.profile import flops_per_token, label_layers, registry_modules, summarize  # noqa: E402

PEAK_TFLOPS = 790.0  # an H200's dense bf16 matmul peak, for MFU (benchmarks/studies/gemm_bench.py measures a GPU's own)


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


def trainer_loop(step, lengths: list[int], batch: int, sync) -> dict:
    """The same steps with the one host wait transformers' Trainer makes in each (5.17 and 5.24 alike): after
    ``training_step`` (forward and backward queued) its ``logging_nan_inf_filter``, on by default, tests the loss
    with ``torch.isnan(loss) or torch.isinf(loss)``, which waits for the backward to finish; the optimizer step
    and the next step's forward are queued after that, so the next step's first launches overlap the optimizer's
    GPU time. The synced timing hides nothing of a step's start, back to back hides it behind the whole previous
    step; this is the loop users of the Trainer run."""
    return back_to_back(lambda length: step(length, wait_after_backward=True), lengths, batch, sync, "trainer")


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
    parser.add_argument(
        "--sft",
        action="store_true",
        help="packed chat SFT: batch x seq tokens of ultrachat-shaped documents in one flattened row (sft_rows.py)",
    )
    parser.add_argument("--doc-tokens", type=int, default=1024, help="--sft: the documents' mean length")
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA of this rank on every linear (alpha 2r)")
    parser.add_argument("--compile", action="store_true", help="model.compile() after patching (and peft)")
    parser.add_argument(
        "--compile-projections",
        action="store_true",
        help="compile each decoder projection module after patching (torchao's Float8Linear, with --torchao-float8)",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="compile each decoder layer after patching (regional compilation, one compiled code per layer type)",
    )
    parser.add_argument(
        "--graph-layers",
        action="store_true",
        help="replay every decoder layer from CUDA graphs after the warm-up (graph_layers: fixed shapes only)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="fusepatch.apply(model, cuda_graphs=True): the library's own layer graphs (captured at the third step)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp8",),
        help='fusepatch.apply(model, precision="fp8"): the decoder\'s projections with FP8 GEMMs',
    )
    parser.add_argument(
        "--fast-accum",
        action="store_true",
        help="with --precision fp8: the FP8 GEMMs with use_fast_accum=True (benchmarks/fast_accum.py)",
    )
    parser.add_argument(
        "--drop-frozen-weights",
        action="store_true",
        help="with --precision fp8: apply(drop_frozen_weights=True), LoRA's frozen bases kept in FP8 only",
    )
    parser.add_argument(
        "--fp8-lm-head",
        action="store_true",
        help='with --precision fp8: apply(lm_head_precision="fp8"), the LM head\'s GEMMs in FP8 too',
    )
    parser.add_argument(
        "--torchao-float8",
        action="store_true",
        help="torchao's float8 training (rowwise recipe) on the decoder's projections, before any patching",
    )
    parser.add_argument(
        "--default-cache",
        action="store_true",
        help="the model's config with use_cache=True (Qwen3.5's default) and no use_cache in the call, as a plain "
        "training loop runs it: every layer is handed a cache to fill",
    )
    parser.add_argument(
        "--no-diagnostics", action="store_true", help="skip the memory, host and idle views (the profiled step stays)"
    )
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="after the warm-up, gc.freeze() what is alive (what FusePatchCallback does after step 2)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.fast_accum and (args.config != "fusepatch" or args.precision != "fp8"):
        parser.error("--fast-accum: only with --config fusepatch --precision fp8 (fusepatch's FP8 GEMMs)")
    if args.fp8_lm_head and (args.config != "fusepatch" or args.precision != "fp8"):
        parser.error("--fp8-lm-head: only with --config fusepatch --precision fp8")

    spec = SHAPES[args.shape]
    seq, batch = args.seq or spec["seq"], args.batch or spec["batch"]
    result = {
        "config": args.label or args.config,
        "shape": args.shape,
        "seq": seq,
        "batch": batch,
        "versions": versions(),
        "gpu": gpu_name() if torch.cuda.is_available() else platform.processor(),
        "date": today(),
    }
    try:
        result.update(run(args, seq, batch))
    except Exception as exc:  # noqa: BLE001 - a failing configuration is a result, not a crash of the run
        result["error"] = said(exc)
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


def build(args) -> tuple:
    """The model of ``--shape`` in bf16 on ``--device``, patched as ``--config`` says; its optimizer; what
    patching reported."""
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    config = build_config(args.shape, args.layers)
    config.use_cache = args.default_cache  # the shapes' configs say False; Qwen3.5's own configs say True
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    info: dict = {"layers": config.num_hidden_layers, "params": sum(p.numel() for p in model.parameters())}
    if args.lora:  # adapters in the model's dtype, as the Trainer's autocast computes them (one dtype, no autocast)
        import peft

        lora = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", lora_dropout=0.0)
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
        info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if args.torchao_float8:  # the peer a user builds by hand: torchao's float8 training on the same projections
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from fusepatch.layers.fp8 import PROJECTIONS

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("rowwise"),
            module_filter_fn=lambda module, fqn: fqn.rpartition(".")[2] in PROJECTIONS,
        )
    if args.config == "liger":  # the peer: hf-fast plus Liger's norms, SwiGLU and fused loss (its rope raises for 3.5)
        import liger_kernel.transformers as liger

        patch = {
            "qwen3_5_text": liger.apply_liger_kernel_to_qwen3_5,
            "qwen3_5_moe_text": liger.apply_liger_kernel_to_qwen3_5_moe,
            "qwen3": liger.apply_liger_kernel_to_qwen3,
        }[config.model_type]
        # Liger's rope raises for Qwen3.5 (partial rotary); where it works (qwen3) the peer gets all of Liger
        patch(rope=not config.model_type.startswith("qwen3_5"), model=model)
    if args.config == "fusepatch":  # A/B rows: FUSEPATCH_SKIP=op/candidate in the environment (docs/env-vars.md)
        import fusepatch

        if args.fast_accum:  # before apply: the FP8 op's self-test runs the GEMMs the steps will
            from fast_accum import use_fast_accumulation

            use_fast_accumulation()

        start = time.perf_counter()
        report = fusepatch.apply(
            model,
            cuda_graphs=args.cuda_graphs,
            precision=args.precision,
            drop_frozen_weights=args.drop_frozen_weights,
            lm_head_precision="fp8" if args.fp8_lm_head else None,
        )
        info["apply_s"] = round(time.perf_counter() - start, 1)  # loads + self-tests: first-use compiles
        info["report"] = report.to_dict()["layers"]
        info["fallbacks"] = report.log_lines()
    if args.lora and args.config == "fusepatch":
        info["lora"] = report.lora
    if args.compile:
        model.compile()
    if args.compile_layers:  # as torchtitan compiles per transformer block: minutes less than the whole model
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                module.compile()
    if args.compile_projections:  # only the projections: the layers' own kernels (fla, causal-conv1d) stay
        from fusepatch.layers.fp8 import PROJECTIONS

        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS:
                module.compile()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    return model, optimizer, info


def make_step(args, model, optimizer, seq: int, batch: int):
    """``step(length, wait_after_backward, at)``: one training step on fresh tokens, the same for every
    configuration (and, with ``--packed-docs``, the same document boundaries)."""
    device = torch.device(args.device)
    vocab = model.config.vocab_size
    # the same token batches for every configuration, whatever patching drew from the global generators
    torch.manual_seed(1)
    cuts = random.Random(4321)
    sft_draws = random.Random(2468)
    default_cache = args.default_cache

    def step(length: int = seq, wait_after_backward: bool = False, at=None):
        """One training step; ``at(phase)``, where given, is called at the end of each phase (memory_by_phase)."""
        mark = at or (lambda phase: None)
        extra = {}
        if args.sft:  # one flattened row of documents, as TRL's padding-free collator gives it
            packed = packed_batch(batch * length, args.doc_tokens, vocab, sft_draws, device)
            ids, labels = packed.pop("input_ids"), packed.pop("labels")
            extra = {k: v for k, v in packed.items() if k not in ("documents", "labelled")}
        else:
            ids = torch.randint(0, vocab, (batch, length), device=device)
            labels = ids
        if args.prompt:  # the same positions for every configuration
            labels = ids.clone()
            labels[:, : int(args.prompt * length)] = -100
        if args.packed_docs > 1:
            rows = [packed_positions(length, args.packed_docs, cuts) for _ in range(batch)]
            extra["position_ids"] = torch.stack(rows).to(device)
        # phase ranges: the profiled step's GPU idle time is attributed to them (gpu_idle_by_op)
        with torch.profiler.record_function("bench:step"):
            with torch.profiler.record_function("bench:forward"):
                cache = {} if default_cache else {"use_cache": False}
                loss = model(input_ids=ids, labels=labels, **cache, **extra).loss
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

    return step


def timed_steps(step, lengths: list[int], sync, device: torch.device) -> tuple[list[float], list[float], dict]:
    """Each of ``lengths`` as one synced step: the step times, the losses, and what ran beside them (Triton
    builds, GPU clocks, host pauses and load)."""
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
    beside = {
        "gpu_clocks": clocks.summary(),
        "host_pauses": pauses.summary(len(lengths)),
        "host_load": load.summary(),
        "triton_builds": sum(builds.counts.values()),
        "triton_builds_by_kernel": dict(builds.counts.most_common(6)),
    }
    return times, losses, beside


def said(exc: BaseException) -> str:
    """An exception as a result's field holds it: its type and the first line of its message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def diagnostics(step, model, seq: int, sync) -> dict:
    """step_diagnostics.py's memory and host/GPU views of one step each (CUDA only); a failing diagnostic costs
    the row only its own entry."""
    body = getattr(model, "model", None)
    found = memory_by_phase(step, seq, sync, body=body)
    try:
        found.update(host_time_by_phase(step, seq, sync, body=body, layers=registry_modules(model)))
    except Exception as exc:  # noqa: BLE001
        found["host_vs_gpu_error"] = said(exc)
    try:
        found.update(host_syncs(step, seq, sync))
    except Exception as exc:  # noqa: BLE001
        found["host_syncs_error"] = said(exc)
    if os.environ.get("BENCH_HOST_PROFILE") and body is not None:
        try:  # the forward's Python by function: what host_vs_gpu says the CPU-bound forward spends
            found.update(host_profile(step, seq, sync, body))
        except Exception as exc:  # noqa: BLE001
            found["host_profile_error"] = f"{type(exc).__name__}: {exc}"
    return found


def profiled_step(step, model, sync, device: torch.device, tokens: int) -> dict:
    """One step under the profiler, read with the callback's trace arithmetic (fusepatch.diagnostics.profile): aten ops,
    kernels, GPU busy, top kernels, and forward ops by registry layer."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with label_layers(model), torch.profiler.profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        step()
        sync()
        window = time.perf_counter() - start
    found = {}
    if os.environ.get("BENCH_CPU_PROFILE"):  # where the CPU's time goes, for shapes the CPU holds back
        found.update(cpu_profile(prof, step, sync, activities))
    # every kernel's total, so the recorded top 60 can be read against the step's whole GPU time
    profiled = summarize(prof.events(), step=0, wall_s=window, tokens=tokens, flops=None, peak_tflops=None, top=10**6)
    found.update(
        aten_ops_per_step=profiled.cpu_ops,
        gpu_kernels_per_step=profiled.gpu_kernels,
        gpu_busy_fraction=round(profiled.gpu_busy_fraction or 0.0, 3),
        kernel_ms_total=round(sum(ms for _, ms in profiled.top_kernels), 2),
        gpu_ms_by_op=gpu_time_by_op(prof.events()),
        gpu_idle=gpu_idle_by_op(prof.events()) if device.type == "cuda" else {},
        top_kernels_ms=profiled.top_kernels[:60],
        kernel_split=kernel_split(profiled.top_kernels),
        forward_ops_by_layer=profiled.ops_by_layer[:15],
        idle_gaps=profiled.idle_gaps,
    )
    return found


class _LayerCall(torch.nn.Module):
    """One decoder layer as a function of tensors alone (what ``make_graphed_callables`` takes): the hidden states
    and the rotary tables, with the rest of the call's arguments as the model passed them."""

    def __init__(self, layer: torch.nn.Module, kwargs: dict) -> None:
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, position_embeddings=(cos, sin), **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Replayed(torch.nn.Module):
    """Stands in a model's layer list for a graphed ``_LayerCall``; keeps the attributes the model's loop reads."""

    def __init__(self, call: torch.nn.Module, layer: torch.nn.Module) -> None:
        super().__init__()
        self.call = call
        for name in ("block_type", "layer_type", "attention_type"):
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **kwargs) -> torch.Tensor:
        return self.call(hidden_states, *position_embeddings)


def _layer_calls(layers: list[torch.nn.Module], step) -> tuple[list[_LayerCall], list[tuple]]:
    """Runs ``step`` once and keeps each layer's first call: detached at once, so that nothing of the step's
    autograd graph outlives it. A kept node makes the capture's backward wait on the stream the step ran on, the
    legacy default stream, which a capture cannot (the H200 run of 2026-12-03: ``cudaErrorStreamCaptureImplicit``
    in the first backward capture)."""
    seen: dict[int, tuple] = {}

    def keep(module, args, kwargs) -> None:
        if id(module) in seen:
            return
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        cos, sin = kwargs.pop("position_embeddings")
        # the other tensors stay the objects the model passed: fusepatch keeps what it read from position_ids
        # on the host per tensor object, and a copy would make the capture read them again (a sync)
        kept = {k: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v for k, v in kwargs.items()}
        sample = (hidden.detach().clone().requires_grad_(hidden.requires_grad), cos.detach(), sin.detach())
        seen[id(module)] = (kept, sample)

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    calls = [_LayerCall(layer, seen[id(layer)][0]) for layer in layers]
    return calls, [seen[id(layer)][1] for layer in layers]


def graph_layers(model: torch.nn.Module, step) -> int:
    """How far CUDA graphs over whole layers would take a host-bound step: every decoder layer captured, forward
    and backward, by ``torch.cuda.make_graphed_callables`` (one memory pool, the layers in call order), then
    replayed in place of the layer. The arguments of one real step's layer calls are kept as they were (the first
    layer's input needs no gradient under LoRA, whose embedding is frozen, and its sample says so): fixed
    shapes, no padding or packing, no autocast, no hooks (so: with ``--no-diagnostics``). Returns the number of
    layers graphed."""
    stack = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    layers = list(stack.layers)
    calls, samples = _layer_calls(layers, step)
    graphed = torch.cuda.make_graphed_callables(tuple(calls), tuple(samples))
    stack.layers = torch.nn.ModuleList(_Replayed(call, layer) for call, layer in zip(graphed, layers))
    return len(layers)


def library_graphs(model: torch.nn.Module) -> dict:
    """What ``apply(cuda_graphs=True)`` made: signatures captured, layers per capture, whether it turned itself off."""
    from fusepatch.layers import layer_graphs

    return layer_graphs.status(model) or {"captures": 0, "layers": 0, "disabled": False}


def dynamo_made() -> dict:
    """What dynamo has made in this process so far: graphs, breaks, and the most frequent reasons for them."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": [(reason[:200], n) for reason, n in breaks.most_common(8)],
    }


class Heartbeat:
    """Every ``every`` seconds until the first step ends, one line on stderr: the time since start, the first
    step's phase, and what dynamo has made so far. A compiled first step can outlast the harness's limit (hf-fast
    + compile never finished one in 420 s); the lines say how far it got, and the driver keeps them."""

    def __init__(self, every: float = 30.0) -> None:
        self.every, self.start, self.phase = every, time.perf_counter(), "first step: forward"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def mark(self, phase: str) -> None:
        """``step(at=...)``: called at the end of each phase of the first step."""
        self.phase = {"forward": "first step: backward", "backward": "first step: optimizer"}.get(phase, "done")

    def line(self) -> str:
        made = dynamo_made()
        return (
            f"[{time.perf_counter() - self.start:.0f} s] {self.phase}; "
            f"dynamo: {made['unique_graphs']} graphs, {made['graph_breaks']} breaks"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            print(self.line(), file=sys.stderr, flush=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def run(args, seq: int, batch: int) -> dict:
    """Build, warm up, time ``--steps`` steps (synced, back to back, as the Trainer loops), diagnose, profile."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model, optimizer, info = build(args)
    step = make_step(args, model, optimizer, seq, batch)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    first = time.perf_counter()
    builds = CompileCounter()  # what the first step compiles or loads (a warm cache: loads only)
    builds.install()
    compiled = args.compile or args.compile_layers or args.compile_projections
    beat = Heartbeat() if compiled else None
    try:
        for i in range(args.warmup):
            if i == 0 and beat:
                with beat:
                    step(at=beat.mark)
            else:
                step()
            if i == 0:
                sync()
                info["first_step_s"] = round(time.perf_counter() - first, 2)
                # Triton kernels compiled or loaded from the disk cache in the first step (after apply's self-tests)
                info["first_step_builds"] = sum(builds.counts.values())
    finally:
        builds.remove()
    if args.graph_layers:
        info["graphed_layers"] = graph_layers(model, step)
        step()
    if args.cuda_graphs:  # the library's graphs: captured by now (the warm-up's steps), or said why not
        step()
        info["cuda_graphs"] = library_graphs(model)
    sync()
    info["warmup_s"] = time.perf_counter() - first
    if args.freeze_gc:  # imported here: the harness also runs older packages (+code=REV), which lack it
        from fusepatch.diagnostics.collector import LongLivedFreeze

        info["gc_frozen_objects"] = LongLivedFreeze().freeze()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    draws = random.Random(1234)  # the same lengths for every configuration
    low = max(1, int(seq * (1 - args.vary_seq)))
    lengths = [draws.randint(low, seq) if args.vary_seq else seq for _ in range(args.steps)]
    times, losses, beside = timed_steps(step, lengths, sync, device)
    info.update(beside)
    peaks = (0, 0)
    if cuda:
        info.update(back_to_back(step, lengths, batch, sync))
        info.update(trainer_loop(step, lengths, batch, sync))
        # the whole run's peaks so far: memory_by_phase resets the allocator's peak statistics
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        if not args.no_diagnostics:
            info.update(diagnostics(step, model, seq, sync))

    median = statistics.median(times)
    tokens = batch * seq
    flops = flops_per_token(model, seq) * tokens  # one step at the full length
    if args.vary_seq:  # every step its own size: all tokens over all time, FLOPs per step at its length
        info.update(lengths=lengths, max_step_ms=round(max(times) * 1000, 2))
        rate = batch * sum(lengths) / sum(times)
        flops_per_s = sum(flops_per_token(model, n) * batch * n for n in lengths) / sum(times)
    else:
        rate = tokens / median
        flops_per_s = flops / median
    if args.packed_docs > 1:
        info["packed_docs"] = args.packed_docs
    if args.sft:
        info["sft"] = {"doc_tokens": args.doc_tokens, **sample_shape(conversations())}
    if args.lora:
        info["lora_rank"] = args.lora
    if compiled:  # what dynamo made of the model: graphs, and why it broke them (the first step's tracing)
        info["compiled"] = dynamo_made()
    if args.prompt:
        info["prompt"] = args.prompt
    info.update(profiled_step(step, model, sync, device, tokens))
    info.update(
        step_ms=[round(t * 1000, 2) for t in times],
        median_step_ms=round(median * 1000, 2),
        tokens_per_s=round(rate, 1),
        # reserved: the caching allocator's whole holding, CUDA-graph memory pools included (their blocks are
        # not "allocated" between replays, so the allocated peak alone would hide them)
        peak_mem_gib=round(max(peaks[0], torch.cuda.max_memory_allocated()) / 2**30, 2) if cuda else None,
        peak_reserved_gib=round(max(peaks[1], torch.cuda.max_memory_reserved()) / 2**30, 2) if cuda else None,
        mfu=round(flops_per_s / (PEAK_TFLOPS * 1e12), 3),
        tflop_per_step=round(flops / 1e12, 2),
        losses=[round(x, 4) for x in losses],
    )
    return info


if __name__ == "__main__":
    sys.exit(main())
