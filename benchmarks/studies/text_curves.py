"""Loss curves on real text that the model sees once: FP8 projections against bf16, with a held-out eval loss.

    python benchmarks/studies/text_curves.py --precision bf16 --seed 0 --json-out bf16-0.json > bf16-0.log
    python benchmarks/studies/text_curves.py --precision fp8 --seed 0 --json-out fp8-0.json > fp8-0.log
    python benchmarks/studies/loss_curves.py bf16:0=bf16-0.log fp8:0=fp8-0.log ... --baseline bf16 --candidate fp8

The SFT example's curves repeat a 16 KB sample and memorise it (loss 0.001), so they cannot tell a precision
that learns worse from one that learns as well. Here the text is the ``.py`` files of Python's standard library
(offline on any machine with Python; no tests, no site-packages, no idlelib), in sorted path order, read once:
the training stream is the first files, cut into contiguous ``--seq-len`` chunks, and no chunk or file comes
twice. The last ``--val-fraction`` of the files is held out for an eval loss every ``--eval-every`` steps. The
tokenizer is a byte-level BPE trained on the first ``--tokenizer-mb`` MB of the training files.

The model is ``examples/configs/qwen3_5_small_text.json`` with random weights (``--seed``) and the tokenizer's
vocabulary, bf16, no activation checkpointing; ``--precision fp8`` is ``fusepatch.apply(model,
precision="fp8")``, bf16 ``fusepatch.apply(model)``, ``--no-fusepatch`` the model as transformers builds it;
``--fast-accum`` runs the FP8 GEMMs with fast accumulation (``benchmarks/fast_accum.py``), ``--fp8-lm-head`` the LM
head's GEMMs in FP8 too (``apply(lm_head_precision="fp8")``).
AdamW (weight decay 0.1, clip 1.0), linear warmup then cosine. Prints ``losses:`` (per step; the line
``benchmarks/studies/loss_curves.py`` reads), ``eval:`` (step=loss) and tokens/s. The standard library holds about 3M
tokens at vocabulary 4096 (10.8 MB in Python 3.12): the defaults (300 steps of 4 x 2048) take 2.5M of them; a
run that would need more stops before training and says how many steps fit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import sysconfig
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/studies/../..
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the harness: fast_accum, provenance
from provenance import code  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO, "examples", "configs", "qwen3_5_small_text.json")
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
EOS = "<|endoftext|>"


def corpus_files(root: str | None = None) -> list[str]:
    """The standard library's ``.py`` files, sorted by path: no site-packages, test/tests directories, idlelib."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="ignore") as f:
        return f.read()


def build_tokenizer(files: list[str], vocab_size: int, megabytes: float):
    """A byte-level BPE trained on the first ``megabytes`` MB of ``files`` (no Hub); EOS separates documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for path in files:
        if size >= megabytes * 1e6:
            break
        texts.append(read(path))
        size += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, len(texts)


def token_stream(tok, files: list[str], need: int, batch_files: int = 32) -> tuple[list[int], int]:
    """Tokenize ``files`` in order, each followed by EOS, until the stream holds ``need`` tokens (or the files
    run out): the stream and how many files it used. Only as many files as needed are read."""
    eos = tok.token_to_id(EOS)
    stream: list[int] = []
    used = 0
    while len(stream) < need and used < len(files):
        chunk = files[used : used + batch_files]
        for enc in tok.encode_batch([read(p) for p in chunk]):
            stream += enc.ids
            stream.append(eos)
            used += 1
            if len(stream) >= need:
                break
    return stream, used


def build_data(args) -> dict:
    """Tokenizer, training chunks (each token once) and held-out validation chunks."""
    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    files = corpus_files(root)
    if not files:
        raise SystemExit(f"no .py files under {root}")
    held = max(1, math.ceil(len(files) * args.val_fraction))
    train_files, val_files = files[:-held], files[-held:]
    t = time.perf_counter()
    tok, tok_files = build_tokenizer(train_files, args.vocab, args.tokenizer_mb)
    need = args.steps * args.batch * args.seq_len
    stream, used = token_stream(tok, train_files, need)
    if len(stream) < need:
        fit = len(stream) // (args.batch * args.seq_len)
        raise SystemExit(
            f"the corpus holds {len(stream):,} training tokens ({len(train_files)} files); {args.steps} steps of "
            f"{args.batch} x {args.seq_len} need {need:,}: at most {fit} steps fit without repeating text "
            "(lower --steps, --batch or --seq-len)"
        )
    train = torch.tensor(stream[:need], dtype=torch.long).view(args.steps, args.batch, args.seq_len)
    val_stream, _ = token_stream(tok, val_files, float("inf"))
    rows = min(args.eval_seqs, max(1, len(val_stream) // args.seq_len))
    length = min(args.seq_len, len(val_stream))
    val = torch.tensor(val_stream[: rows * length], dtype=torch.long).view(rows, length)
    info = {
        "stdlib": root,
        "corpus_files": len(files),
        "train_files_used": used,
        "train_files_available": len(train_files),
        "train_tokens": need,
        "val_files": len(val_files),
        "val_tokens": val.numel(),
        "tokenizer_files": tok_files,
        "vocab_size": tok.get_vocab_size(),
        "data_s": round(time.perf_counter() - t, 2),
    }
    print(
        f"data: {info['corpus_files']} stdlib .py files ({info['stdlib']}); tokenizer: byte-level BPE, vocab "
        f"{info['vocab_size']}, trained on the first {tok_files} files ({args.tokenizer_mb:g} MB)"
    )
    print(
        f"data: training on {need:,} tokens = {args.steps} steps x {args.batch} x {args.seq_len} from the first "
        f"{used} of {len(train_files)} training files, one epoch: no document repeats (no memorisation possible)"
    )
    print(
        f"data: eval on {val.numel():,} held-out tokens ({rows} x {length}) from the last {len(val_files)} files, "
        f"every {args.eval_every} steps ({info['data_s']} s to build the data)"
    )
    return {"train": train, "val": val, "info": info, "vocab": tok.get_vocab_size(), "eos": tok.token_to_id(EOS)}


def build_model(args, vocab: int, eos: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(args.config) as f:
        values = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    values["vocab_size"] = vocab
    values["pad_token_id"] = values["eos_token_id"] = values["bos_token_id"] = eos
    if args.layers:
        values["num_hidden_layers"] = args.layers
        if "layer_types" in values:
            values["layer_types"] = values["layer_types"][: args.layers]
    if args.hidden:
        ratio = values["intermediate_size"] / values["hidden_size"]
        values["hidden_size"] = args.hidden
        values["intermediate_size"] = max(8, round(args.hidden * ratio / 8) * 8)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False  # and no activation checkpointing: from_config leaves it off
    return model


def patch(model, args) -> str:
    if args.no_fusepatch:
        return "none"
    import fusepatch

    if args.fast_accum:  # before apply: the FP8 op's self-test runs the GEMMs the steps will
        from fast_accum import use_fast_accumulation

        use_fast_accumulation()
    # fp8 where FP8 cannot run (the CPU): fusepatch says so at WARNING and keeps the projections in bf16
    if args.precision == "fp8":
        report = fusepatch.apply(model, precision="fp8", lm_head_precision="fp8" if args.fp8_lm_head else None)
    else:
        report = fusepatch.apply(model)
    return str(report).splitlines()[0] if str(report) else ""


def schedule(step: int, steps: int, warmup: int) -> float:
    """The learning rate's factor at ``step`` (0-based): linear warmup over ``warmup`` steps, then cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def evaluate(model, val: torch.Tensor, batch: int, device: str) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(val), batch):
        x = val[i : i + batch].to(device)
        loss = model(input_ids=x, labels=x).loss
        total += float(loss) * len(x)
        count += len(x)
    model.train()
    return total / count


def versions() -> dict:
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import tokenizers

        found["tokenizers"] = tokenizers.__version__
    except ImportError:
        pass
    found["fusepatch_git"] = code()
    return found


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--no-fusepatch", action="store_true", help="the model unpatched (transformers' own)")
    parser.add_argument(
        "--fast-accum", action="store_true", help="FP8 GEMMs with use_fast_accum=True (benchmarks/fast_accum.py)"
    )
    parser.add_argument(
        "--fp8-lm-head",
        action="store_true",
        help='with --precision fp8: apply(lm_head_precision="fp8"), the head in FP8 too',
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0, help="the weights' initialisation (the data order is fixed)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4, help="sequences a step (8 x 2048 x 300 overruns the corpus)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-seqs", type=int, default=32, help="at most this many held-out sequences")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="the last files held out for eval")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokenizer-mb", type=float, default=4.0)
    parser.add_argument("--stdlib", default=None, help="the corpus root (default: this Python's standard library)")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--hidden", type=int, default=None, help="a smaller hidden size (smoke tests)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.fast_accum and (args.precision != "fp8" or args.no_fusepatch):
        parser.error("--fast-accum: only with --precision fp8 (fusepatch's FP8 GEMMs)")
    if args.fp8_lm_head and (args.precision != "fp8" or args.no_fusepatch):
        parser.error("--fp8-lm-head: only with --precision fp8 (fusepatch's FP8 GEMMs)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    data = build_data(args)
    model = build_model(args, data["vocab"], data["eos"])
    label = "unpatched" if args.no_fusepatch else args.precision + ("+fastaccum" if args.fast_accum else "")
    label += "+head" if args.fp8_lm_head else ""
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, {label}, {args.device}")
    summary = patch(model, args)
    if summary:
        print(summary)
    model.train()
    fused = str(args.device).startswith("cuda")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=fused or None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, args.steps, args.warmup))
    losses: list[torch.Tensor] = []
    evals: dict[int, float] = {}
    tokens = args.batch * args.seq_len
    train_s = first_s = 0.0
    sync(args.device)
    start = time.perf_counter()
    for step in range(args.steps):
        x = data["train"][step].to(args.device, non_blocking=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        done = step + 1
        if done == 1 or done % args.eval_every == 0 or done == args.steps:
            sync(args.device)
            elapsed = time.perf_counter() - start
            if done == 1:
                first_s = elapsed
            else:
                train_s += elapsed
            if done % args.eval_every == 0 or done == args.steps:
                evals[done] = evaluate(model, data["val"], args.batch, args.device)
                print(f"step {done}: train {float(losses[-1]):.4f} eval {evals[done]:.4f}", flush=True)
            sync(args.device)
            start = time.perf_counter()
    curve = torch.stack(losses).cpu().tolist()
    timed = args.steps - 1
    tokens_per_s = timed * tokens / train_s if timed and train_s else None
    print("losses: " + " ".join(f"{v:.5f}" for v in curve))
    print("eval: " + " ".join(f"{s}={v:.5f}" for s, v in evals.items()))
    rate = f"{tokens_per_s:,.0f}" if tokens_per_s else "n/a"
    print(f"tokens/s: {rate} (steps 2-{args.steps}, eval excluded; first step {first_s:.2f} s)")
    finite = all(math.isfinite(v) for v in curve)
    if not finite:
        print("warning: non-finite training losses", file=sys.stderr)
    if args.json_out:
        gpu = torch.cuda.get_device_name() if fused and torch.cuda.is_available() else None
        record = {
            "benchmark": "text_curves",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "label": label,
            "losses": curve,
            "eval": {str(s): v for s, v in evals.items()},
            "tokens_per_s": tokens_per_s,
            "first_step_s": first_s,
            "finite": finite,
            "args": vars(args),
            "model_config": model.config.to_dict(),
            "data": data["info"],
            "fusepatch": summary,
            "versions": versions(),
            "gpu": gpu,
        }
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
