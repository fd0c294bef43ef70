"""What a training step's model holds between steps, by part, computed from the tensors' sizes: no GPU, no step.

    python benchmarks/studies/static_memory.py --shape 27b --lora 16 --json-out static.json
    python benchmarks/studies/static_memory.py --shape 27b --world 1 2 4 8    # per rank, FSDP2 and ZeRO-3

Why: a training run's peak (``train_step.py``'s ``peak_mem_gib``) is what the model keeps between steps plus what
one step adds (activations, gradients, the loss's chunks); the first part follows from the shapes alone. Built on
the meta device (no values), each row gives, in GiB: the embedding and LM head, the projections
``apply(model, precision="fp8")`` trains in FP8 (their weights in the model's dtype, and the FP8 copy a frozen
projection keeps: one byte a value plus one fp32 scale a row; ``drop_frozen_weights=True`` keeps the copy only),
the rest of the parameters, and the trainable parameters' gradients and AdamW states (in the parameters' dtype,
as ``torch.optim.AdamW`` keeps them). A row's ``static_gib`` is everything but the gradients, which a step
creates and ``zero_grad`` frees.

Per rank (``--world 1 2 4 8``): what each of N processes holds under FSDP2 and under DeepSpeed ZeRO-3, as the
Trainer and accelerate run them in bf16 (``per_rank``), for rank 0, the one holding the most:

- FSDP2 (accelerate's plugin, ``mixed_precision="bf16"``): every parameter split along its first dimension into N
  chunks of ``ceil(rows / N)`` rows; accelerate upcasts the trainable ones to fp32 (fp32 shards, gradients and
  AdamW states), frozen ones keep the model's dtype.
- ZeRO-3 (DeepSpeed, bf16): every parameter flattened and split into N parts of ``ceil(numel / N)`` values in the
  model's dtype; a trainable one adds its gradient part in that dtype and the fp32 master copy and AdamW states of
  its part.
- The FP8 copies of frozen projections (``fp8_copy``): ``sharded`` is what fusepatch keeps under FSDP2, each rank
  the copy of its own rows (``ceil(rows / N)`` rows, one byte a value and one fp32 scale a row), gathered in FP8 for
  a unit's forward and backward and freed after; with ``drop_frozen_weights=True`` (``fp8+drop``) the rank's bf16
  rows of those weights are dropped. ``per-call`` is what fusepatch keeps under ZeRO-3: nothing (each call
  quantizes the weight ZeRO-3 gathered, forward and again for the backward), and nothing is dropped (the
  partitions are DeepSpeed's). ``whole`` is a whole copy of every frozen projection on every rank: what a copy kept
  from the gathered weight costs (fusepatch kept that under both engines before 2026-12-05).

The gathered weights of the unit computing (a decoder layer's, in FP8 for the frozen projections) come on top of
the static count, as the activations do.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import append_rows, command, today, versions  # noqa: E402
from shapes import SHAPES, build_config  # noqa: E402

GIB = 2**30
PRECISIONS = ("bf16", "fp8", "fp8+drop")


def _projection(name: str, module: torch.nn.Module) -> bool:
    """A projection ``precision="fp8"`` trains in FP8 (by the name its layer holds it as: peft's wrappers)."""
    from fusepatch.layers.fp8 import PROJECTIONS, aligned
    from fusepatch.layers.support.lora import held_as

    return isinstance(module, torch.nn.Linear) and held_as(name) in PROJECTIONS and aligned(module) is None


def static_memory(model: torch.nn.Module, precision: str) -> dict:
    """Bytes by part of ``model`` (on any device, meta included) as ``precision`` keeps them."""
    parts = dict.fromkeys(
        ("embedding_and_head", "projections", "projections_fp8", "other", "gradients", "optimizer_states"), 0
    )
    counted: set[int] = set()
    head = model.get_output_embeddings()
    ends = {id(model.get_input_embeddings().weight), *(() if head is None else (id(head.weight),))}
    for name, module in model.named_modules():
        if not _projection(name, module):
            continue
        weight = module.weight
        counted.add(id(weight))
        frozen = not weight.requires_grad
        if precision.startswith("fp8") and frozen:  # the FP8 copy a frozen weight keeps (trained: made per GEMM)
            parts["projections_fp8"] += weight.numel() + weight.shape[0] * 4
        if not (precision == "fp8+drop" and frozen):
            parts["projections"] += weight.numel() * weight.element_size()
    for parameter in model.parameters():
        size = parameter.numel() * parameter.element_size()
        if parameter.requires_grad:
            parts["gradients"] += size
            parts["optimizer_states"] += 2 * size  # AdamW's exp_avg and exp_avg_sq
        if id(parameter) in counted:
            continue
        parts["embedding_and_head" if id(parameter) in ends else "other"] += size
    static = sum(size for part, size in parts.items() if part != "gradients")
    return {
        "bytes": parts,
        "gib": {part: round(size / GIB, 3) for part, size in parts.items()},
        "static_gib": round(static / GIB, 3),
    }


ENGINES = ("fsdp2", "zero3")
FP8_COPIES = ("whole", "sharded", "per-call")
KEPT = {"fsdp2": "sharded", "zero3": "per-call"}  # what fusepatch keeps under each engine


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def per_rank(model: torch.nn.Module, precision: str, *, engine: str, world: int, fp8_copy: str | None = None) -> dict:
    """Bytes by part that rank 0 of ``world`` processes holds of ``model`` under ``engine`` (module docstring);
    ``fp8_copy`` default: what fusepatch keeps under ``engine``."""
    fp8_copy = fp8_copy or KEPT.get(engine, "")
    if engine not in ENGINES or fp8_copy not in FP8_COPIES:
        raise ValueError(f"engine must be one of {ENGINES} and fp8_copy one of {FP8_COPIES}")
    parts = dict.fromkeys(("parameters", "gradients", "optimizer_states", "projections_fp8"), 0)
    frozen_projections = {}
    for name, module in model.named_modules():
        if _projection(name, module) and not module.weight.requires_grad:
            frozen_projections[id(module.weight)] = module.weight
    # only FSDP2's rows are dropped, and not at one rank (torch's one-rank path gathers one tensor a parameter:
    # fusepatch keeps the whole copy there, as without FSDP2)
    dropped = precision == "fp8+drop" and fp8_copy == "sharded" and world > 1
    for parameter in model.parameters():
        shape = tuple(parameter.shape)
        if engine == "fsdp2":
            values = _ceil(shape[0], world) * (parameter.numel() // shape[0]) if shape else parameter.numel()
        else:
            values = _ceil(parameter.numel(), world)
        if parameter.requires_grad:
            if engine == "fsdp2":  # fp32 shard, gradient and AdamW states
                parts["parameters"] += 4 * values
                parts["gradients"] += 4 * values
            else:  # the model's dtype for the part and its gradient; fp32 master and AdamW states
                parts["parameters"] += values * parameter.element_size()
                parts["gradients"] += values * parameter.element_size()
            parts["optimizer_states"] += (12 if engine == "zero3" else 8) * values
            continue
        if id(parameter) in frozen_projections and precision.startswith("fp8"):
            rows, cols = shape
            kept_rows = {"whole": rows, "sharded": _ceil(rows, world), "per-call": 0}[fp8_copy]
            parts["projections_fp8"] += kept_rows * (cols + 4)  # one byte a value, one fp32 scale a row
            if dropped:
                continue
        parts["parameters"] += values * parameter.element_size()
    static = sum(size for part, size in parts.items() if part != "gradients")
    return {
        "bytes": parts,
        "gib": {part: round(size / GIB, 3) for part, size in parts.items()},
        "static_gib": round(static / GIB, 3),
    }


def build(shape: str, layers: int | None, lora: int) -> torch.nn.Module:
    """``train_step.py``'s model of ``shape`` (bf16, sdpa; peft LoRA on every linear for ``lora``) on the meta
    device."""
    from transformers import AutoModelForCausalLM

    config = build_config(shape, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if lora:
        import peft

        adapters = peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0)
        model = peft.get_peft_model(model, adapters, autocast_adapter_dtype=False)
    return model


def _copies(engine: str, precision: str) -> tuple[str, ...]:
    """The FP8 copies a table shows: for FP8, a whole copy a rank beside what fusepatch keeps; nothing is dropped
    under ZeRO-3 (its ``fp8+drop`` is its ``fp8``)."""
    if precision == "bf16":
        return ("-",)
    if precision == "fp8":
        return ("whole", KEPT[engine])
    return (KEPT[engine],) if engine == "fsdp2" else ()


def per_rank_rows(model: torch.nn.Module, args: argparse.Namespace, layers: int) -> list[dict]:
    """``per_rank`` for every process count, engine, precision and (FP8) copy: the rows, and a table printed."""
    rows = []
    print(
        f"\nper rank (rank 0), GiB: {args.shape}, {layers} layers, " + (f"LoRA r={args.lora}" if args.lora else "full")
    )
    print(
        f"{'N':>2} {'engine':6} {'precision':9} {'fp8 copy':8} {'params':>8} {'grads':>7} {'optim':>8} {'fp8':>7} {'static':>8}"
    )
    for world in args.world:
        for engine in ENGINES:
            for precision in PRECISIONS:
                for copy in _copies(engine, precision):
                    held = per_rank(
                        model, precision, engine=engine, world=world, fp8_copy=None if copy == "-" else copy
                    )
                    rows.append(
                        {
                            "kind": "static-memory-per-rank",
                            "command": command(__file__),
                            "device": "meta (sizes only)",
                            "shape": args.shape,
                            "layers": layers,
                            "lora_rank": args.lora or None,
                            "engine": engine,
                            "world": world,
                            "precision": precision,
                            "fp8_copy": copy,
                            **held,
                            "date": today(),
                            "versions": versions(("torch", "transformers"), absent=False),
                        }
                    )
                    g = held["gib"]
                    print(
                        f"{world:>2} {engine:6} {precision:9} {copy:8} {g['parameters']:8.2f} {g['gradients']:7.2f} "
                        f"{g['optimizer_states']:8.2f} {g['projections_fp8']:7.2f} {held['static_gib']:8.2f}"
                    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA rank on every linear (0: full fine-tuning)")
    parser.add_argument("--json-out", default=None, help="append one JSON row a precision to this file")
    parser.add_argument(
        "--world",
        type=int,
        nargs="*",
        default=None,
        help="also per rank under FSDP2 and ZeRO-3 for these process counts (e.g. --world 1 2 4 8)",
    )
    args = parser.parse_args()

    model = build(args.shape, args.layers, args.lora)
    layers = model.config.num_hidden_layers
    rows = []
    for precision in PRECISIONS:
        row = {
            "kind": "static-memory",
            "command": command(__file__),
            "device": "meta (sizes only)",
            "shape": args.shape,
            "layers": layers,
            "lora_rank": args.lora or None,
            "precision": precision,
            **static_memory(model, precision),
            "date": today(),
            "versions": versions(("torch", "transformers"), absent=False),
        }
        rows.append(row)
        parts = "  ".join(f"{part} {gib}" for part, gib in row["gib"].items())
        print(f"{precision:9s} static {row['static_gib']:7.3f} GiB  {parts}")
    if args.world:
        rows += per_rank_rows(model, args, layers)
    append_rows(args.json_out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
