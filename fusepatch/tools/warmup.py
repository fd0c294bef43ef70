"""Compile and autotune the fused kernels for a model's shapes ahead of training (e.g. while building a
container image), so the first training step does not spend a minute or more compiling.

fla's Triton kernels are compiled and autotuned per shape, and its TileLang backward (Hopper, Triton < 3.7.1)
takes ~10 s per kernel to compile; both caches live on disk. One layer of each kind, at the real sizes,
micro-batch and sequence length, run forward and backward, fills them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusepatch.base.dtypes import dtype_name
from fusepatch.base.env import require_transformers
from fusepatch.engine.patch import apply
from fusepatch.engine.registry import known_model_types
from fusepatch.engine.resolve import Dispatch
from fusepatch.engine.selftest import COMPILED_S

CACHE_VARIABLES = {
    "triton (compiled kernels; fla's autotuning results too, FLA_CACHE_RESULTS=1)": (
        "TRITON_CACHE_DIR",
        "~/.triton/cache",
    ),
    "tilelang (the Hopper backward kernels)": ("TILELANG_CACHE_DIR", "~/.tilelang/cache"),
}


@dataclass
class OpTiming:
    layer: str
    op: str
    kernel: str
    first_s: float
    second_s: float
    ready_s: float = 0.0  # load + self-test inside apply, at these sizes: where the compiling usually happens

    @property
    def compiled(self) -> bool:
        """Compiled or autotuned here: a slow self-test, or a first call far slower than the second; a kernel
        that came from the on-disk caches is fast in both."""
        return self.ready_s >= COMPILED_S or self.first_s > 10 * self.second_s + 0.5


def warmup_config(source: str, *, text_only: bool = True):
    """The model's config with one layer of each kind: a model_type (transformers' default sizes) or a local
    config path. A model type fusepatch has no rows for raises ValueError naming the supported ones: it has no
    kernel to warm."""

    AutoConfig = require_transformers().AutoConfig
    known = known_model_types()
    if os.path.exists(source):
        config = AutoConfig.from_pretrained(source)
    elif source in known:
        config = AutoConfig.for_model(source)
    else:
        raise ValueError(
            f"{source!r} is neither a config path nor a model type fusepatch patches; supported: {', '.join(known)}"
        )
    types = {config.model_type}
    if hasattr(config, "get_text_config"):
        types.add(config.get_text_config().model_type)
    if not types & set(known):
        raise ValueError(
            f"{source}: no fusepatch rows for model_type {config.model_type!r}; supported: {', '.join(known)}"
        )
    if text_only and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"]))
    config.num_hidden_layers = len(kinds)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = kinds
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    config.use_cache = False
    return config


def warmup(
    source: str,
    *,
    dtype: str = "bfloat16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    packed: bool = False,
    device: str = "cuda",
    progress: Callable[[str], None] = lambda text: None,
) -> list[OpTiming]:
    """Run one layer of each kind forward and backward twice at the given shapes; time every fused op's first and
    second call (synchronised, so the times are the kernels')."""
    AutoModelForCausalLM = require_transformers().AutoModelForCausalLM

    config = warmup_config(source)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    progress(f"choosing and self-testing the kernels for {dtype} on {device} (first use compiles: minutes)")
    report = apply(model, verbose=False)
    ready = {(layer.layer, c.op): c.ready_s for layer in report.layers for c in layer.choices}
    timings: dict[tuple[str, str], list[float]] = {}
    kernels: dict[tuple[str, str], str] = {}
    original_call = Dispatch.__call__

    def timed_call(self, *args, **kwargs):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = original_call(self, *args, **kwargs)
        sync()
        timings.setdefault((self.label, self.op.name), []).append(time.perf_counter() - start)
        first = next(a for a in args if hasattr(a, "device"))
        packed_call = kwargs.get("cu_seqlens") is not None
        kernels[(self.label, self.op.name)] = self.choice(
            first.device.type, dtype_name(first.dtype), packed_call
        ).chosen
        return out

    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
    kwargs = {}
    if packed:
        cut = [0, seq_len // 3, seq_len // 2, seq_len]
        kwargs["position_ids"] = torch.cat([torch.arange(b - a, device=device) for a, b in zip(cut, cut[1:])])[None]
        ids = ids[:1]
    Dispatch.__call__ = timed_call
    try:
        for step in range(2):
            progress(f"step {step + 1} of 2: forward and backward at seq {seq_len}, micro-batch {micro_batch}")
            model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss.backward()
    finally:
        Dispatch.__call__ = original_call
    results = []
    for (layer, op), times in timings.items():
        per_step = len(times) // 2 or 1
        first, second = sum(times[:per_step]), sum(times[per_step : 2 * per_step])
        results.append(OpTiming(layer, op, kernels[(layer, op)], first, second, ready.get((layer, op), 0.0)))
    return results


def cache_locations() -> list[tuple[str, str, str]]:
    """(what, variable, resolved path) for each on-disk compile cache."""
    rows = []
    for what, (variable, default) in CACHE_VARIABLES.items():
        rows.append((what, variable, os.path.expanduser(os.environ.get(variable, default))))
    return rows


def dockerfile_hint(source: str, seq_len: int, micro_batch: int) -> str:
    return (
        "ENV TRITON_CACHE_DIR=/opt/kernel-cache/triton TILELANG_CACHE_DIR=/opt/kernel-cache/tilelang\n"
        f"RUN python -m fusepatch warmup {source} --seq-len {seq_len} --micro-batch {micro_batch}   # on a GPU builder"
    )
