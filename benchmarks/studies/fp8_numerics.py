"""Where FP8 projections' gradient error comes from: one step's gradients against fp32, one FP8 choice changed at a time.

    python benchmarks/studies/fp8_numerics.py --shape 2b --layers 4 --seq 512 --out fp8-numerics.jsonl

``precision="fp8"`` runs each decoder projection's three GEMMs (output, input gradient, weight gradient) on
float8_e4m3fn operands with one power-of-two scale per row along the GEMM's reduction dimension. Its loss curve
leaves bf16's seed spread in some windows (docs/fp8.md); this asks which of those choices carries the error, the
way torchao's recipes differ: the weight-gradient GEMM in bf16 (torchao's ``ROWWISE_WITH_GW_HP``), the input
gradient's GEMM in bf16, the backward in bf16 (FP8 forward only), the gradients in float8_e5m2 (more range, one
mantissa bit less), FP8 in the MLPs alone or in the token mixers alone.

Each configuration is the model of ``benchmarks/shapes.py`` at ``--layers`` (random weights, one seed; the LM head
at ``--vocab``), in bf16, its decoder projections (``layers/fp8.PROJECTIONS``) computed by this file's function
with that configuration's formats; ``bf16`` computes them by the same function in bf16 (it must match the plain
bf16 model: the check of the function itself), ``fp8`` is the library's choice (it must match
``fusepatch.ops.fp8_linear.scaled_mm.fp8_linear`` within the accumulation order: checked too). The GEMMs run in
fp32 on the dequantized values and are rounded to bf16, as ``torch._scaled_mm`` writes them. The reference is the
same model and batch in fp32. Per configuration: the loss's relative error and the median, over the decoder
projections' weights and over the other parameters, of each gradient's relative error
``||g - g_ref|| / ||g_ref||``. One JSON line per configuration goes to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the harness: benchmarks/
sys.path.insert(1, ROOT)
sys.path.insert(2, HERE)

from fidelity import model_and_batch, step  # noqa: E402
from provenance import code, command, today, versions  # noqa: E402

from fusepatch.layers.fp8 import PROJECTIONS, aligned  # noqa: E402
from fusepatch.ops.fp8_linear.scaled_mm import row_scale_reference  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = None  # a GEMM left in bf16
MIXER = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}


class Formats(NamedTuple):
    """Each GEMM's operand formats (None: that GEMM in bf16): the output's (input, weight), the input gradient's
    (gradient, weight), the weight gradient's (gradient, input); ``only``: the projections it applies to."""

    output: tuple | None
    input_grad: tuple | None
    weight_grad: tuple | None
    only: frozenset = frozenset(MIXER | MLP)


FP8 = (E4M3, E4M3)
CONFIGS = {
    "bf16": Formats(BF16, BF16, BF16),
    "fp8": Formats(FP8, FP8, FP8),
    "fp8-weight-grad-bf16": Formats(FP8, FP8, BF16),
    "fp8-input-grad-bf16": Formats(FP8, BF16, FP8),
    "fp8-forward-only": Formats(FP8, BF16, BF16),
    "fp8-e5m2-grads": Formats(FP8, (E5M2, E4M3), (E5M2, E4M3)),
    "fp8-mlp-only": Formats(FP8, FP8, FP8, frozenset(MLP)),
    "fp8-mixer-only": Formats(FP8, FP8, FP8, frozenset(MIXER)),
}


def through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [rows, K] through ``dtype`` with one power-of-two scale per row (the rule of ``kernels/fp8``), back in
    fp32: for float8_e4m3fn the values of ``quantize_rows_reference``."""
    top = torch.finfo(dtype).max
    values = x.float()
    scale = row_scale_reference(values.abs().amax(dim=1, keepdim=True), top)
    return (values * scale).clamp(-top, top).to(dtype).float() / scale


def gemm(a: torch.Tensor, b: torch.Tensor, formats: tuple | None) -> torch.Tensor:
    """``a @ b.t()`` for ``a [M, K]``, ``b [N, K]``, both along K: in fp32 on the values each format leaves (bf16's
    own where None), rounded to bf16."""
    if formats is None:
        a, b = a.float(), b.float()
    else:
        a, b = through(a, formats[0]), through(b, formats[1])
    return (a @ b.t()).to(torch.bfloat16)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, formats: Formats):
        ctx.save_for_backward(x, weight)
        ctx.formats = formats
        return gemm(x, weight, formats.output)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        formats = ctx.formats
        dx = gemm(grad, weight.t(), formats.input_grad).to(x.dtype)  # along the outputs
        dw = gemm(grad.t(), x.t(), formats.weight_grad).to(weight.dtype)  # along the tokens
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias, formats: Formats) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = _Linear.apply(flat, weight, formats).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def replace(model: torch.nn.Module, formats: Formats | str) -> int:
    """The decoder projections computed by ``linear`` with ``formats`` (or by the library's ``fp8_linear``);
    how many."""
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    count = 0
    for name, module in model.named_modules():
        kind = name.rpartition(".")[2]
        if type(module) is not torch.nn.Linear or kind not in PROJECTIONS or aligned(module) is not None:
            continue
        if formats == "library":
            module.forward = lambda x, m=module: fp8_linear(x, m.weight, m.bias)
        elif kind in formats.only:
            module.forward = lambda x, m=module: linear(x, m.weight, m.bias, formats)
        else:
            continue
        count += 1
    return count


def errors_of(model: torch.nn.Module, reference: dict) -> dict[str, float]:
    return {
        name: float((p.grad.float() - reference[name]).norm() / reference[name].norm().clamp_min(1e-30))
        for name, p in model.named_parameters()
    }


def summary(errors: dict[str, float]) -> dict[str, float]:
    projections = [e for n, e in errors.items() if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]
    others = [e for n, e in errors.items() if not (n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS)]
    return {"projections_median": statistics.median(projections), "others_median": statistics.median(others)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cpu")
    model, ids = model_and_batch(args.shape, args.layers, args.seq, 1, device, args.vocab)
    base = {
        "benchmark": "fp8_numerics",
        "date": today(),
        "gpu": "cpu (the GEMMs in fp32 on the dequantized values)",
        "versions": versions(("torch", "transformers")),
        "code": code(),
        "command": command("benchmarks/studies/fp8_numerics.py", argv),
        "shape": args.shape,
        "layers": args.layers,
        "tokens": args.seq,
        "vocab": args.vocab,
    }
    start = time.perf_counter()
    loss_ref = step(model, ids)
    reference = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    print(f"reference loss {loss_ref:.6f} ({time.perf_counter() - start:.0f} s)", flush=True)
    runs = [("bf16-model", None)] + [(name, CONFIGS[name]) for name in args.configs] + [("fp8-library", "library")]
    for name, formats in runs:
        start = time.perf_counter()
        copy_ = copy.deepcopy(model).to(torch.bfloat16)
        count = 0 if formats is None else replace(copy_, formats)
        loss = step(copy_, ids)
        errors = errors_of(copy_, reference)
        row = {
            **base,
            "config": name,
            "projections": count,
            "loss": loss,
            "loss_ref": loss_ref,
            "loss_error": abs(loss - loss_ref) / abs(loss_ref),
            **summary(errors),
            "errors": errors,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps({k: v for k, v in row.items() if k not in ("errors", *base)}), flush=True)
        if args.out:
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")
        del copy_
    return 0


if __name__ == "__main__":
    sys.exit(main())
