"""Supervised fine-tuning of a Qwen3.5 model on ultrachat-format data, with fusepatch.

Runs offline by default: a tiny Qwen3.5 built from a config, a byte-level BPE tokenizer trained on the shipped
conversations (examples/data/ultrachat_sample.jsonl, the HuggingFaceH4/ultrachat_200k format: a ``messages``
list per row), padding-free packing, activation checkpointing, and FusePatchCallback's report and profile.

    python examples/sft_ultrachat.py --max-steps 20
    python examples/sft_ultrachat.py --model Qwen/Qwen3.5-27B --dataset HuggingFaceH4/ultrachat_200k --split train_sft

Loss is on assistant tokens only. Packing uses DataCollatorWithFlattening (position_ids restart at 0 per
conversation); fusepatch keeps every conversation separate in the linear-attention layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "ultrachat_sample.jsonl")
CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_conversations(dataset: str, split: str):
    """A ``datasets.Dataset`` with a ``messages`` column: a local json/jsonl file, or a Hub dataset id."""
    from datasets import load_dataset

    if os.path.exists(dataset):
        return load_dataset("json", data_files=dataset, split="train")
    return load_dataset(dataset, split=split)


def build_tokenizer(conversations, vocab_size: int = 1024):
    """A byte-level BPE trained on the conversations themselves, with ChatML special tokens: works offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = (m["content"] for row in conversations for m in row["messages"])
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=special[1:]
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def _assistant_mask_by_prefixes(tokenizer, messages) -> list[int]:
    """For chat templates without {% generation %} markers: find each assistant turn's tokens by rendering
    the conversation up to the turn with and without it."""

    def length(msgs, **kwargs) -> int:
        return len(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, **kwargs)["input_ids"])

    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = length(messages[:i], add_generation_prompt=True)
        end = length(messages[: i + 1])
        # the turn ends at its end-of-turn token; what the template adds after it is not the assistant's
        ends = [j for j in range(start, min(end, len(ids))) if ids[j] == tokenizer.eos_token_id]
        end = ends[-1] + 1 if ends else end
        for j in range(start, min(end, len(mask))):
            mask[j] = 1
    return mask


def tokenize(tokenizer, messages, max_length: int) -> dict:
    """input_ids and labels (-100 everywhere but assistant tokens), truncated to ``max_length``."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    mask = list(out.get("assistant_masks") or [])
    if not any(mask):
        mask = _assistant_mask_by_prefixes(tokenizer, messages)
    labels = [t if m else -100 for t, m in zip(ids, mask)]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    # Random weights are drawn on this process's GPU: at 27B layer shapes a CPU init takes minutes (torchrun
    # sets OMP_NUM_THREADS=1), on the GPU seconds. FSDP2 then shards the model in place.
    on_gpu = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() else None
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if args.config:  # real layer shapes, random weights (a config file: no Hub)
        from transformers import AutoConfig

        with open(args.config) as fh:
            values = {k: v for k, v in json.load(fh).items() if not k.startswith("_")}
        if args.layers:
            values["num_hidden_layers"] = args.layers
            if "layer_types" in values:
                values["layer_types"] = values["layer_types"][: args.layers]
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(args.seed)
        with on_gpu or contextlib.nullcontext():
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    from fusepatch.tools.tiny import tiny_config

    config = tiny_config(
        "qwen3_5_text", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, use_cache=False
    )
    torch.manual_seed(args.seed)
    with on_gpu or contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def fsdp_arguments(model, checkpointing: bool) -> dict:
    """TrainingArguments for FSDP2: shard every decoder layer; FSDP does the activation checkpointing. (``fsdp=True``
    with everything in ``fsdp_config``: transformers 5.25 warns that the string form, ``"full_shard auto_wrap"``,
    goes.)"""
    layer = type(model.model.layers[0]).__name__
    return {
        "fsdp": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [layer],
            "reshard_after_forward": True,
            "activation_checkpointing": checkpointing,
        },
    }


def fsdp_on_cpu(accelerator, plugin) -> bool:
    """Let ``accelerator`` shard with ``plugin`` (FSDP2's ``fully_shard``) in a CPU process group (gloo).

    accelerate (checked on 1.16) calls a CPU process group ``MULTI_CPU`` and keeps an FSDP plugin only for GPU-like
    devices (``AcceleratorState``'s FSDP branch), so on CPU the request runs unsharded. This sets the state as
    accelerate sets it on GPUs: the plugin with the run's mixed precision, and ``FSDP`` as the distributed type in
    both shared states (``AcceleratorState()`` copies ``PartialState``'s at every construction). Returns whether it
    changed anything: only a CPU group of several processes without a kept plugin is changed."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None) is not None:
        return False
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def trainer_fsdp_on_cpu(trainer) -> bool:
    """``fsdp_on_cpu`` for a Trainer built with ``fsdp``/``fsdp_config`` arguments or started by ``accelerate launch``
    with an FSDP config: the plugin those describe (``TrainingArguments.fsdp_plugin_args``, what the Trainer hands
    accelerate, or accelerate's ``FSDP_*`` variables), then the Trainer's own flag, read once when it created its
    accelerator. Call before ``train()``; nothing changes without a plugin or outside a CPU process group."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if trainer.args.fsdp_plugin_args is not None:
        plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # accelerate launch's FSDP config
        plugin = FullyShardedDataParallelPlugin()
    else:
        return False
    if not fsdp_on_cpu(trainer.accelerator, plugin):
        return False
    trainer.is_fsdp_enabled = True
    return True


UNSHARDED_ON_ONE_PROCESS = (
    "--fsdp in a single process: nothing to shard over, so the model runs unsharded. FSDP2 shards it with several "
    "processes, one per GPU (or several on CPU, gloo): torchrun --nproc-per-node 2 examples/sft_ultrachat.py "
    "--fsdp, or accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_processes 2 "
    "examples/sft_ultrachat.py"
)


def sharding(fsdp: bool) -> bool:
    """Whether the run shards: ``--fsdp`` with several processes. A single process says why it runs unsharded and
    how to launch sharded (the Trainer refuses ``fsdp`` arguments outside a process group)."""
    if fsdp and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        print(UNSHARDED_ON_ONE_PROCESS)
        return False
    return fsdp


def end_process_group(trainer) -> None:
    """Close the process group the Trainer (accelerate) opened under torchrun and leaves open.

    Left to the end of the process, a gloo worker thread can still be releasing the last collective's tensors,
    which takes the GIL, while the main thread, holding the GIL, tears the group down and joins that thread:
    CI saw a finished two-process run abort at exit (``terminate called without an active exception``) and,
    here, hang in ``~ProcessGroupGloo`` (1 of 12 runs on two loaded cores, also 1 of 24 with only a barrier
    first, since the barrier's own work holds the last collective's). So: every rank finishes, the GIL is left
    free for a moment for gloo's threads to drop what they hold, then the group is closed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.get_backend() == "gloo":
        time.sleep(0.2)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hub id or path; default: a tiny Qwen3.5 from a config")
    parser.add_argument(
        "--config",
        default=None,
        help="a config.json to build the model from (random weights), e.g. examples/configs/qwen3_5_27b_text.json",
    )
    parser.add_argument("--layers", type=int, default=None, help="with --config: keep only the first N layers")
    parser.add_argument("--tokenizer", default=None, help="default: --model's, else one trained on the data")
    parser.add_argument("--dataset", default=DEFAULT_DATA, help="json/jsonl path or Hub dataset id")
    parser.add_argument("--split", default="train_sft")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="use the tokenized conversations this many times over (the shipped sample holds 24: throughput runs "
        "with large packed batches on several GPUs need more rows than that)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="conversations per micro-batch (packed into one row)")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="the weights' initialisation and the data order")
    parser.add_argument("--output-dir", default="sft-output")
    parser.add_argument("--no-packing", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--no-fusepatch", action="store_true")
    parser.add_argument("--profile-step", type=int, default=5)
    parser.add_argument("--trace-dir", default=None, help="also write the profiled step's Chrome trace there")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per decoder layer) under torchrun")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)

    from transformers import (
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainingArguments,
    )

    import fusepatch

    conversations = load_conversations(args.dataset, args.split)
    if args.tokenizer or args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    else:
        tokenizer = build_tokenizer(conversations)
    train = conversations.map(
        lambda row: tokenize(tokenizer, row["messages"], args.max_length), remove_columns=conversations.column_names
    )
    supervised = sum(sum(1 for t in row["labels"] if t != -100) for row in train)
    total = sum(len(row["input_ids"]) for row in train)
    print(f"{len(train)} conversations, {total} tokens, {supervised} assistant tokens carry the loss")
    if args.repeat > 1:
        from datasets import concatenate_datasets

        train = concatenate_datasets([train] * args.repeat)
        print(f"repeated {args.repeat} times: {len(train)} rows")

    model = build_model(args, tokenizer)
    model.config.use_cache = False  # training: no cache (and packed batches need none)
    if args.no_packing:
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    else:
        collator = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    shard = sharding(args.fsdp)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        logging_steps=1,
        gradient_checkpointing=not args.no_checkpointing and not shard,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=args.seed,
        data_seed=args.seed,
        **(fsdp_arguments(model, not args.no_checkpointing) if shard else {}),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=collator)
    if not torch.cuda.is_available():
        trainer_fsdp_on_cpu(trainer)  # accelerate shards only on GPUs unless told (fsdp_on_cpu says why)
    callback = fusepatch.attach(
        trainer,
        fusepatch.FusePatchCallback(
            apply_patches=not args.no_fusepatch,
            profile_step=args.profile_step,
            trace_dir=args.trace_dir,
            time_steps=True,  # steady_state() below: a benchmark, where a sync per step is the price of the numbers
        ),
    )
    trainer.train()
    end_process_group(trainer)
    metrics = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("fusepatch/")}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    sharded = any(type(m).__name__.startswith("FSDP") for m in trainer.model.modules())
    partitioned = any(hasattr(p, "ds_id") for p in trainer.model.parameters())  # DeepSpeed ZeRO-3's parameters
    rank = training_args.process_index
    # One write per line: under torchrun every rank prints into the same stream, and print's separate write of
    # the newline let two ranks' lines run together (seen in a two-GPU log).
    lines = [
        f"world size {training_args.world_size}, FSDP2-sharded layers: {sharded}, "
        f"ZeRO-3-partitioned parameters: {partitioned}",
        "losses: " + " ".join(f"{x:.3f}" for x in losses),
        "fusepatch metrics: " + json.dumps(metrics),
        f"steady state (rank {rank}): " + json.dumps(callback.steady_state()),
        "triton kernel builds after step 2: " + json.dumps(dict(callback.late_builds)),
    ]
    if callback.last_profile is not None:
        lines.append(callback.last_profile.summary())
    for line in lines:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
