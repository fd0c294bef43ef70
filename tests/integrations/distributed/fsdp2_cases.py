"""FSDP2 as users run it, many cases in one process group (one launch: CI pays the start-up once).

Run with torchrun; each case named in ``--cases`` trains a tiny Qwen3.5 two optimizer steps through accelerate's
FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)`` and ``Accelerator.prepare``) or the Trainer's
``fsdp``/``fsdp_config`` arguments (the example's, ``examples/sft_ultrachat.py``), patched and unpatched, and two
ranks train the same model unsharded, one patched and one unpatched, on the same global batches. Rank 0 writes, per case,
each run's losses and its parameters' distance to the unsharded, unpatched run's (``--out``, JSON), and, for a
``memory`` case, what each rank holds against ``benchmarks/studies/static_memory.py``'s per-rank count.

Case names: ``<engine>-<full|lora>-<fp32|bf16>`` with engine ``accelerate`` or ``trainer``, ``memory-lora-fp8``
(a bf16 LoRA model whose frozen bases run in FP8, on the CPU stand-in of the FP8 op), and those of ``DIRECT``
(``fully_shard`` called directly, ``fsdp2_worker.py``'s comparisons, run last).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LR = 1e-3
LENGTH = 24
LAYER = "Qwen3_5DecoderLayer"


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _module(os.path.join(REPO, "examples", "sft_ultrachat.py"), "sft_ultrachat")


def build(lora: bool, dtype: torch.dtype = torch.float32, **sizes) -> torch.nn.Module:
    """The tiny Qwen3.5 every run of a case starts from (peft LoRA on every linear for ``lora``), same values."""
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text", seed=0, **sizes).to(dtype)
    if lora:
        import peft

        torch.manual_seed(1)  # lora_A's initialisation
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    return model


def batches(world: int, steps: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """One ``(world, LENGTH)`` global batch a step: rank r trains on row r. Rows of one length, no padding, every
    token a label: the mean of the ranks' mean losses is the global batch's mean loss."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (world, LENGTH), generator=generator) for _ in range(steps)]


def autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def unsharded(model: torch.nn.Module, steps: list[torch.Tensor], bf16: bool) -> tuple[list[float], dict]:
    """Two AdamW steps on the whole global batch in one process (bf16: autocast, as the Trainer's ``bf16=True``),
    clipped at 1.0 as the sharded runs are: the losses and the parameters after."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for ids in steps:
        with autocast(bf16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.detach().float().clone() for name, p in model.named_parameters()}


def full_parameters(model: torch.nn.Module) -> dict:
    """Every parameter gathered whole (a collective: every rank calls it), by its unwrapped name, in fp32."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = value.detach().float()
    return out


def sharded_layers(model: torch.nn.Module) -> int:
    """How many decoder layers are FSDP2 units (each itself, or the activation-checkpointing wrapper around it)."""
    from torch.distributed.fsdp import FSDPModule

    def name(module) -> str:
        return type(module).__name__.removeprefix("FSDP")

    return sum(
        isinstance(m, FSDPModule) and LAYER in (name(m), name(getattr(m, "_checkpoint_wrapped_module", m)))
        for m in model.modules()
    )


def reset_accelerate() -> None:
    """A fresh accelerate state for the next case (its mixed precision may differ); the process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def plugin():
    """accelerate's FSDP2 plugin as a user configures it for Qwen3.5 (the mixed precision comes from the run)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[LAYER],
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
    )


def through_accelerate(model, steps, rank: int, bf16: bool, memory=None) -> tuple[list[float], dict]:
    """accelerate's FSDP2 plugin on ``model``: ``prepare(model, optimizer)``, then the loop accelerate's docs show
    (``autocast``, ``backward``, ``clip_grad_norm_``). ``memory(model, optimizer)`` runs after each step, before
    ``zero_grad``."""
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=True)
    EXAMPLE.fsdp_on_cpu(accelerator, plugin())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert accelerator.is_fsdp2 and sharded_layers(model) == model.config.num_hidden_layers
    losses = []
    for ids in steps:
        with accelerator.autocast():
            loss = model(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1], use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if memory is not None:
            memory(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, full_parameters(model)


def through_trainer(model, rows: torch.Tensor, bf16: bool, lora: bool, checkpointing: bool) -> tuple[list, dict]:
    """The Trainer's ``fsdp``/``fsdp_config`` arguments as the example passes them: one row per rank, every row each
    step (``max_steps=2`` over a dataset of ``world`` rows), constant learning rate, plain AdamW."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    reset_accelerate()
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    layer_model = model.get_base_model() if lora else model
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=2,
            per_device_train_batch_size=1,
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            optim="adamw_torch",
            max_grad_norm=1.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            bf16=bf16,
            remove_unused_columns=False,
            seed=0,
            **EXAMPLE.fsdp_arguments(layer_model, checkpointing),
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
        assert EXAMPLE.trainer_fsdp_on_cpu(trainer)
        trainer.train()
    assert sharded_layers(trainer.model_wrapped) == layer_model.config.num_hidden_layers
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, full_parameters(trainer.model_wrapped)


def distance(params: dict, reference: dict, initial: dict) -> float:
    """The worst parameter's relative error of its update: ``|(p - p0) - (r - p0)| / |r - p0|`` (the updates, not
    the values, which after two steps are mostly the initial ones); a frozen parameter must be unchanged."""
    worst = 0.0
    for name, want in reference.items():
        got, start = params[name], initial[name]
        step = (want - start).norm().item()
        if step == 0.0:  # frozen: it must not have moved either
            worst = max(worst, float("inf") if not torch.equal(got, start) else 0.0)
            continue
        worst = max(worst, (got - want).norm().item() / step)
    return worst


def patch_use(model: torch.nn.Module) -> dict:
    """What the patched layers ran: the ops they chose (with the dtype each was called in) and the calls they
    handed to transformers' own forward."""
    import fusepatch

    chosen = set()
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        for op, dispatch in state.ops.items() if state is not None else ():
            chosen.update(f"{op}:{choice.dtype}" for choice in dispatch.seen())
    return {"ops": sorted(chosen), "transformers_calls": list(fusepatch.report(model).transformers_calls)}


# fully_shard called directly (fsdp2_worker.py), the fused decoder paths on: their stand-ins stay installed for
# the cases after them, so a launch runs these last
DIRECT = {
    "fully_shard-shard_first": ["--order", "shard-then-patch", "--standin-add-norm"],
    "fully_shard-checkpointing_projections": ["--checkpointing", "--standin-add-norm", "--fused-projections"],
}


def run_case(name: str, rank: int, world: int) -> dict | None:
    import fusepatch

    if name in DIRECT:
        worker = _module(os.path.join(HERE, "fsdp2_worker.py"), "fsdp2_worker")
        return worker.run(worker.parse(["--out", "-", *DIRECT[name]]))
    engine, mode, precision = name.split("-")
    if engine == "memory":
        return memory_case(rank, world)
    lora, bf16 = mode == "lora", precision == "bf16"
    vocab = build(False).config.vocab_size
    if engine == "accelerate":
        steps = batches(world, 2, vocab, seed=len(name))
    else:
        steps = [batches(world, 1, vocab, seed=len(name))[0]] * 2
    initial = {n: p.detach().float().clone() for n, p in build(lora).named_parameters()}
    runs = {}
    for patched in (False, True):
        model = build(lora)
        if patched:
            fusepatch.apply(model, verbose=False)
        if engine == "accelerate":
            runs[("sharded", patched)] = through_accelerate(model, steps, rank, bf16)
        else:
            runs[("sharded", patched)] = through_trainer(model, steps[0], bf16, lora, checkpointing=True)
        use = patch_use(model) if patched else None
    # the two unsharded runs side by side: unpatched on rank 0, patched on the last rank
    if rank in (0, world - 1):
        patched = rank == world - 1
        model = build(lora)
        if patched:
            fusepatch.apply(model, verbose=False)
        mine = unsharded(model, steps, bf16)
    theirs = [mine if rank == world - 1 else None]
    dist.broadcast_object_list(theirs, src=world - 1)
    if rank != 0:
        return None
    runs[("unsharded", False)], runs[("unsharded", True)] = mine, theirs[0]
    reference_losses, reference = runs[("unsharded", False)]
    out = {"patch_use": use, "losses": {f"{k[0]}-{'patched' if k[1] else 'unpatched'}": v[0] for k, v in runs.items()}}
    for label, (losses, params), against in (
        ("sharded_unpatched", runs[("sharded", False)], (reference_losses, reference)),
        ("unsharded_patched", runs[("unsharded", True)], (reference_losses, reference)),
        ("sharded_patched", runs[("sharded", True)], (reference_losses, reference)),
    ):
        out[label] = {
            "loss": max(abs(a - b) for a, b in zip(losses, against[0])),
            "params": distance(params, against[1], initial),
            "steps": len(losses),
        }
    return out


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def memory_case(rank: int, world: int) -> dict:
    """A bf16 LoRA model, FP8 frozen bases (the CPU stand-in of the FP8 op), accelerate's FSDP2 with
    ``mixed_precision="bf16"``: after the last step each rank's bytes by part, gathered to rank 0."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import pytest
    from helpers import cpu_candidates

    import fusepatch
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    cpu_candidates(pytest.MonkeyPatch(), {"fp8_linear": fp8_linear})
    sizes = {"hidden_size": 128, "intermediate_size": 256}
    model = build(True, torch.bfloat16, **sizes)
    fusepatch.apply(model, precision="fp8", verbose=False)
    steps = batches(world, 1, model.config.vocab_size, seed=7)  # after one step every part is there

    def held(model, optimizer) -> dict:
        parts = dict.fromkeys(("parameters", "trainable", "gradients", "optimizer_states", "projections_fp8"), 0)
        for p in model.parameters():
            parts["parameters"] += local_bytes(p)
            if p.requires_grad:
                parts["trainable"] += local_bytes(p)
                parts["gradients"] += local_bytes(p.grad) if p.grad is not None else 0
        for state in optimizer.state.values():
            parts["optimizer_states"] += sum(local_bytes(v) for k, v in state.items() if k != "step")
        dispatches = {}  # one dispatcher serves every projection of a row: each counted once
        for module in model.modules():
            state = module.__dict__.get("_fusepatch")
            if state is not None and "fp8_linear" in state.ops:
                dispatches[id(state.ops["fp8_linear"])] = state.ops["fp8_linear"]
        for dispatch in dispatches.values():
            for held in dispatch.all_held():
                parts["projections_fp8"] += held.handle.q.nbytes + held.handle.inverse.nbytes
        return parts

    after: list[dict] = []
    through_accelerate(model, steps, rank, bf16=True, memory=lambda m, o: after.append(held(m, o)))
    mine = after[-1]
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank != 0:
        return None
    studies = os.path.join(REPO, "benchmarks", "studies")
    sys.path.insert(0, studies)
    from static_memory import per_rank

    meta = copy.deepcopy(build(True, torch.bfloat16, **sizes)).to("meta")
    computed = {
        copy_: per_rank(meta, "fp8", engine="fsdp2", world=world, fp8_copy=copy_)["bytes"]
        for copy_ in ("current", "sharded")
    }
    return {"held": every, "computed": computed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated case names")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, seconds = {}, {}
    names = args.cases.split(",")
    last = [n for n in names if n in DIRECT]
    for name in [n for n in names if n not in DIRECT] + last:
        started = time.perf_counter()
        results[name] = run_case(name, rank, world)
        seconds[name] = round(time.perf_counter() - started, 2)
        dist.barrier()
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"world": world, "cases": results, "seconds": seconds}, fh)
    # as examples/sft_ultrachat.py ends (end_process_group says why)
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
