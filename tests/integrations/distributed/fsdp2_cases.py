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
DEVICE = "cpu"  # main's --device: the fp8 cases run on the GPU's kernels with cuda


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _module(os.path.join(REPO, "examples", "sft_ultrachat.py"), "sft_ultrachat")


def build(lora: bool, dtype: torch.dtype = torch.float32, dora: bool = False, **sizes) -> torch.nn.Module:
    """The tiny Qwen3.5 every run of a case starts from (peft LoRA on every linear for ``lora``, DoRA for ``dora``),
    same values."""
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text", seed=0, **sizes).to(dtype)
    if lora:
        import peft

        torch.manual_seed(1)  # lora_A's initialisation
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, use_dora=dora)
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
    ``zero_grad``; then no parameters are gathered (a dropped weight has none to gather)."""
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
    return losses, full_parameters(model) if memory is None else {}


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
    if engine == "fp8":
        return fp8_case(name, rank, world)
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
    local = getattr(tensor, "_local_tensor", tensor)  # a dropped shard holds no values (a meta tensor)
    return 0 if local.is_meta else local.numel() * local.element_size()


def memory_case(rank: int, world: int) -> dict:
    """A bf16 LoRA model, FP8 frozen bases (the CPU stand-in of the FP8 op), accelerate's FSDP2 with
    ``mixed_precision="bf16"``, with and without ``drop_frozen_weights``: after the last step each rank's bytes by
    part, gathered to rank 0."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import pytest
    from helpers import cpu_candidates

    import fusepatch
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    cpu_candidates(pytest.MonkeyPatch(), {"fp8_linear": fp8_linear})

    def held(model, optimizer) -> dict:
        parts = dict.fromkeys(("parameters", "trainable", "gradients", "optimizer_states", "projections_fp8"), 0)
        for p in model.parameters():
            parts["parameters"] += local_bytes(p)
            if p.requires_grad:
                parts["trainable"] += local_bytes(p)
                parts["gradients"] += local_bytes(p.grad) if p.grad is not None else 0
        for state in optimizer.state.values():
            parts["optimizer_states"] += sum(local_bytes(v) for k, v in state.items() if k != "step")
        parts["projections_fp8"] = fp8_bytes(model)["kept"]
        return parts

    every = {}
    for precision in ("fp8", "fp8+drop"):
        model = build(True, torch.bfloat16, **FP8_SIZES)
        fusepatch.apply(model, precision="fp8", drop_frozen_weights=precision == "fp8+drop", verbose=False)
        steps = batches(world, 1, model.config.vocab_size, seed=7)  # after one step every part is there
        after: list[dict] = []
        through_accelerate(model, steps, rank, bf16=True, memory=lambda m, o, after=after: after.append(held(m, o)))
        every[precision] = [None] * world
        dist.all_gather_object(every[precision], after[-1])
    if rank != 0:
        return None
    studies = os.path.join(REPO, "benchmarks", "studies")
    sys.path.insert(0, studies)
    from static_memory import per_rank

    meta = copy.deepcopy(build(True, torch.bfloat16, **FP8_SIZES)).to("meta")
    computed = {precision: per_rank(meta, precision, engine="fsdp2", world=world)["bytes"] for precision in every}
    computed["whole"] = per_rank(meta, "fp8", engine="fsdp2", world=world, fp8_copy="whole")["bytes"]
    return {"held": every, "computed": computed}


FP8_SIZES = {"hidden_size": 128, "intermediate_size": 256}


def fp8_bytes(model: torch.nn.Module) -> dict:
    """What this rank holds of FP8 copies now: every handle a dispatcher keeps and every sharded copy FSDP2 keeps
    (each storage once), and FSDP2's gathered FP8 buffers that are allocated (a unit's, between its gather and its
    reshard)."""
    seen, kept, gathered = set(), 0, 0

    def add(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += t.numel() * t.element_size()
        return total

    dispatches = {}
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        if state is not None and "fp8_linear" in state.ops:
            dispatches[id(state.ops["fp8_linear"])] = state.ops["fp8_linear"]
    for dispatch in dispatches.values():
        for held in dispatch.all_held():
            kept += add(held.handle)
    try:
        from fusepatch.backends import fsdp2
    except ImportError:  # a fusepatch that keeps nothing sharded
        return {"kept": kept, "gathered": gathered}
    for p in model.parameters():  # a dropped shard's copy (one with values is a dispatcher's, counted above)
        local = getattr(p, "_local_tensor", None)
        if isinstance(local, fsdp2.DroppedShard):
            kept += add(local.kept)
    for module in model.modules():
        param = fsdp2.param_of(module)
        if param is not None and fsdp2.kept_shard(param) is not None:
            gathered += add(param.all_gather_outputs)
    return {"kept": kept, "gathered": gathered}


def fp8_base(name: str) -> bool:
    """Whether ``name`` is the base weight of a projection ``precision="fp8"`` trains in FP8."""
    from fusepatch.layers.fp8 import PROJECTIONS

    return any(f".{projection}.base_layer.weight" in name for projection in PROJECTIONS)


def fp8_whole_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The FP8 copies of every frozen projection whole (one byte a value, one fp32 scale a row), and the most one
    decoder layer's take."""
    from fusepatch.layers.fp8 import PROJECTIONS
    from fusepatch.layers.support.lora import held_as

    per_layer: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and held_as(name) in PROJECTIONS and not module.weight.requires_grad:
            rows, cols = module.weight.shape
            layer = name.split(".layers.")[1].split(".")[0]
            per_layer[layer] = per_layer.get(layer, 0) + rows * (cols + 4)
    return sum(per_layer.values()), max(per_layer.values())


def fp8_case(name: str, rank: int, world: int) -> dict | None:
    """LoRA over FP8 frozen bases (the CPU stand-in of the FP8 op), bf16, ``fully_shard`` per decoder layer and the
    model, two SGD steps on one row a rank; against the unsharded model patched alike (each row its own forward and
    backward, ``loss / world``: the same per-row arithmetic, so the same bits where the reduction adds the same
    terms) and unpatched. ``keep``: the bases keep their values and are rewritten in place between the steps;
    ``drop``: ``drop_frozen_weights=True``, and a write to a base must raise (against the patched model only: the
    first step is ``keep``'s). ``dora``: DoRA adapters, which read their bases' values: nothing kept sharded, each
    call quantizes the gathered weight. At every FP8 call and after each step, the FP8 bytes this rank holds; then the
    report's lines and ``revert``."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import pytest
    from helpers import cpu_candidates
    from torch.distributed.fsdp import fully_shard

    import fusepatch
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    drop, dora = name.endswith("drop"), "dora" in name
    models: dict[str, torch.nn.Module] = {}
    calls: list[dict] = []

    from fusepatch.ops.fp8_linear import scaled_mm

    project = scaled_mm._project

    def measured(*args, **kwargs):  # every FP8 forward GEMM, on the GPU's kernels or the CPU stand-in
        if measuring[0] is not None:
            calls.append(fp8_bytes(measuring[0]))
        return project(*args, **kwargs)

    measuring: list = [None]
    patch = pytest.MonkeyPatch()
    patch.setattr(scaled_mm, "_project", measured)
    if DEVICE == "cpu":
        cpu_candidates(patch, {"fp8_linear": fp8_linear})
    # keep's unpatched run covers drop's first step; DoRA's is peft's own arithmetic
    labels = ("sharded", "patched") if drop or dora else ("sharded", "patched", "unpatched")
    for label in labels:
        model = build(True, torch.bfloat16, dora, **FP8_SIZES).to(DEVICE)
        if label == "sharded":
            for layer in model.get_base_model().model.layers:
                fully_shard(layer)
            fully_shard(model)
        if label != "unpatched":
            fusepatch.apply(model, precision="fp8", drop_frozen_weights=drop, verbose=False)
        models[label] = model
    whole, layer_most = fp8_whole_bytes(models["patched"])
    steps = [ids.to(DEVICE) for ids in batches(world, 2, models["patched"].config.vocab_size, seed=11)]
    optimizers = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for k, m in models.items()}
    out: dict = {"losses": {}, "grads": {}, "between": [], "rewrites_refused": None}
    for step, ids in enumerate(steps):
        if step == 1:  # the frozen bases rewritten in place (a reference model's sync writes so)
            refused = 0
            for model in models.values():
                for pname, p in model.named_parameters():
                    if fp8_base(pname):
                        try:
                            with torch.no_grad():
                                p.mul_(0.75)
                        except RuntimeError:
                            refused += 1
            out["rewrites_refused"] = refused
            out["bases"] = sum(fp8_base(n) for n, _ in models["patched"].named_parameters())
        measuring[0] = models["sharded"]
        loss = models["sharded"](input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1], use_cache=False).loss
        loss.backward()
        measuring[0] = None
        losses = [None] * world
        dist.all_gather_object(losses, loss.item())
        grads = {
            n.replace("_orig_mod.", ""): p.grad.full_tensor()
            for n, p in models["sharded"].named_parameters()
            if p.requires_grad
        }
        out["losses"].setdefault("sharded", []).append(losses)
        got = {"sharded": grads}
        for label in labels[1:]:
            row_losses = []
            for r in range(world):
                row = ids[r : r + 1]
                row_loss = models[label](input_ids=row, labels=row, use_cache=False).loss
                (row_loss / world).backward()
                row_losses.append(row_loss.item())
            out["losses"].setdefault(label, []).append(row_losses)
            got[label] = {n: p.grad.clone() for n, p in models[label].named_parameters() if p.requires_grad}
        for label in labels[1:]:
            worst, equal = 0.0, True
            for n, want in got[label].items():
                have = got["sharded"][n]
                equal = equal and torch.equal(have, want)
                worst = max(worst, ((have - want).norm() / want.norm().clamp_min(1e-30)).item())
            have = torch.cat([got["sharded"][n].float().reshape(-1) for n in got[label]])
            want = torch.cat([g.float().reshape(-1) for g in got[label].values()])
            total = ((have - want).norm() / want.norm()).item()  # every gradient as one vector
            out["grads"].setdefault(label, []).append(
                {"equal": equal, "worst": worst, "total": total, "count": len(got[label])}
            )
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["between"].append(fp8_bytes(models["sharded"]))
    out["sharding"] = list(fusepatch.report(models["sharded"]).sharding)
    # revert: the bases back (rounded where dropped) as the unsharded model's revert gives them, and FSDP2 gathers
    # and computes with them as before
    fusepatch.revert(models["sharded"])
    fusepatch.revert(models["patched"])
    bases = {n: p for n, p in models["patched"].named_parameters() if fp8_base(n)}
    back = {n: p.full_tensor() for n, p in models["sharded"].named_parameters() if fp8_base(n)}
    out["reverted_equal"] = all(torch.equal(back[n], p) for n, p in bases.items()) and len(back) == len(bases)
    row = steps[0][rank : rank + 1]
    with torch.no_grad():
        after = [models[k](input_ids=row, labels=row, use_cache=False).loss.item() for k in ("sharded", "patched")]
    out["reverted_loss_equal"] = after[0] == after[1]
    out["calls"] = len(calls)
    out["peak"] = max((c["kept"] + c["gathered"] for c in calls), default=0)
    out["whole"], out["layer_most"] = whole, layer_most
    every = [None] * world
    dist.all_gather_object(every, {"peak": out["peak"], "between": out["between"], "calls": out["calls"]})
    out["ranks"] = every
    return out if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated case names")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="cuda: NCCL, a GPU a rank, the GPU's kernels (fp8 cases)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
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
