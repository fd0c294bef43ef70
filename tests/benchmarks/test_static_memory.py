"""``benchmarks/studies/static_memory.py``'s per-rank count under FSDP2 and ZeRO-3, against rules worked out from
the tiny shape's parameters (what a CPU gloo run holds is checked in tests/integrations/test_fsdp2.py)."""

from __future__ import annotations

import json
import sys

from helpers import REPO

sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "studies")]  # the harness, the studies
from static_memory import _projection, build, main, per_rank, static_memory  # noqa: E402


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def test_per_rank_counts_fsdp2_rows_and_zero3_parts():
    """Full fine-tuning: FSDP2 keeps rank 0's chunk of ``ceil(rows / N)`` rows of every parameter in fp32
    (accelerate's upcast under bf16), with fp32 gradients and AdamW states; ZeRO-3 ``ceil(numel / N)`` values in
    bf16 with a bf16 gradient, and fp32 master and AdamW states (12 bytes a value). FP8 keeps no copy of a trained
    weight."""
    model = build("tiny", None, lora=0)
    params = list(model.parameters())
    for world in (1, 2, 4, 8):
        fsdp2 = per_rank(model, "bf16", engine="fsdp2", world=world)["bytes"]
        rows = sum(_ceil(p.shape[0], world) * (p.numel() // p.shape[0]) for p in params)
        assert fsdp2 == {
            "parameters": 4 * rows,
            "gradients": 4 * rows,
            "optimizer_states": 8 * rows,
            "projections_fp8": 0,
        }
        zero3 = per_rank(model, "bf16", engine="zero3", world=world)["bytes"]
        parts = sum(_ceil(p.numel(), world) for p in params)
        assert zero3 == {
            "parameters": 2 * parts,
            "gradients": 2 * parts,
            "optimizer_states": 12 * parts,
            "projections_fp8": 0,
        }
        assert per_rank(model, "fp8", engine="fsdp2", world=world)["bytes"] == fsdp2
    one = per_rank(model, "bf16", engine="zero3", world=1)["bytes"]
    whole = static_memory(model, "bf16")["bytes"]  # the unsharded count: every parameter in bf16
    assert one["parameters"] == whole["embedding_and_head"] + whole["projections"] + whole["other"]


def test_per_rank_fp8_copies_whole_today_and_sharded_ideal():
    """LoRA: the frozen projections' FP8 copies (one byte a value, one fp32 scale a row) are whole on every rank
    today, the same at every N as the unsharded count; the sharded ideal keeps ``ceil(rows / N)`` rows of each,
    and with dropped bases also leaves out the bases' bf16 chunks (which today stay)."""
    model = build("tiny", None, lora=4)
    frozen = [m.weight for name, m in model.named_modules() if _projection(name, m) and not m.weight.requires_grad]
    assert frozen
    whole_copy = static_memory(model, "fp8")["bytes"]["projections_fp8"]
    for engine in ("fsdp2", "zero3"):
        for world in (1, 2, 4, 8):
            current = per_rank(model, "fp8", engine=engine, world=world, fp8_copy="current")["bytes"]
            ideal = per_rank(model, "fp8", engine=engine, world=world, fp8_copy="sharded")["bytes"]
            assert current["projections_fp8"] == whole_copy
            assert ideal["projections_fp8"] == sum(_ceil(w.shape[0], world) * (w.shape[1] + 4) for w in frozen)
            assert (ideal["projections_fp8"] < whole_copy) == (world > 1)
            bf16 = per_rank(model, "bf16", engine=engine, world=world)["bytes"]
            assert current["parameters"] == ideal["parameters"] == bf16["parameters"]
            kept = per_rank(model, "fp8+drop", engine=engine, world=world, fp8_copy="current")["bytes"]
            dropped = per_rank(model, "fp8+drop", engine=engine, world=world, fp8_copy="sharded")["bytes"]
            assert kept == current  # drop_frozen_weights=True drops nothing under either engine today
            chunk = sum(
                (_ceil(w.shape[0], world) * w.shape[1] if engine == "fsdp2" else _ceil(w.numel(), world)) * 2
                for w in frozen
            )
            assert dropped["parameters"] == bf16["parameters"] - chunk


def test_world_rows_are_printed_and_recorded(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["static_memory.py", "--shape", "tiny", "--lora", "4", "--world", "1", "2", "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    per = [r for r in rows if r["kind"] == "static-memory-per-rank"]
    assert len(per) == 2 * 2 * 5  # N, engine, and bf16 plus two copies each of fp8 and fp8+drop
    assert {(r["world"], r["engine"], r["precision"], r["fp8_copy"]) for r in per} >= {(2, "fsdp2", "fp8", "current")}
    assert "per rank (rank 0)" in capsys.readouterr().out
