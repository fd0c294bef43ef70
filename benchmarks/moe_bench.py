"""The MoE experts op alone (forward + backward), each candidate, at Qwen3.5-MoE's expert sizes.

    python benchmarks/moe_bench.py --tokens 4096 --json-out moe.json

Sizes from transformers' ``Qwen3_5MoeTextConfig`` defaults (hidden, expert width, experts, experts per token), the
benchmark table's MoE shape; routing as transformers does it (softmax, top-k, renormalised), bf16, fresh random
inputs. Each candidate: median of ``--steps`` timed forward + backward calls (CUDA events) after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from fusepatch.ops import OPS


def sizes() -> dict[str, int]:
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig()
    return {
        "hidden": config.hidden_size,
        "inter": config.moe_intermediate_size,
        "experts": config.num_experts,
        "top_k": config.num_experts_per_tok,
    }


def inputs(tokens: int, dims: dict[str, int], generator: torch.Generator) -> list[torch.Tensor]:
    hidden, inter, experts, top_k = dims["hidden"], dims["inter"], dims["experts"], dims["top_k"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).bfloat16().requires_grad_(True)

    logits = torch.randn(tokens, experts, generator=generator, device="cuda")
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16().requires_grad_(True)
    return [
        randn(tokens, hidden),
        index,
        weights,
        randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
        randn(experts, hidden, inter, scale=inter**-0.5),
    ]


def time_candidate(fn, args, warmup: int, steps: int) -> list[float]:
    leaves = [a for a in args if a.is_floating_point()]
    cot = torch.randn_like(args[0])
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(fn(*args), leaves, cot)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    dims = sizes()
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = inputs(args.tokens, dims, generator)
    results = {}
    for candidate in OPS["moe_experts"].candidates:
        try:
            fn = candidate.load()
        except Exception as exc:  # an unavailable candidate: listed, not timed
            results[candidate.name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        if fn is None:  # a planned candidate (nothing to load yet)
            results[candidate.name] = {"error": "planned"}
            continue
        times = time_candidate(fn, tensors, args.warmup, args.steps)
        results[candidate.name] = {"median_ms": round(statistics.median(times), 3), "ms": [round(t, 3) for t in times]}
    info = {
        "tokens": args.tokens,
        **dims,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": results,
    }
    print(json.dumps(info))
    for name, row in results.items():
        print(f"| {name} | {row.get('median_ms', '-')} | {row.get('error', '')} |")
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(info, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
