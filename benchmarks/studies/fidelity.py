"""Fidelity at full layer shapes: one training step's loss and every parameter's gradient, against fp32.

    python benchmarks/studies/fidelity.py --shape 27b --site-fla /tmp/site-fla --site-tl /tmp/site-tl \
        --out fidelity.jsonl

The reference is the same model in fp32 on transformers' eager paths (a process that cannot import fla or
causal-conv1d), deterministic. Then ``hf-fast``, ``liger`` and ``fusepatch`` each run the same step in bf16 in
their own process, from the same fp32 weights (built from one seed, cast to bf16) and the same tokens. For every
parameter the relative error ``||g - g_ref|| / ||g_ref||`` is recorded; the table puts fusepatch's beside
hf-fast's and names every parameter where fusepatch's error exceeds 1.25x hf-fast's.

FP8 (allowed to be less precise than bf16; the question is by how much, per projection): ``fusepatch-fp8`` is
``apply(model, precision="fp8")``; ``fp8-projections`` is the model as in hf-fast with only its decoder
projections through fusepatch's FP8 function (``fusepatch.ops.fp8_linear.scaled_mm.fp8_linear``: Triton
quantization on a GPU, its PyTorch twins with the same bits elsewhere, ``torch._scaled_mm`` on either), which
also runs on a CPU (``--device cpu``; ``--vocab`` shrinks the LM head, which stays bf16, to fit memory). A second
table gives each projection's median gradient error against its bf16 twin's (``fusepatch`` for ``fusepatch-fp8``,
``hf-fast`` for ``fp8-projections``).

One JSON line per configuration goes to ``--out`` (date, GPU, versions, command), and the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (this file is benchmarks/studies/fidelity.py)
sys.path.insert(0, os.path.dirname(HERE))  # the harness: benchmarks/
sys.path.insert(1, ROOT)  # the driver reads fusepatch's projection names where it is not installed

from provenance import command, gpu_name, today, versions  # noqa: E402
from shapes import SHAPES, build_config  # noqa: E402

CONFIGS = ("hf-fast", "liger", "fusepatch")
FP8_CONFIGS = {"fusepatch-fp8": "fusepatch", "fp8-projections": "hf-fast"}  # each with its bf16 twin
PACKAGES = ("torch", "transformers", "triton", "fla-core", "causal-conv1d", "tilelang", "liger-kernel")
RATIO = 1.25  # fusepatch's error may be at most this times hf-fast's, parameter by parameter


def model_and_batch(
    shape: str, layers: int | None, seq: int | None, batch: int | None, device: torch.device, vocab: int | None = None
):
    """The fp32 model (one seed) and the token batch (another), the same in every process."""
    from transformers import AutoModelForCausalLM

    spec = SHAPES[shape]
    seq, batch = seq or spec["seq"], batch or spec["batch"]
    config = build_config(shape, layers)
    if vocab:
        config.vocab_size = vocab
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    return model.train(), ids


def step(model, ids) -> float:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def worker(args) -> int:
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 GEMMs, not TF32
    torch.backends.cudnn.allow_tf32 = False
    model, ids = model_and_batch(args.shape, args.layers, args.seq, args.batch, device, args.vocab)
    info: dict = {"config": args.role, "versions": versions(PACKAGES, absent=False)}
    if args.role == "reference":
        torch.use_deterministic_algorithms(True, warn_only=True)
        info["loss"] = step(model, ids)
        grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
        torch.save({"loss": info["loss"], "grads": grads}, args.reference)
    else:
        model.to(torch.bfloat16)
        if args.role == "liger":
            import liger_kernel.transformers as liger

            liger.apply_liger_kernel_to_qwen3_5(rope=False, model=model)  # Liger's rope raises for Qwen3.5
        if args.role in ("fusepatch", "fusepatch-fp8"):
            import fusepatch

            report = fusepatch.apply(model, **({"precision": "fp8"} if args.role == "fusepatch-fp8" else {}))
            info["fallbacks"] = report.log_lines()
        if args.role == "fp8-projections":
            info["fp8_projections"] = fp8_projections(model)
        loss = step(model, ids)
        reference = torch.load(args.reference, mmap=True)
        info["loss"] = loss
        info["loss_error"] = abs(loss - reference["loss"]) / abs(reference["loss"])
        errors = {}
        for name, p in model.named_parameters():
            ref = reference["grads"][name].to(device)
            errors[name] = float((p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-30))
        info["errors"] = errors
    with open(args.json_out, "w") as f:
        json.dump(info, f)
    return 0


def fp8_projections(model: torch.nn.Module) -> int:
    """The decoder projections ``apply(precision="fp8")`` would train in FP8, their forward through fusepatch's
    FP8 function and nothing else changed; how many."""
    from fusepatch.layers.fp8 import PROJECTIONS, aligned
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    count = 0
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and name.rpartition(".")[2] in PROJECTIONS and aligned(module) is None:
            module.forward = lambda x, m=module: fp8_linear(x, m.weight, m.bias)
            count += 1
    return count


def projection(name: str) -> str | None:
    """The projection a parameter belongs to (``q_proj``, ``down_proj``...), None for any other parameter."""
    from fusepatch.layers.fp8 import PROJECTIONS

    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-2] in PROJECTIONS and parts[-1] == "weight" else None


def projection_medians(errors: dict[str, float]) -> dict[str, float]:
    """Each projection's median gradient error over the layers that hold it."""
    grouped: dict[str, list[float]] = {}
    for name, error in errors.items():
        kind = projection(name)
        if kind is not None:
            grouped.setdefault(kind, []).append(error)
    return {kind: statistics.median(values) for kind, values in sorted(grouped.items())}


def bf16_twin(role: str, results: dict[str, dict]) -> str | None:
    """The bf16 configuration an FP8 one is compared with: the same code in bf16 where it ran (``fusepatch`` for
    ``fusepatch-fp8``, ``hf-fast`` for ``fp8-projections``), else the first bf16 configuration."""
    twin = FP8_CONFIGS[role]
    if twin in results:
        return twin
    return next((other for other in results if other not in FP8_CONFIGS), None)


def projection_ratios(results: dict[str, dict]) -> dict[str, dict]:
    """For each FP8 configuration: its median error per projection over its bf16 twin's, and the twin's name."""
    ratios = {}
    for role in results:
        base = bf16_twin(role, results) if role in FP8_CONFIGS else None
        if base is None:
            continue
        ours, theirs = (projection_medians(results[r]["errors"]) for r in (role, base))
        ratios[role] = {"base": base, **{kind: ours[kind] / value for kind, value in theirs.items() if kind in ours}}
    return ratios


def projection_table(results: dict[str, dict]) -> str:
    """Each FP8 configuration's median error per projection beside its bf16 twin's."""
    lines = []
    for role, ratios in projection_ratios(results).items():
        base = ratios["base"]
        ours, theirs = (projection_medians(results[r]["errors"]) for r in (role, base))
        lines += ["", "", f"| projection | {base} (bf16) | {role} | {role} / {base} |", "|---|---|---|---|"]
        lines += [
            f"| {kind} | {theirs[kind]:.4f} | {ours[kind]:.4f} | {ratios[kind]:.1f}x |"
            for kind in ours
            if kind in ratios
        ]
    return "\n".join(lines)


def short(name: str) -> str:
    return name.removeprefix("model.").replace("layers.", "L").replace(".weight", "")


def table(results: dict[str, dict], reference: dict) -> tuple[str, list[str]]:
    """The markdown table (worst parameters per configuration) and fusepatch's parameters beyond the ratio."""
    lines = [
        f"reference (fp32, eager) loss {reference['loss']:.6f}",
        "",
        "| config | loss rel. error | median param rel. error | max param rel. error (parameter) |",
        "|---|---|---|---|",
    ]
    for config, info in results.items():
        errors = info["errors"]
        worst = max(errors, key=errors.get)
        median = sorted(errors.values())[len(errors) // 2]
        lines.append(f"| {config} | {info['loss_error']:.2e} | {median:.4f} | {errors[worst]:.4f} ({short(worst)}) |")
    beyond = []
    if "fusepatch" in results and "hf-fast" in results:
        ours, theirs = results["fusepatch"]["errors"], results["hf-fast"]["errors"]
        for name in ours:
            if ours[name] > RATIO * theirs[name]:
                beyond.append(f"{short(name)}: fusepatch {ours[name]:.4f} vs hf-fast {theirs[name]:.4f}")
        lines += ["", f"fusepatch's error > {RATIO}x hf-fast's for {len(beyond)} of {len(ours)} parameters"]
        lines += [f"- {b}" for b in beyond[:40]]
        worst = sorted(ours, key=lambda n: ours[n] / max(theirs[n], 1e-12), reverse=True)[:8]
        lines += [
            "",
            "largest ratios fusepatch/hf-fast: "
            + ", ".join(f"{short(n)} {ours[n] / max(theirs[n], 1e-12):.2f}" for n in worst),
        ]
    return "\n".join(lines), beyond


def driver(args) -> int:
    workdir = args.workdir or f"/tmp/fidelity-{args.shape}"
    os.makedirs(workdir, exist_ok=True)
    reference = os.path.join(workdir, "reference.pt")
    common = ["--shape", args.shape, "--reference", reference, "--device", args.device]
    for flag in ("layers", "seq", "batch", "vocab"):
        if getattr(args, flag):
            common += [f"--{flag}", str(getattr(args, flag))]
    results, ref_info = {}, None
    for role in ("reference", *args.configs.split(",")):
        paths = [ROOT] + ([] if role == "reference" else [args.site_fla, args.site_tl])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), FLA_FLASH_QLA="0")
        out = os.path.join(workdir, f"{role}.json")
        start = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--json-out", out, *common]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(f"{role}: exit {done.returncode} after {time.perf_counter() - start:.0f} s", flush=True)
        if done.returncode != 0:
            print(done.stderr[-4000:], flush=True)
            continue
        with open(out) as f:
            info = json.load(f)
        if role == "reference":
            ref_info = info
        else:
            results[role] = info
    if ref_info is None:
        return 1
    text, beyond = table(results, ref_info)
    print(text + projection_table(results))
    record = {
        "benchmark": "fidelity",
        "date": today(),
        "gpu": gpu_name() if args.device == "cuda" else args.device,
        "command": command(__file__),
        "environment": {name: value for name, value in sorted(os.environ.items()) if name.startswith("FUSEPATCH_")},
        "shape": args.shape,
        "layers": args.layers or SHAPES[args.shape]["layers"],
        "seq": args.seq or SHAPES[args.shape]["seq"],
        "batch": args.batch or SHAPES[args.shape]["batch"],
        **({"vocab": args.vocab} if args.vocab else {}),
        "reference_loss": ref_info["loss"],
        "versions": {role: info["versions"] for role, info in results.items()},
        "results": {
            role: {
                "loss": info["loss"],
                "loss_error": info["loss_error"],
                "errors": info["errors"],
                "projection_median_error": projection_medians(info["errors"]),
                **({"fallbacks": info["fallbacks"]} if info.get("fallbacks") else {}),
                **({"fp8_projections": info["fp8_projections"]} if "fp8_projections" in info else {}),
            }
            for role, info in results.items()
        },
        "projection_error_ratio": projection_ratios(results),
        "beyond_ratio": beyond,
    }
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (the LM head's size)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--site-fla", default="/tmp/site-fla")
    parser.add_argument("--site-tl", default="/tmp/site-tl")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="append the record (one JSON line) to this file")
    parser.add_argument("--role", default=None, choices=["reference", *CONFIGS, *FP8_CONFIGS], help=argparse.SUPPRESS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    return worker(args) if args.role else driver(args)


if __name__ == "__main__":
    sys.exit(main())
