"""What a torch trace shows about one training step: CPU-side ops against GPU kernels, GPU busy time, MFU.

"98% GPU utilization" only says a kernel was resident; the trace says whether the CPU kept the GPU fed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from fusepatch.engine.registry import all_rows

# Dense bf16 peak FLOP/s by GPU name (vendor datasheets); MFU is left out for GPUs not listed here
# unless ``peak_tflops`` is given.
# Dense BF16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, by the device name's words: the
# first row whose words all appear in the name (a form factor before its family: an H100 PCIe is not an SXM).
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756.0),
    (("H800", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H200", "NVL"), 835.0),
    (("GH200",), 989.0),
    (("H200",), 989.0),
    (("H100",), 989.0),
    (("H800",), 989.0),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("A800",), 312.0),
    (("L40S",), 362.0),
    (("A10G",), 70.0),
    (("L4",), 121.0),
)


def peak_tflops_for(name: str) -> float | None:
    """The dense BF16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``), or None if not listed."""
    words = set(name.replace("-", " ").split())
    for needed, value in PEAK_TFLOPS:
        if all(word in words for word in needed):
            return value
    return None


@dataclass
class StepProfile:
    """One profiled optimizer step."""

    step: int
    step_time_s: float
    cpu_ops: int  # aten ops dispatched from Python (nested ones included)
    gpu_kernels: int
    gpu_busy_fraction: float | None  # union of kernel intervals over the step's wall time; None without CUDA
    tokens: int
    peak_memory_gib: float | None
    mfu: float | None
    top_kernels: list[tuple[str, float]] = field(default_factory=list)  # (name, ms)
    ops_by_layer: list[tuple[str, int]] = field(default_factory=list)  # forward aten ops per layer class
    # the longest stretches with no kernel running, and the innermost aten op on the CPU during each: (ms, op)
    idle_gaps: list[tuple[float, str]] = field(default_factory=list)
    # every CUDA call that made the CPU wait for the GPU (a wait empties the GPU's queue): [what, count, ms]
    host_waits: list[list] = field(default_factory=list)

    @property
    def host_wait_count(self) -> int:
        return sum(n for _, n, _ in self.host_waits)

    @property
    def host_wait_ms(self) -> float:
        return sum(ms for _, _, ms in self.host_waits)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def cpu_bound(self) -> bool:
        return self.gpu_busy_fraction is not None and self.gpu_busy_fraction < 0.8

    def metrics(self, prefix: str = "fusepatch/") -> dict[str, float]:
        out = {
            "cpu_ops_per_step": self.cpu_ops,
            "gpu_kernels_per_step": self.gpu_kernels,
            "step_time_s": round(self.step_time_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "host_waits_per_step": self.host_wait_count,
            "host_wait_ms": round(self.host_wait_ms, 3),
        }
        if self.gpu_busy_fraction is not None:
            out["gpu_busy_fraction"] = round(self.gpu_busy_fraction, 3)
        if self.mfu is not None:
            out["mfu"] = round(self.mfu, 4)
        if self.peak_memory_gib is not None:
            out["peak_memory_gib"] = round(self.peak_memory_gib, 2)
        return {prefix + k: v for k, v in out.items()}

    def summary(self) -> str:
        """Plain words for the log: what the step did, and whether the CPU held the GPU back."""
        busy = "n/a (no CUDA)" if self.gpu_busy_fraction is None else f"{self.gpu_busy_fraction:.0%}"
        mfu = "" if self.mfu is None else f", MFU {self.mfu:.1%}"
        text = (
            f"fusepatch profile of step {self.step}: {self.step_time_s * 1000:.0f} ms, {self.tokens_per_s:,.0f} tokens/s{mfu}; "
            f"{self.cpu_ops:,} aten ops dispatched, {self.gpu_kernels:,} GPU kernels, GPU busy {busy}"
        )
        if self.cpu_bound:
            layers = ", ".join(f"{name} ({count:,} ops)" for name, count in self.ops_by_layer[:3]) or "see the trace"
            text += (
                f". CPU-bound: the GPU sat idle {1 - self.gpu_busy_fraction:.0%} of the step waiting for the CPU to "
                f"enqueue work. Most forward ops: {layers}. Check the report for layers that fell back to eager."
            )
        if self.host_wait_ms >= HOST_WAIT_MS:
            what, n, ms = self.host_waits[0]
            text += (
                f". The CPU waited for the GPU {self.host_wait_count} times ({self.host_wait_ms:.1f} ms), most in "
                f"{what} ({n}x, {ms:.1f} ms): "
                "each wait empties the GPU's queue (.item(), .tolist(), printing or branching on a GPU tensor)"
            )
        if self.idle_gaps:
            gaps = ", ".join(f"{ms:.0f} ms in {op}" for ms, op in self.idle_gaps)
            text += (
                f". Longest GPU idle stretches: {gaps} (one op holding the CPU that long is usually building "
                "something for a new shape: a kernel compile, a cuDNN plan)"
            )
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def _matmul_parameters(model: torch.nn.Module) -> tuple[float, float]:
    """(trained, frozen) parameters that take part in a matmul per token: every Linear weight, and MoE expert
    weights scaled by the fraction of experts a token visits (top-k / experts)."""
    trained = frozen = 0.0
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = getattr(text, "num_experts", None)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weights, share = [module.weight], 1.0
        elif type(module).__name__.endswith("Experts") and top_k and experts:
            weights, share = list(module.parameters(recurse=False)), top_k / experts
        else:
            continue
        for weight in weights:
            if weight.requires_grad:
                trained += weight.numel() * share
            else:
                frozen += weight.numel() * share
    return trained, frozen


def matmul_parameters(model: torch.nn.Module) -> float:
    """Parameters that take part in a matmul per token: every Linear weight, and MoE expert weights scaled by
    the fraction of experts a token visits (top-k / experts)."""
    return sum(_matmul_parameters(model))


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x trained matmul parameters (forward, input and weight gradients) + 4 x frozen
    ones (a frozen weight, LoRA's base layers, takes no weight gradient: counting 6 put a LoRA step's MFU over
    100%) + causal full attention 6 * seq * Hq * Dh per layer + the gated delta rule 3 x [4 Dk Dv + 2 * 64 (Dk +
    Dv)] per value head per linear-attention layer. Recomputation (activation checkpointing) is not counted."""
    trained, frozen = _matmul_parameters(model)
    flops = 6.0 * trained + 4.0 * frozen
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("GatedDeltaNet"):
            dk, dv = module.head_k_dim, module.head_v_dim
            flops += module.num_v_heads * 3 * (4 * dk * dv + 2 * 64 * (dk + dv))
        elif name.endswith("Attention") and hasattr(module, "q_proj") and hasattr(module, "head_dim"):
            heads = getattr(module.config, "num_attention_heads", 0)
            flops += 6.0 * seq_len * heads * module.head_dim
    return flops


def _busy(kernels) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


# An idle stretch is reported when it is at least this long; shorter ones are launch gaps.
IDLE_GAP_MS = 5.0
# Host waits are named in the summary when the step spent at least this long in them.
HOST_WAIT_MS = 1.0
# CUDA runtime calls in which the CPU waits for the GPU (a device-to-host copy waits inside cudaMemcpyAsync).
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def host_waits(
    events, within: tuple[float, float] | None = None, top: int | None = 10, skip: str | None = None
) -> list[list]:
    """The calls in which the CPU waited for the GPU, each as ``[call < its ops, innermost first, count, ms]``,
    most time first (the ``top`` of them; None: all); ``within``: only those starting in that (start, end) range
    (profiler microseconds); ``skip``: a prefix of ranges left out of the chains (a caller's own phase labels).
    A wait drains the GPU's queue, and whatever the CPU does next shows up as idle GPU time."""
    counts: Counter[str] = Counter()
    waited: Counter[str] = Counter()
    for event in events:
        if event.name not in WAITS or event.device_type == torch.autograd.DeviceType.CUDA:
            continue
        if within is not None and not within[0] <= event.time_range.start <= within[1]:
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None and len(chain) < 4:
            if skip is None or not parent.name.startswith(skip):
                chain.append(parent.name[:60])
            parent = parent.cpu_parent
        key = f"{event.name} < {' < '.join(chain) or '-'}"
        counts[key] += 1
        waited[key] += (event.time_range.end - event.time_range.start) / 1000.0
    return [[key, counts[key], round(ms, 3)] for key, ms in waited.most_common(top)]


def _idle_gaps(kernels, cpu_ops, top: int) -> list[tuple[float, str]]:
    """The ``top`` longest gaps between kernels (at least IDLE_GAP_MS), each with the shortest aten op (any
    thread) whose span covers the gap's middle: the op the CPU was inside while the GPU waited (in packed SFT,
    for instance, cuDNN attention building a plan for each new packed length)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    gaps, end = [], None
    for start, stop in spans:
        if end is not None and start - end >= IDLE_GAP_MS * 1000:
            gaps.append((start - end, end, start))
        end = stop if end is None else max(end, stop)
    found = []
    for length, start, stop in sorted(gaps, reverse=True)[:top]:
        middle = (start + stop) / 2
        covering = [e for e in cpu_ops if e.time_range.start <= middle <= e.time_range.end]
        op = min(covering, key=lambda e: e.time_range.end - e.time_range.start).name if covering else "Python code"
        found.append((round(length / 1000.0, 1), op))
    return found


def _layer_of(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("fusepatch::"):
            return parent.name.removeprefix("fusepatch::")
        parent = parent.cpu_parent
    return None


def summarize(
    events,
    *,
    step: int,
    wall_s: float,
    tokens: int,
    flops: float | None,
    peak_tflops: float | None,
    top: int = 5,
) -> StepProfile:
    """Turn a profiler's events for one step into a StepProfile."""
    cuda_type = torch.autograd.DeviceType.CUDA
    aten = [e for e in events if e.device_type != cuda_type and e.name.startswith("aten::")]
    # GPU-side events are kernels, copies and memsets, plus the GPU projection of record_function ranges (the
    # layer labels, the optimizer's step): those are annotations, not work, and would inflate both the kernel
    # count and the busy fraction (a range spans the gaps between its kernels).
    kernels = [e for e in events if e.device_type == cuda_type and not getattr(e, "is_user_annotation", False)]
    busy = _busy(kernels) / (wall_s * 1e6) if kernels and wall_s > 0 else None
    by_kernel: Counter[str] = Counter()
    for e in kernels:
        by_kernel[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1000.0
    by_layer: Counter[str] = Counter()
    for e in aten:
        layer = _layer_of(e)
        if layer is not None:
            by_layer[layer] += 1
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and kernels else None
    mfu = None
    if flops is not None and peak_tflops and wall_s > 0:
        mfu = flops * tokens / wall_s / (peak_tflops * 1e12)
    return StepProfile(
        step=step,
        step_time_s=wall_s,
        cpu_ops=len(aten),
        gpu_kernels=len(kernels),
        gpu_busy_fraction=None if not kernels else min(busy or 0.0, 1.0),
        tokens=tokens,
        peak_memory_gib=peak_mem,
        mfu=mfu,
        top_kernels=[(name, round(ms, 3)) for name, ms in by_kernel.most_common(top)],
        ops_by_layer=by_layer.most_common(top),
        idle_gaps=_idle_gaps(kernels, aten, min(top, 3)) if kernels else [],
        host_waits=host_waits(events, top=None) if kernels else [],
    )


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread: activation checkpointing's recomputed
    forwards run there (and may stop early), so per-layer forward hooks skip them."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def registry_modules(model: torch.nn.Module, class_names: set[str] | None = None) -> list[torch.nn.Module]:
    """The model's modules whose class is in ``class_names`` (default: every layer class of the registry; hf-fast's
    and Liger's models have the same classes as a patched one)."""
    if class_names is None:
        class_names = {row.layer for row in all_rows() if row.precision is None}  # not every nn.Linear
    return [module for module in model.modules() if type(module).__name__ in class_names]


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``compile()`` was called on the model or one of its modules (dynamo traces their calls)."""
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())


@contextlib.contextmanager
def label_layers(model: torch.nn.Module, class_names: set[str] | None = None, *, compiled: bool = False):
    """Wrap the forward of every module whose class is in ``class_names`` (default: every layer class of the
    registry) in a ``fusepatch::<Class>`` profiler range, so forward ops can be attributed to layers. Yields whether
    it did: not for a compiled model (``compiled``: one compiled from outside, as the Trainer's ``torch_compile``
    does), whose guards the hooks would fail, so that its next call is traced again (a retrace inside the
    profiled step, which the profile would then show as the step's own time)."""
    if compiled or is_compiled(model):
        yield False
        return
    handles = []

    def pre(module, args):
        # label only the real forward pass (not a checkpoint's recomputation), so every range that opens closes
        if in_backward():
            return
        module._fusepatch_range = torch.autograd.profiler.record_function(f"fusepatch::{type(module).__name__}")
        module._fusepatch_range.__enter__()

    def post(module, args, output):
        scope = module.__dict__.pop("_fusepatch_range", None)
        if scope is not None:
            scope.__exit__(None, None, None)

    # passive: a fused path that calls a module's parts directly (the MLP's down projection adding the residual)
    # may skip these labels rather than fall back to the module call, so the profiled step runs what the others do
    pre._fusepatch_passive = post._fusepatch_passive = True
    for module in registry_modules(model, class_names):
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()
