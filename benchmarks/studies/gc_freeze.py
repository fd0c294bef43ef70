"""Python's garbage collections during training steps, with and without the long-lived objects frozen.

    python benchmarks/studies/gc_freeze.py --layers 64 --steps 24 --repeats 2 --out gc-freeze.jsonl

Why: at Qwen3.5-27B's full depth (LoRA r16 on every linear, activation checkpointing) on one H100, every
configuration paused for one generation-2 collection of 376 to 507 ms every 8 steps (docs/benchmarks.md), which
walks every object alive. ``FusePatchCallback`` freezes what is alive after step 2 (``gc.freeze``); this measures
what that changes where it can run without a GPU: a tiny Qwen3.5 (hybrid layers, transformers' own forward) at
the full model's depth, peft LoRA on every linear, non-reentrant activation checkpointing, AdamW, on the CPU. Each
configuration runs in its own process (``--repeats`` times, alternating), two warm-up steps, then ``--steps``
steps whose collections are counted and timed by generation (``gc.callbacks``). What the tiny model lacks is the
GPU machine's larger heap (Triton, fla, TileLang's TVM, bigger caches), so its pauses are shorter; the ratio is
what carries over. One JSON line per process goes to ``--out`` (date, versions, command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the harness: benchmarks/
sys.path.insert(1, ROOT)

CONFIGS = ("collected", "frozen")


def one(config: str, layers: int, steps: int) -> dict:
    """One process's measurement (run through ``--child``)."""
    import gc
    import warnings

    import peft
    import torch

    from fusepatch.diagnostics.collector import CollectorPauses, LongLivedFreeze
    from fusepatch.tools.tiny import tiny_model

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # steady step times on a shared machine; the collections run on one thread anyway
    torch.manual_seed(0)
    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    model = tiny_model("qwen3_5_text", num_hidden_layers=len(types), layer_types=types).train()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 32))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    frozen = LongLivedFreeze().freeze() if config == "frozen" else 0
    pauses = CollectorPauses()
    pauses.install()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = time.perf_counter() - start
    pauses.remove()
    tracked = len(gc.get_objects())  # what a full collection walks at the end of the steps
    return {
        "config": config,
        "layers": len(types),
        "steps": steps,
        "frozen_objects": frozen,
        "objects_walked_by_a_full_collection": tracked,
        "collections": {str(g): n for g, n in sorted(pauses.counts.items())},
        "collection_ms": {str(g): round(s * 1000, 2) for g, s in sorted(pauses.seconds.items())},
        "collection_ms_per_step": round(sum(pauses.seconds.values()) * 1000 / steps, 3),
        "step_ms_mean": round(wall * 1000 / steps, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.layers, args.steps)))
        return 0
    from provenance import append_rows, code, command, today, versions

    base = {"benchmark": "gc_freeze", "date": today(), "gpu": "cpu", "code": code(), "command": command(__file__)}
    base["versions"] = versions(("torch", "transformers", "peft", "fusepatch"))
    rows = []
    for repeat in range(args.repeats):
        for config in CONFIGS:
            child = [sys.executable, __file__, "--child", config, "--layers", str(args.layers)]
            done = subprocess.run([*child, "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            row = {**base, **json.loads(done.stdout.strip().splitlines()[-1]), "repeat": repeat}
            rows.append(row)
            print(
                f"{config:9s} repeat {repeat}: {row['collections']} collections, {row['collection_ms']} ms, "
                f"{row['collection_ms_per_step']} ms a step; {row['objects_walked_by_a_full_collection']:,} objects "
                f"walked ({row['frozen_objects']:,} frozen); {row['step_ms_mean']} ms a step"
            )
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
