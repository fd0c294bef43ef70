"""Where the GPU waits for the host in a synced training step's forward, without the profiler's overhead.

A synced step starts on an empty GPU queue: the GPU idles until the host has queued enough long work to stay
ahead, and every host microsecond before that point is a microsecond of the step. The torch profiler can show
the gaps but inflates the host side by its own per-op bookkeeping; this probe puts a CUDA event and a host clock
reading at each of a few hundred points of the forward (module boundaries, every dispatched fusepatch op, every
Triton launch) and reads, for each point, when the host queued it and when the GPU reached it:

- ``host_ms``: the host clock at the point, from the step's start (right after the synchronize);
- ``gpu_ms``: when the GPU passed the point's event, from an event recorded at the step's start;
- ``lead``: ``gpu_ms - host_ms``, how far the host was ahead of the GPU there (the work queued in front of the
  point). Near zero, the GPU had run out of work and was waiting for the host at that point.

Run on the GPU machine (``bash benchmarks/gpu_run.sh probe 27b``):

    python benchmarks/studies/step_start.py --shape 27b --config fusepatch --json-out start.json

Each point costs the host ~2-4 us (one event record); the table's host times include that, the GPU's do not.
``--points`` limits the table printed; the JSON holds every point of the median-length step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the harness: benchmarks/
from shapes import SHAPES, build_config  # noqa: E402
from step_diagnostics import passive_hooks  # noqa: E402


class Stamps:
    """Host clock and CUDA event pairs, recorded while ``on``; events come from a pool made up front."""

    def __init__(self, size: int = 4000) -> None:
        self.pool = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        self.rows: list[tuple[str, int, torch.cuda.Event]] = []
        self.on = False
        self.t0 = 0
        self.e0 = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.rows.clear()
        self.e0.record()
        self.t0 = time.perf_counter_ns()
        self.on = True

    def __call__(self, name: str) -> None:
        if self.on and len(self.rows) < len(self.pool):
            event = self.pool[len(self.rows)]
            event.record()
            self.rows.append((name, time.perf_counter_ns(), event))

    def read(self) -> list[dict]:
        torch.cuda.synchronize()
        return [
            {
                "point": name,
                "host_ms": round((t - self.t0) / 1e6, 3),
                "gpu_ms": round(self.e0.elapsed_time(event), 3),
            }
            for name, t, event in self.rows
        ]


@contextlib.contextmanager
def _stamped(owner, name: str, stamp: Stamps, before=None, after=None):
    """``owner.name`` wrapped for the block: ``stamp(before(*args))`` ahead of each call, ``stamp(after(*args))``
    after it (either may be None)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            stamp(before(*args))
        out = original(*args, **kwargs)
        if after is not None:
            stamp(after(*args))
        return out

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def instrument(model, stamp: Stamps):
    """Stamps at module boundaries, around every fusepatch dispatch, after every Triton launch and linear. The
    module hooks are passive (``step_diagnostics.passive_hooks``): fusepatch's fused paths, which step aside for a hook
    that must see a module's call, run as in an uninstrumented step."""
    from triton.runtime.jit import JITFunction

    from fusepatch.engine.resolve import Dispatch

    inner = getattr(model, "model", model)
    named = [(model, "causal_lm"), (inner, "text_model")]
    named += [(getattr(inner, attr), attr) for attr in ("embed_tokens", "rotary_emb", "norm") if hasattr(inner, attr)]
    for index, layer in enumerate(inner.layers):
        named.append((layer, f"L{index}"))
        for attr in ("input_layernorm", "linear_attn", "self_attn", "mlp"):
            if getattr(layer, attr, None) is not None:
                named.append((getattr(layer, attr), f"L{index}.{attr}"))

    def entered(name: str):
        return lambda module, args: stamp(f"{name} >")

    def left(name: str):
        return lambda module, args, output: stamp(f"{name} <")

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            passive_hooks(pre=[(m, entered(n)) for m, n in named], post=[(m, left(n)) for m, n in named])
        )
        stack.enter_context(
            _stamped(
                Dispatch,
                "__call__",
                stamp,
                before=lambda self, *args: f"op {self.op.name} >",
                after=lambda self, *args: f"op {self.op.name} <",
            )
        )
        stack.enter_context(
            _stamped(JITFunction, "run", stamp, after=lambda self, *args: f"triton {getattr(self.fn, '__name__', '?')}")
        )
        stack.enter_context(_stamped(torch.nn.functional, "linear", stamp, after=lambda *args: "linear"))
        yield


WAITING_MS = 0.02  # a point the GPU reached this soon after the host queued it: the GPU was waiting there


def starved(rows: list[dict], within_ms: float = WAITING_MS) -> list[dict]:
    """The points where the GPU had caught up with the host (it reached them within ``within_ms`` of their
    queueing): up to the last of them, the GPU waited on the host's pace."""
    return [row for row in rows if row["gpu_ms"] - row["host_ms"] <= within_ms]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--config", default="fusepatch", choices=["fusepatch", "hf-fast"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--points", type=int, default=160)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    spec = SHAPES[args.shape]
    seq, batch = spec["seq"], spec["batch"]
    config = build_config(args.shape, args.layers)
    torch.manual_seed(0)
    device = torch.device("cuda")
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    if args.config == "fusepatch":
        import fusepatch

        fusepatch.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(stamp=None):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if stamp is not None:
            stamp("forward queued")
            stamp.on = False
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    stamp = Stamps()
    runs, times = [], []
    with instrument(model, stamp):
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            stamp.start()
            step(stamp)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
            runs.append(stamp.read())

    # per point (by its index: every step queues the same points), the median over the steps
    count = min(len(r) for r in runs)
    merged = []
    for i in range(count):
        name = runs[0][i]["point"]
        host = statistics.median(r[i]["host_ms"] for r in runs)
        gpu = statistics.median(r[i]["gpu_ms"] for r in runs)
        merged.append({"point": name, "host_ms": round(host, 3), "gpu_ms": round(gpu, 3)})
    waits = starved(merged)
    last_wait = waits[-1] if waits else None
    # host time between consecutive points, summed by the later point's kind (layer indices dropped): what each
    # launch or call costs the host over the whole forward
    by_kind: dict[str, list[float]] = defaultdict(list)
    for before, after in zip(merged, merged[1:]):
        kind = after["point"].split(".", 1)[-1] if after["point"].startswith("L") else after["point"]
        by_kind[kind].append(after["host_ms"] - before["host_ms"])
    kinds = sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))
    result = {
        "shape": args.shape,
        "config": args.config,
        "steps_ms": [round(t, 2) for t in times],
        "points": merged,
        "last_wait": last_wait,
        "waits": len(waits),
        "forward_queued": merged[-1] if merged else None,
        "host_ms_by_kind": [[kind, round(sum(ms), 3), len(ms)] for kind, ms in kinds],
    }
    print(f"shape {args.shape} {args.config}: synced steps (instrumented) {[round(t, 1) for t in times]} ms")
    print(f"{'point':48s} {'host ms':>8s} {'gpu ms':>8s} {'lead':>7s} {'host +':>7s}")
    previous = 0.0
    for row in merged[: args.points]:
        lead = row["gpu_ms"] - row["host_ms"]
        flag = "  <- GPU waiting" if lead <= WAITING_MS else ""
        print(
            f"{row['point'][:48]:48s} {row['host_ms']:8.3f} {row['gpu_ms']:8.3f} {lead:7.3f} "
            f"{row['host_ms'] - previous:7.3f}{flag}"
        )
        previous = row["host_ms"]
    if last_wait:
        print(f"last point the GPU waited at: {last_wait}; {len(waits)} such points")
    if merged:
        print(f"forward queued at host {merged[-1]['host_ms']} ms, GPU there at {merged[-1]['gpu_ms']} ms")
    print("host ms before each kind of point, summed over the forward (the time since the point before it):")
    for kind, ms in kinds[:30]:
        print(f"  {kind[:48]:48s} {sum(ms):7.3f} ms over {len(ms)} ({sum(ms) / len(ms) * 1000:6.1f} us each)")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
