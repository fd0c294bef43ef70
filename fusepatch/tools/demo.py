"""A tiny Qwen3.5 trained a few steps eager and patched: the report, both losses, steps/s. Runs on CPU."""

from __future__ import annotations

import copy
import time

import torch

from fusepatch.base.dtypes import dtype_name
from fusepatch.engine.patch import apply
from fusepatch.tools.tiny import tiny_model


def _train(model, batches, steps: int) -> tuple[list[float], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    start = None
    for step in range(steps):
        if step == 1:  # the first step compiles / autotunes kernels: keep it out of steps/s
            sync()
            start = time.perf_counter()
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    sync()
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    return losses, (steps - 1) / elapsed if steps > 1 else float("nan")


def run(
    *,
    model_type: str = "qwen3_5_text",
    steps: int = 5,
    seq_len: int = 128,
    batch: int = 2,
    device: str | None = None,
    precision: str | None = None,
) -> dict:
    """Train the same tiny model twice from the same weights, unpatched then patched; return the numbers."""

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = tiny_model(model_type, seed=0).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    batches = [torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device) for _ in range(4)]

    eager = copy.deepcopy(base)
    eager_losses, eager_rate = _train(eager, batches, steps)
    patched = copy.deepcopy(base)
    report = apply(patched, verbose=False, precision=precision)  # the report is printed whole below
    patched_losses, patched_rate = _train(patched, batches, steps)
    return {
        "model_type": model_type,
        "device": device,
        "dtype": dtype_name(dtype),
        "report": report,
        "eager_losses": eager_losses,
        "patched_losses": patched_losses,
        "eager_steps_per_s": eager_rate,
        "patched_steps_per_s": patched_rate,
    }
