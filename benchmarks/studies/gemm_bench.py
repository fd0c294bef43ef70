"""Every GEMM of one training step at a shape's real sizes, alone, in each formulation torch could run it.

    python benchmarks/studies/gemm_bench.py --shape 27b --json-out gemm.json

Why: at the 27B shape the step is its kernels (GPU busy 0.97) and the GEMMs are two thirds of them; the lm_head's
weight gradient (``dlogits.t() @ hidden``, 10.4 TFLOP) took 21 ms in the training step (H200 run of 2026-11-30), ~500
TFLOP/s where the forward GEMMs run ~750. This times, per projection of the model (forward, input gradient,
weight gradient; bf16, the step's token count), the formulation the step uses and the alternatives that give the
same matrix: the transposed product transposed back, an operand copied token-minor first (the weight gradient's
operands both have the tokens as their strided dimension, which makes both of cuBLAS's operands MN-major; a copy
of the small input makes one of them K-major), cuBLASLt instead of cuBLAS, the output split in row blocks, the
tokens split in two accumulated halves. Each row: median of
``--repeat`` runs after ``--warmup``, TFLOP/s, and the per-step total (the site's count in the model).

``--fp8``: the FP8 projections' GEMMs instead (``apply(model, precision="fp8")``: every site but the LM head and the
Gated DeltaNet's gates), their operands quantized beforehand as fusepatch's op does, each role called as the op
calls ``torch._scaled_mm`` (with fast accumulation, ``scaled_mm.FAST_ACCUM``) and without fast accumulation, beside
the bf16 GEMM of the same matrix; each row also gives its relative error (Frobenius norm) against the fp32 product
of the bf16 operands, which is what fast accumulation trades. (Records before the op adopted it name the forms
"fp8 as fusepatch calls it", then without, and "fp8 use_fast_accum".)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from provenance import gpu_name, median_ms  # noqa: E402
from shapes import SHAPES  # noqa: E402


def sites(shape: dict) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, calls per step) for every projection of a Qwen3.5 / Qwen3 shape; calls 0
    for a formulation timed for comparison that fusepatch's step no longer runs (``in_proj_b`` / ``in_proj_a`` as
    separate GEMMs: fusepatch joins them)."""
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["layers"], shape["vocab_size"]
    q_out = shape["num_attention_heads"] * shape["head_dim"]
    kv_out = shape["num_key_value_heads"] * shape["head_dim"]
    if shape["model_type"].startswith("qwen3_5"):
        full = layers // 4
        linear = layers - full
        key = shape["linear_num_key_heads"] * shape["linear_key_head_dim"]
        value = shape["linear_num_value_heads"] * shape["linear_value_head_dim"]
        heads = shape["linear_num_value_heads"]
        gated = [
            ("gdn in_proj_qkv", h, 2 * key + value, linear),
            ("gdn in_proj_z", h, value, linear),
            ("gdn in_proj_b / a separate (hf; per GEMM, 2 a layer)", h, heads, 0),
            ("gdn in_proj_b + a joined (fusepatch)", h, 2 * heads, linear),
            ("gdn out_proj", value, h, linear),
            ("attn q_proj (+gate)", h, 2 * q_out, full),
        ]
    else:
        full, gated = layers, [("attn q_proj", h, q_out, layers)]
    return [
        *gated,
        ("attn k_proj / v_proj", h, kv_out, 2 * full),
        ("attn o_proj", q_out, h, full),
        ("mlp gate / up", h, i, 2 * layers),
        ("mlp down", i, h, layers),
        ("lm_head", h, v, 1),
    ]


@contextlib.contextmanager
def blas(name: str):
    """cuBLAS or cuBLASLt for the GEMMs inside (torch's preferred BLAS library)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def formulations(x, w, dy) -> dict[str, dict[str, callable]]:
    """role -> formulation -> a call returning the role's matrix (the first of each role is what the step runs)."""
    tokens = x.shape[0]
    half = tokens // 2

    def split_rows(parts: int):
        def run():
            out = torch.empty(w.shape, device=w.device, dtype=w.dtype)
            for rows in torch.arange(w.shape[0]).chunk(parts):
                s = slice(int(rows[0]), int(rows[-1]) + 1)
                torch.mm(dy[:, s].t(), x, out=out[s])
            return out

        return run

    def split_tokens():
        out = torch.mm(dy[:half].t(), x[:half])
        return out.addmm_(dy[half:].t(), x[half:])

    return {
        "forward y = x @ W.t()": {
            "mm(x, W.t())": lambda: torch.mm(x, w.t()),
            "cublaslt": lambda: torch.mm(x, w.t()),
        },
        "input grad dx = dy @ W": {
            "mm(dy, W)": lambda: torch.mm(dy, w),
            "cublaslt": lambda: torch.mm(dy, w),
            "mm(W.t(), dy.t()).t() copied": lambda: torch.mm(w.t(), dy.t()).t().contiguous(),
        },
        "weight grad dW = dy.t() @ x": {
            "mm(dy.t(), x)": lambda: torch.mm(dy.t(), x),
            "cublaslt": lambda: torch.mm(dy.t(), x),
            "mm(x.t(), dy).t() copied": lambda: torch.mm(x.t(), dy).t().contiguous(),
            "x copied token-minor first": lambda: torch.mm(dy.t(), x.t().contiguous().t()),
            "dy copied token-minor first": lambda: torch.mm(dy.t().contiguous(), x),
            "both copied token-minor first": lambda: torch.mm(dy.t().contiguous(), x.t().contiguous().t()),
            "4 row blocks": split_rows(4),
            "16 row blocks": split_rows(16),
            "tokens in 2 halves (mm + addmm_)": split_tokens,
        },
    }


# the sites whose projections FP8 trains (the LM head and the Gated DeltaNet's one-output-per-head gates stay bf16)
FP8_SKIPS = ("lm_head", "gdn in_proj_b")


def fp8_formulations(x, w, dy) -> dict[str, dict[str, callable]]:
    """role -> formulation -> a call returning the role's matrix from FP8 operands quantized here, before the
    timing, as ``fusepatch.ops.fp8_linear`` quantizes them (the first of each role is the op's own call)."""
    from fusepatch.ops.fp8_linear.scaled_mm import MULTIPLE, fp8_mm, quantizers

    quantize = quantizers(x.device)
    operands = {
        "forward y = x @ W.t()": (quantize.rows(x), quantize.rows(w), lambda: torch.mm(x, w.t())),
        "input grad dx = dy @ W": (quantize.rows(dy), quantize.columns(w), lambda: torch.mm(dy, w)),
        "weight grad dW = dy.t() @ x": (
            quantize.columns(dy, MULTIPLE),
            quantize.columns(x, MULTIPLE),
            lambda: torch.mm(dy.t(), x),
        ),
    }

    def scaled(a, a_inverse, b, b_inverse, **options):
        return lambda: torch._scaled_mm(
            a, b.t(), scale_a=a_inverse, scale_b=b_inverse.t(), out_dtype=torch.bfloat16, **options
        )

    forms = {}
    for role, ((a, a_inverse), (b, b_inverse), bf16) in operands.items():
        forms[role] = {
            "fp8 as fusepatch calls it": lambda a=a, ai=a_inverse, b=b, bi=b_inverse: fp8_mm(a, ai, b, bi, x.dtype),
            "fp8 without use_fast_accum": scaled(a, a_inverse, b, b_inverse, use_fast_accum=False),
            "bf16 mm": bf16,
        }
    return forms


def fp32_product(role: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The role's matrix in fp32 from the bf16 operands: what every formulation's error is measured against."""
    x, w, dy = x.float(), w.float(), dy.float()
    return {"forward": lambda: x @ w.t(), "input": lambda: dy @ w, "weight": lambda: dy.t() @ x}[role.split()[0]]()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` in Frobenius norm."""
    return float((got.float() - expected).norm() / expected.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated site names to time (default: all)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 projections' GEMMs (see above)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_bench.py times CUDA GEMMs: no CUDA device here")
    shape = SHAPES[args.shape]
    tokens = shape["seq"] * shape["batch"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"GPU {gpu_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, {tokens} tokens")
    print("| site | calls/step | role | formulation | median ms | TFLOP/s | ms/step | vs the step's | error vs fp32 |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, k, n, calls in sites(shape):
        if args.only and name not in args.only.split(","):
            continue
        if args.fp8 and name.startswith(FP8_SKIPS):
            continue
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        flop = 2 * tokens * k * n
        for role, forms in (fp8_formulations if args.fp8 else formulations)(x, w, dy).items():
            expected, base = fp32_product(role, x, w, dy), None
            for form, fn in forms.items():
                with blas("cublaslt" if form == "cublaslt" else "cublas"):
                    got = fn()
                    error = relative_error(got, expected)
                    # every formulation computes the same matrix (bf16's rounding, or FP8's, apart)
                    if error > (0.1 if args.fp8 else 2e-2):
                        raise AssertionError(f"{name} {role} {form}: relative error {error:.2e}")
                    del got
                    ms = median_ms(fn, args.warmup, args.repeat)
                base = base or ms
                row = dict(site=name, calls=calls, role=role, form=form, ms=ms, tflops=flop / ms / 1e9, error=error)
                row["step_runs_it"] = calls > 0 and form == next(iter(forms))
                rows.append(row)
                print(
                    f"| {name} | {calls} | {role} | {form} | {ms:.3f} | {row['tflops']:.0f} | {ms * calls:.2f} "
                    f"| {base / ms:.2f}x | {error:.4f} |",
                    flush=True,
                )
            del expected
        del x, w, dy
        torch.cuda.empty_cache()
    step = sum(r["ms"] * r["calls"] for r in rows if r["step_runs_it"])
    best = 0.0
    for key in {(r["site"], r["role"]) for r in rows if r["calls"]}:  # bf16 is no formulation of an FP8 step
        best += min(r["ms"] * r["calls"] for r in rows if (r["site"], r["role"]) == key and r["form"] != "bf16 mm")
    print(f"\nGEMMs per step as the step runs them: {step:.2f} ms; with each one's fastest formulation: {best:.2f} ms")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                dict(shape=args.shape, tokens=tokens, fp8=args.fp8, rows=rows, step_ms=step, best_ms=best), f, indent=1
            )


if __name__ == "__main__":
    main()
