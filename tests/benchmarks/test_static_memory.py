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


def test_per_rank_fp8_copies_sharded_under_fsdp2_none_under_zero3():
    """LoRA: the frozen projections' FP8 copies (one byte a value, one fp32 scale a row): under FSDP2 each rank keeps
    ``ceil(rows / N)`` rows of each, and with dropped bases leaves out its bf16 rows of them (not at one rank);
    under ZeRO-3 none is kept and nothing dropped; a whole copy a rank (``whole``) is the unsharded count."""
    model = build("tiny", None, lora=4)
    frozen = [m.weight for name, m in model.named_modules() if _projection(name, m) and not m.weight.requires_grad]
    assert frozen
    whole_copy = static_memory(model, "fp8")["bytes"]["projections_fp8"]
    for world in (1, 2, 4, 8):
        for engine in ("fsdp2", "zero3"):
            whole = per_rank(model, "fp8", engine=engine, world=world, fp8_copy="whole")["bytes"]
            kept = per_rank(model, "fp8", engine=engine, world=world)["bytes"]
            bf16 = per_rank(model, "bf16", engine=engine, world=world)["bytes"]
            assert whole["projections_fp8"] == whole_copy
            assert whole["parameters"] == kept["parameters"] == bf16["parameters"]
        sharded = per_rank(model, "fp8", engine="fsdp2", world=world)["bytes"]
        assert sharded["projections_fp8"] == sum(_ceil(w.shape[0], world) * (w.shape[1] + 4) for w in frozen)
        assert (sharded["projections_fp8"] < whole_copy) == (world > 1)
        dropped = per_rank(model, "fp8+drop", engine="fsdp2", world=world)["bytes"]
        rows = sum(_ceil(w.shape[0], world) * w.shape[1] * 2 for w in frozen) if world > 1 else 0
        assert dropped["parameters"] == sharded["parameters"] - rows
        zero3 = per_rank(model, "fp8", engine="zero3", world=world)["bytes"]
        assert zero3 == per_rank(model, "bf16", engine="zero3", world=world)["bytes"]
        assert per_rank(model, "fp8+drop", engine="zero3", world=world)["bytes"] == zero3


def test_world_rows_are_printed_and_recorded(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["static_memory.py", "--shape", "tiny", "--lora", "4", "--world", "1", "2", "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    per = [r for r in rows if r["kind"] == "static-memory-per-rank"]
    # per N: FSDP2's bf16, fp8 whole and sharded, fp8+drop sharded; ZeRO-3's bf16, fp8 whole and per call
    assert len(per) == 2 * (4 + 3)
    assert {(r["world"], r["engine"], r["precision"], r["fp8_copy"]) for r in per} >= {
        (2, "fsdp2", "fp8+drop", "sharded"),
        (2, "zero3", "fp8", "per-call"),
    }
    assert "per rank (rank 0)" in capsys.readouterr().out
