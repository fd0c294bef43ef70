"""FSDP2 (fully_shard) worker: a patched tiny Qwen3.5 sharded over the ranks, against an unsharded, unpatched
copy on the same data. Run with torchrun; rank 0 writes the comparison to --out as JSON."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fusepatch
from fusepatch.tools.tiny import tiny_model


def _standin_add_norm() -> list:
    """Give the add-norm op a CPU candidate (its eager reference, counting calls)."""
    import dataclasses

    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.ops import OPS

    calls: list = []
    op = OPS["add_rms_norm_zero_centered"]

    def load():
        def standin(*args):
            calls.append(1)
            return op.reference(*args)

        return standin

    candidate = Candidate("cpu-standin", "pip", (), load, inputs=InputRule(devices=("cpu",)))
    OPS[op.name] = dataclasses.replace(op, candidates=(candidate,))
    return calls


def _fused_projections() -> list:
    """The projections' GPU paths on the CPU too; returns the list each use appends to."""
    from fusepatch.layers import simple
    from fusepatch.layers.support import projections

    seen: list[str] = []
    projections.DEVICES = ("cpu", "cuda")
    apply, plus = projections._SharedInputLinears.apply, projections.linear_plus

    def counted_apply(*args):
        seen.append("shared")
        return apply(*args)

    def counted_plus(*args):
        seen.append("residual")
        return plus(*args)

    projections._SharedInputLinears.apply = counted_apply
    simple.linear_plus = counted_plus
    return seen


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--order", choices=["patch-then-shard", "shard-then-patch"], default="patch-then-shard")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument(
        "--standin-add-norm",
        action="store_true",
        help="a CPU stand-in kernel for the fused residual add + norm, so the decoder layers take their fused forward",
    )
    parser.add_argument(
        "--fused-projections",
        action="store_true",
        help="run the GPU-only shared-input projections and residual GEMM (fusepatch.layers.support.projections) on the CPU",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    result = run(args)
    if result is not None:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    # as examples/sft_ultrachat.py ends: every rank done, the GIL free a moment for gloo's worker threads to
    # release the last collectives' tensors, then the group closed (see end_process_group there)
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict | None:
    """One comparison in the process group already open (``fsdp2_cases.py`` runs several in one launch; the stand-ins
    stay installed for the runs after it); rank 0 returns it."""
    calls = _standin_add_norm() if args.standin_add_norm else []
    projected = _fused_projections() if args.fused_projections else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(device, (world,))

    reference = tiny_model("qwen3_5_text", seed=0).to(device)
    model = tiny_model("qwen3_5_text", seed=0).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.order == "patch-then-shard":
        report = fusepatch.apply(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.order == "shard-then-patch":
        report = fusepatch.apply(model)

    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, 512, (2, 40), generator=generator) for _ in range(world)]
    ids = batches[rank].to(device)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    # FSDP averages gradients over the ranks: compare with the unsharded model's gradient of the mean loss.
    sharded = {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
        if hasattr(p.grad, "full_tensor")
        else p.grad
        for name, p in model.named_parameters()
    }
    losses = [torch.zeros((), device=device) for _ in range(world)]
    dist.all_gather(losses, loss.detach())

    ref_losses = []
    for batch in batches:
        out = reference(input_ids=batch.to(device), labels=batch.to(device), use_cache=False)
        (out.loss / world).backward()
        ref_losses.append(out.loss.detach())
    if rank == 0:
        worst = 0.0
        for name, p in reference.named_parameters():
            g = sharded[name]
            err = ((g - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
            worst = max(worst, err)
        result = {
            "world": world,
            "order": args.order,
            "patched_modules": report.patched,
            "loss_diff": max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses)),
            "worst_grad_rel_err": worst,
            "gdn_forward_patched": "_fusepatch" in model.model.layers[0].linear_attn.__dict__,
            "add_norm_calls": len(calls),
            "shared_input_calls": projected.count("shared"),
            "residual_gemm_calls": projected.count("residual"),
        }
        return result
    return None


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
