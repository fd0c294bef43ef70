"""DeepSpeed ZeRO worker: every case of tests/integrations/test_deepspeed.py in one process group (one launch, many
cases). Each case trains a patched tiny Qwen3.5 two optimizer steps under a DeepSpeed engine (CPU accelerator,
gloo) and the same model unsharded and unpatched beside it on the same data; rank 0 writes, per case, the losses'
largest difference, how far the parameters after the two steps are from the reference's, and the fused ops that
ran. Run with torchrun: ``deepspeed_worker.py --out RESULT.json --tests TESTS_DIR [--cases NAME ...]``.

Every op gets a CPU stand-in (its torch reference; the loss the chunked linear cross-entropy, which reads
``lm_head.weight`` in its own forward as the GPU kernels do) and the projections' GPU paths are let onto the CPU,
so the layers take the paths a GPU takes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
import traceback
import types

import torch
import torch.distributed as dist

LR = 0.5  # SGD, no momentum: the parameters after two steps carry both steps' gradients, large enough to compare
STEPS = 2
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)


def stand_ins() -> list[tuple]:
    """The GPU's paths on the CPU (tests/conftest.py's ``stand_ins``, the loss as ``chunked_on_cpu``)."""
    import pytest
    from helpers import cpu_candidates

    from fusepatch.layers import gated_deltanet
    from fusepatch.layers.support import lora, projections
    from fusepatch.ops import OPS
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
    from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_chunked

    patch = pytest.MonkeyPatch()
    kernels = {name: op.reference for name, op in OPS.items()}
    kernels["linear_cross_entropy"] = linear_cross_entropy_chunked
    kernels["fp8_linear"] = fp8_linear  # FP8 GEMMs' arithmetic in torch: quantized operands, frozen copies kept
    seen = cpu_candidates(patch, kernels)
    patch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    patch.setattr(gated_deltanet, "COPY_DEVICES", (*gated_deltanet.COPY_DEVICES, "cpu"))
    # the projections' own GEMMs, which ZeRO-3's hooks on every module send back to the modules: counted
    shared, fused_lora = projections._SharedInputLinears.apply, lora.project

    def counted_shared(*args):
        seen.append(("shared-input projections",))
        return shared(*args)

    def counted_lora(*args, **kwargs):
        out = fused_lora(*args, **kwargs)
        if out is not None:
            seen.append(("fused LoRA",))
        return out

    patch.setattr(projections._SharedInputLinears, "apply", counted_shared)
    patch.setattr(lora, "project", counted_lora)
    return seen


def ds_config(stage: int, rows: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            # every parameter partitioned (the default keeps those under 100k elements whole: all of a tiny model's)
            "stage3_param_persistence_threshold": 0,
            # buckets of a tiny model's size: the defaults (5e8 elements) allocate and clear 2 GB a case
            "reduce_bucket_size": 2**20,
            "allgather_bucket_size": 2**20,
            "stage3_prefetch_bucket_size": 2**20,
        },
        "gradient_clipping": 0.0,  # DeepSpeed's default clips to 1.0: the reference's SGD clips nothing
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def padded_batches(vocab: int, world: int) -> list[dict]:
    """Two rows a rank, right-padded, the padding's labels -100."""
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(world):
        lengths = (24, 15)
        ids = torch.zeros(2, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, :n] = torch.randint(1, vocab, (n,), generator=generator)
            mask[row, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def packed_batches(vocab: int, world: int) -> list[dict]:
    """One row a rank of documents packed as DataCollatorWithFlattening packs them: positions restart at each
    document, whose first label is -100. ``documents``: the reference runs each alone."""
    generator = torch.Generator().manual_seed(4321)
    batches = []
    for lengths in ((11, 1, 17), (6, 20, 5))[:world]:
        docs = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        ids = torch.cat(docs)[None]
        labels = ids.clone()
        start = 0
        for n in lengths:
            labels[0, start] = -100
            start += n
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        batches.append({"input_ids": ids, "position_ids": positions, "labels": labels, "documents": docs})
    return batches


def reference_loss(model, batch: dict) -> torch.Tensor:
    """transformers' loss of the unpatched model; a packed row as its documents alone (transformers' own layers let
    a packed row's documents see each other: tests/layers/test_packing.py)."""
    if "documents" not in batch:
        return model(**batch, use_cache=False).loss
    total, count = 0.0, 0
    for doc in batch["documents"]:
        logits = model(input_ids=doc[None], use_cache=False).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, doc[1:], reduction="sum")
        count += len(doc) - 1
    return total / count


def build(model_type: str, tuning: str, checkpointing: bool = False):
    """The model and its unpatched twin (same weights, same adapters); the model with transformers' non-reentrant
    activation checkpointing if asked (the backward's recompute gathers again)."""
    from helpers import HYBRID_PAIR

    from fusepatch.tools.tiny import tiny_model

    model = tiny_model(model_type, seed=0, **HYBRID_PAIR)  # a Gated DeltaNet layer and a gated attention layer
    if tuning == "lora":
        import peft

        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    model.train()
    reference = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, reference


def reference_steps(reference, batches: list[dict]) -> list[list[float]]:
    """SGD on the mean of the ranks' losses (what data parallelism averages), STEPS times; each step's losses."""
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR * float(os.environ.get("LRSCALE", "1")))
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        step = []
        for batch in batches:
            loss = reference_loss(reference, batch)
            (loss / len(batches)).backward()
            step.append(loss.item())
        optimizer.step()
        losses.append(step)
    return losses


def full_parameters(engine, stage: int) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole value (ZeRO-3 holds a shard: gathered)."""
    import deepspeed

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if stage < 3:
        return {n: p.detach().clone() for n, p in named}
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {n: p.detach().clone() for n, p in named}


def compare(model_params: dict, reference, initial: dict) -> dict:
    """The worst relative error of a parameter's change over the two steps, and the largest absolute difference."""
    worst, largest, names = 0.0, 0.0, {}
    for name, p in reference.named_parameters():
        if not p.requires_grad:
            continue
        got, want = model_params[name] - initial[name], p.detach() - initial[name]
        err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        names[name] = err
        worst = max(worst, err)
        largest = max(largest, (model_params[name] - p.detach()).abs().max().item())
    return {"worst_update_rel_err": worst, "max_abs_diff": largest, "worst_name": max(names, key=names.get)}


def engine_case(
    model_type: str,
    stage: int,
    tuning: str,
    batching: str,
    checkpointing: bool,
    seen: list,
    precision=None,
    accelerate: bool = False,
) -> dict:
    """``deepspeed.initialize`` on the patched model (``accelerate``: ``Accelerator(deepspeed_plugin=...)`` and
    ``prepare``, whose ``backward`` steps the engine), two steps, against the reference."""
    import deepspeed

    import fusepatch

    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference = build(model_type, tuning, checkpointing)
    vocab = model.config.vocab_size if tuning == "full" else model.base_model.model.config.vocab_size
    batches = (padded_batches if batching == "padded" else packed_batches)(vocab, world)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}

    # FP8: bf16 autocast on both sides, the reference patched alike (FP8's own error is the same on both); asked to
    # drop the frozen weights, which under ZeRO-3 drops none (the partitions are DeepSpeed's)
    fp8 = {"precision": precision, "compute_dtype": "bf16", "drop_frozen_weights": True} if precision else {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(precision))
    if precision:
        fusepatch.apply(reference, verbose=False, **fp8)

    def patch(module):
        return fusepatch.report(module) if os.environ.get("NOPATCH") else fusepatch.apply(module, verbose=False, **fp8)

    report = patch(model) if precision is None else None
    params = [p for p in model.parameters() if p.requires_grad]
    config = ds_config(int(os.environ.get("STAGE", stage)), batches[rank]["input_ids"].shape[0])
    if accelerate:
        accelerator = accelerated(config)
        engine, _ = accelerator.prepare(model, torch.optim.SGD(params, lr=LR))
        step = accelerator.backward  # DeepSpeed's backward and its optimizer step
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=LR), config=config)

        def step(loss):
            engine.backward(loss)
            engine.step()

    if precision is not None:  # after ZeRO-3 partitioned the weights, as FusePatchCallback applies at train start
        report = patch(engine.module)
    mine = {k: v for k, v in batches[rank].items() if k != "documents"}
    seen.clear()
    losses = []
    for _ in range(STEPS):
        with autocast:
            loss = engine(**mine, use_cache=False).loss
        step(loss)
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, loss.detach().float())
        losses.append([g.item() for g in gathered])
    fused = sorted({op for op, *_ in seen})
    model_params = full_parameters(engine, stage)
    after = fusepatch.report(engine.module)
    kept = fp8_kept(engine.module)
    engine.destroy()
    if accelerate:
        released()
    result = {"fused": fused, "patched": report.patched, "sharding": list(after.sharding)}
    result.update(fp8_kept=kept, dropped=after.dropped_weights)
    if rank == 0:
        with autocast:
            expected = reference_steps(reference, batches)
        result["losses"], result["expected"] = losses, expected
        result["loss_diff"] = max(abs(a - b) for got, want in zip(losses, expected) for a, b in zip(got, want))
        result.update(compare(model_params, reference, initial))
    return result


def accelerated(config: dict):
    """An ``Accelerator`` with DeepSpeed's plugin for ``config`` on the CPU, its process state made anew (a case
    before may have made one: the Trainer's)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))  # (cpu=True would leave it out)


def released() -> None:
    """What an ``Accelerator`` with DeepSpeed's plugin leaves set for the process, let go: transformers' DeepSpeed
    config (later models would be built partitioned), the plugin's variable and accelerate's process state."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(True)


def fp8_kept(model) -> int:
    """Bytes of the FP8 copies the FP8 projections' dispatchers keep (between steps: what a rank holds)."""
    dispatches = {}
    for module in model.modules():
        state = module.__dict__.get("_fusepatch")
        if state is not None and "fp8_linear" in state.ops:
            dispatches[id(state.ops["fp8_linear"])] = state.ops["fp8_linear"]
    return sum(t.numel() * t.element_size() for d in dispatches.values() for h in d.all_held() for t in h.handle)


class Rows(torch.utils.data.Dataset):
    """Four rows of one length, labelled with themselves: whichever rows the sampler gives each rank, each step
    trains on all four, every token labelled (the Trainer's token count across ranks weighs every row alike)."""

    def __init__(self, vocab: int):
        generator = torch.Generator().manual_seed(99)
        self.rows = [torch.randint(0, vocab, (20,), generator=generator) for _ in range(4)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_case(stage: int, seen: list) -> dict:
    """The Trainer's ``deepspeed=`` dict config (through accelerate's DeepSpeed plugin), patched by
    FusePatchCallback at the start of training: after the engine partitioned the parameters."""
    from transformers import Trainer, TrainingArguments

    from fusepatch import FusePatchCallback

    rank = dist.get_rank()
    model, reference = build("qwen3_5_text", "full")
    data = Rows(model.config.vocab_size)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    config = {**ds_config(stage, 2), "train_batch_size": 2 * dist.get_world_size()}
    callback = FusePatchCallback(profile=False)
    with tempfile.TemporaryDirectory() as folder, zero3_config_released():
        args = TrainingArguments(
            output_dir=folder,
            deepspeed=config,
            max_steps=STEPS,
            per_device_train_batch_size=2,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        seen.clear()
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        fused = sorted({op for op, *_ in seen})
        model_params = full_parameters(trainer.model_wrapped, stage)
        report = fusepatch_report(trainer.model)
    result = {"fused": fused, "patched": report.patched, "sharding": list(report.sharding)}
    if rank == 0:
        rows = {"input_ids": torch.stack(data.rows), "labels": torch.stack(data.rows)}
        expected = reference_steps(reference, [rows])
        result["loss_diff"] = max(abs(a - b[0]) for a, b in zip(losses, expected))
        result.update(compare(model_params, reference, initial))
    return result


@contextlib.contextmanager
def zero3_config_released():
    """Within: the Trainer's DeepSpeed config, which tells transformers to build models partitioned (zero.Init)
    while it lives; after: released, so that the next case's models are built whole."""
    try:
        yield
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def fusepatch_report(model):
    import fusepatch

    return fusepatch.report(model)


# ZeRO-3's full fine-tuning on packed rows also checkpoints the layers; ZeRO-2, which leaves the parameters whole,
# runs full fine-tuning on padded rows and LoRA on packed ones (CI's time)
CASES = {
    f"zero{stage}-{tuning}-{batching}{'-checkpointing' if checkpointing else ''}": (
        engine_case,
        ("qwen3_5_text", stage, tuning, batching, checkpointing),
    )
    for stage in (3, 2)
    for tuning in ("full", "lora")
    for batching in ("padded", "packed")
    for checkpointing in [stage == 3 and tuning == "full" and batching == "packed"]
    if stage == 3 or (tuning == "full") == (batching == "padded")
}
CASES["trainer-zero3"] = (trainer_case, (3,))
# accelerate's own API: Accelerator(deepspeed_plugin=...), prepare, backward
CASES["accelerate-zero3-lora-padded"] = (
    lambda seen: engine_case("qwen3_5_text", 3, "lora", "padded", False, seen, accelerate=True),
    (),
)
# FP8 projections over ZeRO-3's partitioned LoRA bases: each gathered by its own module's hooks and quantized for
# the call, nothing kept
CASES["zero3-lora-padded-fp8"] = (
    lambda seen: engine_case("qwen3_5_text", 3, "lora", "padded", False, seen, precision="fp8"),
    (),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tests", required=True, help="the tests folder (helpers.py)")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    sys.path.insert(0, args.tests)
    seen = stand_ins()
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator's communication backend builds a shared-memory all-reduce op (C++, compiled on first use:
    # 160 s on two busy cores); without it gloo does every collective. Its table of buildable ops is read once
    # and kept (deepspeed/ops/__init__.py): an op it names incompatible is never built.
    vars(deepspeed.ops)["__compatible_ops__"] = {"deepspeed_shm_comm": False}
    # ZeRO's optimizers import DeepSpeed's Muon optimizer to ask whether theirs is one, and its import compiles with
    # torch.compile (imports inductor: 6 s a process); these cases train with SGD, so a stand-in class answers
    muon = types.ModuleType("deepspeed.runtime.zero.muon.muon_optimizer")
    muon.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    sys.modules[muon.__name__] = muon
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name in args.cases:
        function, arguments = CASES[name]
        started = time.perf_counter()
        try:
            results[name] = function(*arguments, seen)
        except Exception:  # one case's error is its result; the others still run
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.barrier()
    time.sleep(0.2)  # gloo's worker threads release the last collectives' tensors (fsdp2_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
