"""What a training step's model holds between steps, by part, computed from the tensors' sizes: no GPU, no step.

    python benchmarks/studies/static_memory.py --shape 27b --lora 16 --json-out static.json

Why: a training run's peak (``train_step.py``'s ``peak_mem_gib``) is what the model keeps between steps plus what
one step adds (activations, gradients, the loss's chunks); the first part follows from the shapes alone. Built on
the meta device (no values), each row gives, in GiB: the embedding and LM head, the projections
``apply(model, precision="fp8")`` trains in FP8 (their weights in the model's dtype, and the FP8 copy a frozen
projection keeps: one byte a value plus one fp32 scale a row; ``drop_frozen_weights=True`` keeps the copy only),
the rest of the parameters, and the trainable parameters' gradients and AdamW states (in the parameters' dtype,
as ``torch.optim.AdamW`` keeps them). A row's ``static_gib`` is everything but the gradients, which a step
creates and ``zero_grad`` frees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import command, today, versions  # noqa: E402
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA rank on every linear (0: full fine-tuning)")
    parser.add_argument("--json-out", default=None, help="append one JSON row a precision to this file")
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
    if args.json_out:
        with open(args.json_out, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
