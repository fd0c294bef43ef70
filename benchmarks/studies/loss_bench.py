"""The causal-LM loss alone (lm_head matmul + cross-entropy, forward + backward) at a model's real sizes.

    python benchmarks/studies/loss_bench.py --shape 27b --json-out loss.json

Each implementation gets the same bf16 hidden states, lm_head weight and labels; one call = loss forward +
backward to the hidden states and the weight. Median of ``--steps`` calls after ``--warmup``, peak memory above
the inputs, and the error of the loss and both gradients against the eager (full logits) path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from shapes import build_config  # noqa: E402

from fusepatch.ops.common import relative_error  # noqa: E402
from fusepatch.ops.linear_cross_entropy import (  # noqa: E402
    DEFAULT_LOGITS_MIB,
    LINEAR_CROSS_ENTROPY,
    fla_num_chunks,
    linear_cross_entropy_chunked,
)
from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_reference as eager  # noqa: E402


def implementations(fla_budgets: list[int] = (), tokens: int = 4096, vocab: int = 248320) -> dict:
    # eager: transformers' path (full logits in the model dtype, upcast, mean over the labelled tokens)
    found = {"eager (full logits)": eager, "fusepatch torch-chunked": linear_cross_entropy_chunked}
    try:
        candidate = next(c for c in LINEAR_CROSS_ENTROPY.candidates if c.name == "triton")
        os.environ.pop("FUSEPATCH_CE_LOGITS_MIB", None)
        found[f"fusepatch triton (its own kernel, chunk logits <= {DEFAULT_LOGITS_MIB} MiB)"] = candidate.load()
    except ImportError as exc:
        print(f"triton not importable: {exc}", file=sys.stderr)
    try:
        from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

        found["fla, fp32 weight-grad accumulation (fla's default)"] = lambda h, w, y: fused_linear_cross_entropy_loss(
            h, y, w, reduction="mean"
        )
        found["fla, GEMMs in bf16, fla's 8 chunks"] = lambda h, w, y: fused_linear_cross_entropy_loss(
            h, y, w, reduction="mean", accumulate_grad_in_fp32=False
        )
        chunks = fla_num_chunks(tokens, vocab, 2, DEFAULT_LOGITS_MIB * 2**20)
        found[f"fla's function, GEMMs in bf16, {chunks} chunks (fusepatch's adapter before the own loop)"] = (
            lambda h, w, y: fused_linear_cross_entropy_loss(
                h, y, w, reduction="mean", accumulate_grad_in_fp32=False, num_chunks=chunks
            )
        )
        candidate = next(c for c in LINEAR_CROSS_ENTROPY.candidates if c.name == "fla")
        os.environ.pop("FUSEPATCH_CE_LOGITS_MIB", None)
        found[f"fusepatch fla (default: GEMMs in bf16, chunk logits <= {DEFAULT_LOGITS_MIB} MiB)"] = candidate.load()
        for mib in fla_budgets:  # FUSEPATCH_CE_LOGITS_MIB: fewer, larger chunks
            os.environ["FUSEPATCH_CE_LOGITS_MIB"] = str(mib)
            found[f"fusepatch fla, chunk logits <= {mib} MiB"] = candidate.load()
        os.environ.pop("FUSEPATCH_CE_LOGITS_MIB", None)
    except ImportError as exc:
        print(f"fla not importable: {exc}", file=sys.stderr)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, w, y):
            out = liger_fused_linear_cross_entropy(h, w, y)
            return out[0] if isinstance(out, tuple) else out

        found["liger"] = liger
    except ImportError as exc:
        print(f"liger not importable: {exc}", file=sys.stderr)
    return found


def kernel_rows(tokens: int, vocab: int, steps: int) -> list[dict]:
    """The cross-entropy kernels alone on one chunk's bf16 logits (what the loop runs between its GEMMs): fla's
    forward, its forward + backward, fusepatch's kernel without and with the gradient, and the latter at other
    launch configurations (BLOCK, warps). CUDA events around ``steps`` back-to-back calls; the gradient is written
    over the logits in place, so later calls read gradients (timing does not depend on the values)."""
    from fusepatch.kernels import cross_entropy as own

    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[::11] = -100
    inverse = torch.full((1,), 1 / tokens, device="cuda")
    calls = {}
    try:
        from fla.modules.fused_cross_entropy import ops

        def fla_both():
            _, _, lse, classes, first = ops.cross_entropy_fwd(logits=logits, target=target, ignore_index=-100)
            ops.cross_entropy_bwd(
                logits=logits, target=target, lse=lse, dloss=inverse.expand(tokens), ignore_index=-100,
                total_classes=classes, class_start_idx=first, inplace_backward=True,
            )  # fmt: skip

        calls["fla forward"] = lambda: ops.cross_entropy_fwd(logits=logits, target=target, ignore_index=-100)
        calls["fla forward + backward"] = fla_both
    except ImportError as exc:
        print(f"fla not importable: {exc}", file=sys.stderr)
    names = ("BLOCK", "WARPS", "GRAD_BLOCK", "GRAD_WARPS")
    default = tuple(getattr(own, n) for n in names)
    variants = [default, (4096, 8, 4096, 8), (2048, 4, 2048, 4), (4096, 4, 4096, 4), (4096, 4, 8192, 8),
                (4096, 4, 8192, 16), (4096, 4, 16384, 16)]  # fmt: skip
    for variant in variants:
        tag = "default" if variant == default else ", ".join(f"{n} {v}" for n, v in zip(names, variant))
        for grad in (False, True):
            if not grad and variant[:2] == default[:2] and variant != default:
                continue  # the loss pass alone at the default's settings: timed once

            def run(variant=variant, grad=grad):
                for name, value in zip(names, variant):
                    setattr(own, name, value)
                try:
                    own.cross_entropy_(logits, target, inverse, -100, grad)
                finally:
                    for name, value in zip(names, default):
                        setattr(own, name, value)

            calls[f"fusepatch {'loss + gradient' if grad else 'loss'} ({tag})"] = run
    rows = []
    bytes_read = logits.numel() * logits.element_size()
    for name, fn in calls.items():
        try:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / steps
            rows.append({"kernels": name, "ms": round(ms, 3), "logits GB/s read once": round(bytes_read / ms / 1e6)})
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a row
            rows.append({"kernels": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json-out", default=None)
    parser.add_argument(
        "--fla-budgets",
        default="512,1024,2048",
        help="FUSEPATCH_CE_LOGITS_MIB values to measure (MiB, comma-separated)",
    )
    parser.add_argument("--kernels", action="store_true", help="also time the cross-entropy kernels alone")
    args = parser.parse_args()
    budgets = [int(x) for x in args.fla_budgets.split(",") if x.strip()]
    config = build_config(args.shape, 1).get_text_config()
    hidden_size, vocab = config.hidden_size, config.vocab_size
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * hidden_size**-0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (args.tokens,), device="cuda")
    labels[::11] = -100

    def call(fn):
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        loss = fn(h, w, labels)
        loss.backward()
        return loss.detach().float(), h.grad.float(), w.grad.float()

    reference = call(eager)
    rows = []
    for name, fn in implementations(budgets, args.tokens, vocab).items():
        try:
            for _ in range(args.warmup):
                out = call(fn)
            del out
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats(hidden.device)
            times = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call(fn)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            peak = torch.cuda.memory_stats(hidden.device)["allocated_bytes.all.peak"]
            out = call(fn)
            errors = [relative_error(a, b) for a, b in zip(out, reference)]
            rows.append(
                {
                    "impl": name,
                    "median_ms": round(statistics.median(times) * 1000, 2),
                    "extra_peak_gib": round((peak - base) / 2**30, 2),
                    "err_loss": errors[0],
                    "err_dhidden": errors[1],
                    "err_dweight": errors[2],
                }
            )
        except Exception as exc:  # noqa: BLE001 - one failing implementation is a row, not a crash
            rows.append({"impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    print(
        f"shape {args.shape}: tokens {args.tokens}, hidden {hidden_size}, vocab {vocab}, bf16; {torch.cuda.get_device_name(0)}"
    )
    print("| implementation | median ms (fwd+bwd) | extra peak GiB | loss err | d hidden err | d weight err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | fails: {r['error'][:120]} | | | | |")
        else:
            print(
                f"| {r['impl']} | {r['median_ms']} | {r['extra_peak_gib']} | {r['err_loss']:.3g} | "
                f"{r['err_dhidden']:.1e} | {r['err_dweight']:.1e} |"
            )
    if args.kernels:
        del hidden, weight, reference
        torch.cuda.empty_cache()
        kernels = kernel_rows(args.tokens, vocab, args.steps)
        print(f"\nthe cross-entropy kernels alone, {args.tokens} x {vocab} bf16 logits, {args.steps} calls each")
        print("| kernels | ms a call | logits read once, GB/s |")
        print("| --- | ---: | ---: |")
        for r in kernels:
            print(f"| {r['kernels']} | {r.get('ms', r.get('error'))} | {r.get('logits GB/s read once', '')} |")
        rows.append({"kernels": kernels})
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
