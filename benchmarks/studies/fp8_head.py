"""The LM head's GEMMs in FP8: how far its loss and gradients move from fp32, against the bf16 head's.

    python benchmarks/studies/fp8_head.py --shape 27b --tokens 128 --logit-std 1.4 --peak 0 0.12 0.19 --out fp8-head.jsonl
    python benchmarks/studies/fp8_head.py --shape 2b --tokens 256 --logit-std 1.4 --peak 0 0.3 0.6 --out fp8-head.jsonl
    python benchmarks/studies/fp8_head.py --shape 27b --tokens 128 --logit-std 1.4 --peak 0 0.19 --shared 0 0.5 --out fp8-head.jsonl

The head computes ``logits = h @ W.T`` and, in the backward, ``dh = g @ W`` and ``dW = g.T @ h`` with
``g = (softmax(logits) - onehot(labels)) / tokens``. Configurations, each on the same bf16 values of ``h`` and
``W``:

- ``bf16``: the fused loss as it runs today (bf16 operands, fp32 accumulation, each GEMM's output rounded to bf16,
  ``g`` rounded to bf16);
- ``fp8-forward``: the logits' GEMM on float8_e4m3fn operands with rowwise power-of-two scales along the hidden
  dimension (``quantize_rows_reference``: the GPU kernels' bits), the backward as bf16;
- ``fp8``: all three GEMMs so, each operand quantized along that GEMM's reduction dimension, as ``fp8_linear``
  quantizes a projection's, and as the op does, the hidden-state gradient's rows quantized without their targets'
  entries, each target's weight row times its entry added after the GEMM;
- ``fp8-target-scaled``: as ``fp8`` with each target's entry inside the row it scales (the op before it left them
  out): a row keeps nothing below about 4e-6 of its largest entry, about what an untrained head predicts for every
  token of Qwen3.5's vocabulary;
- ``fp8-sum-corrected`` (not what the op runs: what a correction would give): as ``fp8``, and each token's quantized
  probabilities' sum made exact along the head's mean row, adding ``(1 - p - sum) * mean(W)``: the part of the
  rounding's bias that lies along a direction the head's rows share.

The reference is the same math on those bf16 values in fp32 (the logits) and fp64 (the loss, ``dh``, ``dW``). Quantities: the loss, the logits'
gradient ``g``, ``dh`` and ``dW`` (each ``||x - x_ref|| / ||x_ref||``), and ``dh_shared``: ``dh`` along a direction
every row of ``W`` shares, ``--shared`` times a row's own spread (trained heads' rows tend to share one; it moves every
logit of a token alike, so the predictions and ``g`` do not change, only the hidden states' gradient along it). The inputs: ``h``, rows of unit RMS (a
final norm's output); ``W`` normal with the spread that gives the logits the standard deviation ``--logit-std``
(transformers' initialisation, 0.02, gives about 1.4 at hidden 5120; a trained head's logits spread further);
labels drawn from the fp32 head's own distribution, as a trained model's targets are likely under it; ``--peak``:
how far each ``h`` leans towards one token's row of ``W`` (0: not at all, near-uniform predictions, a loss near
log V; confident ones, as a trained model's, from about 0.19 at hidden 5120 and 0.3 at 2048, a loss under 1: the
record's ``loss_ref`` says which each row is). The GEMMs
are computed in fp32 on the dequantized values (what ``torch._scaled_mm`` computes, up to its accumulation order),
by chunks of the vocabulary, so the whole 27B head runs on a CPU.

One JSON line per (logit spread, configuration) goes to ``--out`` (date, device, versions, command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the harness: benchmarks/
sys.path.insert(1, ROOT)

from provenance import code, command, today, versions  # noqa: E402

from fusepatch.kernels.fp8_range import FP8_MAX  # noqa: E402
from fusepatch.ops.fp8_linear.scaled_mm import FP8, quantize_rows_reference, row_scale_reference  # noqa: E402

SHAPES = {"27b": (5120, 248320), "2b": (2048, 248320)}  # hidden, vocabulary (Qwen3.5)
CONFIGS = ("bf16", "fp8-forward", "fp8", "fp8-target-scaled", "fp8-sum-corrected")
CHUNK = 16384  # vocabulary rows per chunk


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` through FP8 along its rows, dequantized: the values a rowwise-scaled FP8 GEMM reads."""
    q, inverse = quantize_rows_reference(x)
    return q.float() * inverse


def through(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() / scale


def run(
    hidden: int, vocab: int, tokens: int, logit_std: float, peak: float, shared: float, seed: int, configs=CONFIGS
) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    std = logit_std / math.sqrt(hidden)
    W = torch.randn(vocab, hidden, generator=generator) * std
    # a generator of its own: without a shared part the draws are those of the study before it had one
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 1))
    direction = torch.nn.functional.normalize(direction, dim=0)
    W = bf16(W + shared * std * math.sqrt(hidden) * direction)
    h = torch.randn(tokens, hidden, generator=generator)
    if peak:  # each row leans towards one token's row of W: a confident prediction, as a trained model makes
        chosen = W[torch.randint(0, vocab, (tokens,), generator=generator)]
        h += peak * math.sqrt(hidden) * chosen / chosen.norm(dim=1, keepdim=True)
    h = bf16(h / h.pow(2).mean(1, keepdim=True).sqrt())
    chunks = [(s, min(s + CHUNK, vocab)) for s in range(0, vocab, CHUNK)]

    # the reference: fp32 logits, labels from their own distribution, g, dh
    logits = torch.cat([h @ W[s:e].t() for s, e in chunks], 1)
    labels = torch.multinomial(torch.softmax(logits.double(), 1).float(), 1, generator=generator).squeeze(1)

    def loss_and_g(z: torch.Tensor, round_g: bool) -> tuple[float, torch.Tensor]:
        z = z.double()
        lse = torch.logsumexp(z, 1)
        loss = float((lse - z.gather(1, labels[:, None]).squeeze(1)).mean())
        g = torch.softmax(z, 1)
        g[torch.arange(tokens), labels] -= 1
        g = (g / tokens).float()
        return loss, bf16(g) if round_g else g

    loss_ref, g_ref = loss_and_g(logits, False)
    dh_ref = sum(g_ref[:, s:e].double() @ W[s:e].double() for s, e in chunks).float()
    found = []
    for config in configs:
        start = time.perf_counter()
        fp8_fwd, fp8_bwd = config != "bf16", config not in ("bf16", "fp8-forward")
        hq = rows(h) if fp8_fwd else h
        z = torch.cat([bf16(hq @ (rows(W[s:e]) if fp8_fwd else W[s:e]).t()) for s, e in chunks], 1)
        loss, g = loss_and_g(z, True)
        if fp8_bwd:
            # dh: g along the vocabulary, per token; W along the vocabulary, per hidden feature
            apart = config != "fp8-target-scaled"  # each target's entry outside the quantized rows, added exactly
            target = g[torch.arange(tokens), labels]
            gq = rows(g.index_put((torch.arange(tokens), labels), torch.zeros(())) if apart else g)
            scale = row_scale_reference(torch.stack([W[s:e].abs().amax(0) for s, e in chunks]).amax(0))
            dh = bf16(sum(gq[:, s:e] @ through(W[s:e], scale) for s, e in chunks))
            if apart:
                dh = dh + W[labels] * target[:, None]
            if config == "fp8-sum-corrected":  # the probabilities' exact sum, 1 - p (= -target), against the rows'
                missing = -target.double() - gq.double().sum(1)
                dh = dh + (missing[:, None] * W.double().mean(0)).float()
            dh = bf16(dh)
            hT = rows(h.t().contiguous())  # dW: g.T and h.T along the tokens
        else:
            dh = bf16(sum(g[:, s:e] @ W[s:e] for s, e in chunks))
        diff = norm = 0.0
        for s, e in chunks:
            reference = g_ref[:, s:e].t().double() @ h.double()
            if fp8_bwd:
                got = bf16(rows(g[:, s:e].t().contiguous()) @ hT.t())
            else:
                got = bf16(g[:, s:e].t() @ h)
            diff += float((got.double() - reference).pow(2).sum())
            norm += float(reference.pow(2).sum())

        def error(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.double() - b.double()).norm() / b.double().norm())

        found.append(
            {
                "config": config,
                "logit_std": logit_std,
                "peak": peak,
                "shared": shared,
                "measured_logit_std": round(float(logits.std()), 3),
                "seed": seed,
                "loss": loss,
                "loss_ref": loss_ref,
                "errors": {
                    "loss": abs(loss - loss_ref) / abs(loss_ref),
                    "logits": error(z, logits),
                    "g": error(g, g_ref),
                    "dh": error(dh, dh_ref),
                    "dW": math.sqrt(diff / norm),
                    "dh_shared": error(dh @ direction, dh_ref @ direction),
                },
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        print(json.dumps({k: v for k, v in found[-1].items()}), flush=True)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--logit-std", type=float, nargs="*", default=[1.4, 4.0])
    parser.add_argument("--peak", type=float, nargs="*", default=[0.0, 0.1], help="how far h leans to one token")
    parser.add_argument("--shared", type=float, nargs="*", default=[0.0], help="W's rows' shared part (see above)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--configs", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    hidden, vocab = SHAPES[args.shape]
    base = {
        "benchmark": "fp8_head",
        "date": today(),
        "gpu": "cpu (the GEMMs in fp32 on the dequantized FP8 values)",
        "versions": versions(("torch",)),
        "code": code(),
        "command": command("benchmarks/studies/fp8_head.py", argv),
        "shape": args.shape,
        "hidden": hidden,
        "vocab": vocab,
        "tokens": args.tokens,
    }
    for seed in args.seeds:
        for spread, peak, shared in itertools.product(args.logit_std, args.peak, args.shared):
            for row in run(hidden, vocab, args.tokens, spread, peak, shared, seed, args.configs):
                if args.out:
                    with open(args.out, "a") as file:
                        file.write(json.dumps({**base, **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
