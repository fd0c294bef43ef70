"""The MoE experts op alone (forward + backward), each candidate, at Qwen3.5-MoE's expert sizes.

    python benchmarks/studies/moe_bench.py --tokens 4096 --json-out moe.json
    python benchmarks/studies/moe_bench.py --fp8 --json-out moe-fp8.json   # the experts' GEMMs: bf16 against FP8

Sizes from transformers' ``Qwen3_5MoeTextConfig`` defaults (hidden, expert width, experts, experts per token), the
benchmark table's MoE shape; routing as transformers does it (softmax, top-k, renormalised), bf16, fresh random
inputs. Each candidate: median of ``--steps`` timed forward + backward calls (CUDA events) after ``--warmup``.

``--fp8``: whether FP8 experts could pay here. The GEMMs that FP8 would replace (the forward's and the input
gradient's, both projections), timed alone in bf16 (torch's grouped_mm) and in FP8 (``torch._scaled_grouped_mm``,
rowwise scales), and apart from them what FP8 adds every step: the rowwise quantization of the slots, the
gradients and both weights (fusepatch's Triton kernel), the weights once along each GEMM's reduction dimension
(a trained expert changes every step). The weight gradients stay bf16 either way and are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import cuda_times_ms, gpu_name  # noqa: E402

from fusepatch.ops import OPS  # noqa: E402


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
    return cuda_times_ms(lambda: torch.autograd.grad(fn(*args), leaves, cot), warmup, steps)


def _median_ms(call, warmup: int, steps: int) -> float:
    return round(statistics.median(cuda_times_ms(call, warmup, steps)), 3)


def fp8_gemms(tokens: int, dims: dict[str, int], warmup: int, steps: int) -> dict[str, float]:
    """Milliseconds of one MoE layer's forward and input-gradient expert GEMMs, bf16 and FP8, and of the FP8
    quantization they need (see the module's docstring)."""
    from fusepatch.kernels.fp8 import quantize_rows

    hidden, inter, experts, top_k = dims["hidden"], dims["inter"], dims["experts"], dims["top_k"]
    generator = torch.Generator(device="cuda").manual_seed(1)
    slots = tokens * top_k
    logits = torch.randn(tokens, experts, generator=generator, device="cuda")
    expert = torch.sort(torch.topk(logits, top_k, dim=-1).indices.reshape(-1)).values
    offsets = torch.searchsorted(expert, torch.arange(experts, device="cuda"), right=True).to(torch.int32)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).bfloat16()

    rows, act = randn(slots, hidden), randn(slots, inter)
    gate_up, down = (
        randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
        randn(experts, hidden, inter, scale=inter**-0.5),
    )
    d_gate_up, d_out = randn(slots, 2 * inter), randn(slots, hidden)
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

    def bf16():
        grouped(rows, gate_up.transpose(1, 2), offs=offsets)
        grouped(act, down.transpose(1, 2), offs=offsets)
        grouped(d_gate_up, gate_up, offs=offsets)
        grouped(d_out, down, offs=offsets)

    def quantized_weight(weight):  # rows of [E, N, K] (forward) and of its [E, K, N] transpose (input gradient)
        q, s = quantize_rows(weight.reshape(-1, weight.shape[-1]))
        qt, st = quantize_rows(weight.transpose(1, 2).reshape(-1, weight.shape[1]))
        return (
            q.view(weight.shape),
            s.view(weight.shape[:2]),
            qt.view(weight.transpose(1, 2).shape),
            st.view(weight.shape[0], weight.shape[2]),
        )

    def quantize():
        out = [quantized_weight(gate_up), quantized_weight(down)]
        for tensor in (rows, act, d_gate_up, d_out):
            out.append(quantize_rows(tensor))
        return out

    (gq, gs, gqt, gst), (dq, ds, dqt, dst), xr, ar, gr, orr = quantize()

    def fp8():
        mm = torch._scaled_grouped_mm
        bf = torch.bfloat16
        mm(xr[0], gq.transpose(-2, -1), xr[1].view(-1), gs, offs=offsets, out_dtype=bf)
        mm(ar[0], dq.transpose(-2, -1), ar[1].view(-1), ds, offs=offsets, out_dtype=bf)
        mm(gr[0], gqt.transpose(-2, -1), gr[1].view(-1), gst, offs=offsets, out_dtype=bf)
        mm(orr[0], dqt.transpose(-2, -1), orr[1].view(-1), dst, offs=offsets, out_dtype=bf)

    # each FP8 GEMM against its bf16 one on these inputs: a wrong layout would time a wrong product
    pairs = (
        ((rows, gate_up.transpose(1, 2)), (xr, gq, gs)),
        ((act, down.transpose(1, 2)), (ar, dq, ds)),
        ((d_gate_up, gate_up), (gr, gqt, gst)),
        ((d_out, down), (orr, dqt, dst)),
    )
    errors = []
    for (a, b), (quantized, q, s) in pairs:
        want = grouped(a, b, offs=offsets).float()
        got = torch._scaled_grouped_mm(
            quantized[0], q.transpose(-2, -1), quantized[1].view(-1), s, offs=offsets, out_dtype=torch.bfloat16
        ).float()
        errors.append(round(((got - want).norm() / want.norm()).item(), 4))
    return {
        "bf16_gemms_ms": _median_ms(bf16, warmup, steps),
        "fp8_gemms_ms": _median_ms(fp8, warmup, steps),
        "fp8_quantization_ms": _median_ms(quantize, warmup, steps),
        "fp8_relative_errors": errors,  # forward gate/up, forward down, input gradients of both
        "weight_values": gate_up.numel() + down.numel(),
        "slots": slots,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json-out")
    parser.add_argument("--fp8", action="store_true", help="the expert GEMMs bf16 against FP8 (module docstring)")
    args = parser.parse_args()
    dims = sizes()
    if args.fp8:
        info = {"tokens": args.tokens, **dims, "gpu": gpu_name(), "torch": torch.__version__}
        info.update(fp8_gemms(args.tokens, dims, args.warmup, args.steps))
        print(json.dumps(info))
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump(info, handle, indent=1)
        return 0
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
        "gpu": gpu_name(),
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
