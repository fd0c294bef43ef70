"""The loss-curve benchmarks on the CPU: text_curves.py's smoke run, loss_curves.py's comparison of two configs."""

from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import REPO

sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "studies")]  # the harness, the studies
import loss_curves  # noqa: E402
import text_curves  # noqa: E402


def test_text_curves_smoke_on_cpu(tmp_path, capsys):
    """A tiny model, three steps: a ``losses:`` line of three finite values, an eval loss, the JSON record."""
    out = tmp_path / "run.json"
    argv = ["--device", "cpu", "--steps", "3", "--batch", "1", "--seq-len", "64", "--layers", "2", "--hidden", "64"]
    argv += ["--tokenizer-mb", "1", "--vocab", "512", "--eval-seqs", "4", "--json-out", str(out)]
    assert text_curves.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    (curve,) = [line for line in lines if line.startswith("losses: ")]
    values = [float(v) for v in curve.split()[1:]]
    assert len(values) == 3 and all(math.isfinite(v) for v in values)
    assert any("no document repeats" in line for line in lines)
    (evals,) = [line for line in lines if line.startswith("eval: ")]
    assert evals.split()[1].startswith("3=")
    record = json.loads(out.read_text())
    assert len(record["losses"]) == 3 and list(record["eval"]) == ["3"]
    assert record["model_config"]["vocab_size"] == 512 and record["model_config"]["num_hidden_layers"] == 2
    assert record["data"]["train_tokens"] == 3 * 64 and record["versions"]["torch"] == text_curves.torch.__version__


def test_text_curves_reads_each_file_once_and_refuses_to_repeat(tmp_path):
    """The corpus: .py files in path order, without test/tests/site-packages/idlelib; more tokens than it holds
    stop the run before training, saying how many steps fit."""
    for name in ("b.py", "a/c.py", "test/t.py", "a/tests/t.py", "site-packages/s.py", "idlelib/i.py", "d.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("def f(x):\n    return x + 1\n" * 50)
    assert text_curves.corpus_files(str(tmp_path)) == [str(tmp_path / "a/c.py"), str(tmp_path / "b.py")]
    args = text_curves.parse_args(["--stdlib", str(tmp_path), "--steps", "100", "--seq-len", "64", "--vocab", "300"])
    with pytest.raises(
        SystemExit, match=r"\(1 files\); 100 steps of 4 x 64 need 25,600: at most \d steps fit without repeating"
    ):
        text_curves.build_data(args)


def _log(path, curve):
    path.write_text("step 1\nlosses: " + " ".join(f"{v:.5f}" for v in curve) + "\n")
    return str(path)


def test_loss_curves_baseline_and_candidate(tmp_path, capsys):
    """--baseline/--candidate name the configs; the spread and distance over all windows and after step 50."""
    steps = 100
    # the baseline's seeds differ by 0.1 in steps 1-25 and by 0.02 after; the candidate is at most 0.05 off
    # (steps 26-50): within the spread over all windows (0.1), but 0.03 off after step 50: outside its 0.02
    base0 = [3.0] * steps
    base1 = [3.1] * 25 + [3.02] * 75
    cand0 = [3.0] * 25 + [3.05] * 25 + [3.01] * 50
    cand1 = [3.1] * 25 + [3.02] * 25 + [3.05] * 50
    runs = [
        f"bf16:0={_log(tmp_path / 'b0.log', base0)}",
        f"bf16:1={_log(tmp_path / 'b1.log', base1)}",
        f"fp8:0={_log(tmp_path / 'c0.log', cand0)}",
        f"fp8:1={_log(tmp_path / 'c1.log', cand1)}",
    ]
    out = tmp_path / "curves.jsonl"
    assert loss_curves.main([*runs, "--baseline", "bf16", "--candidate", "fp8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bf16's run-to-run spread (largest 25-step window difference between seeds): 0.1000" in text
    assert "fp8's largest window difference from bf16 at the same seed: 0.0500 -> within the spread" in text
    assert "| all windows | 0.1000 | 0.0500 | within |" in text
    assert "| after step 50 | 0.0200 | 0.0300 | OUTSIDE |" in text
    record = json.loads(out.read_text())
    assert (record["baseline"], record["candidate"], record["within"], record["within_after"]) == (
        "bf16",
        "fp8",
        True,
        False,
    )
    assert math.isclose(record["spread_after"], 0.02, abs_tol=1e-9)
    assert math.isclose(record["distance_after"], 0.03, abs_tol=1e-9)


def test_loss_curves_defaults_compare_fusepatch_with_hf_fast(tmp_path, capsys):
    """Without the flags: hf-fast's seeds give the spread and fusepatch is the candidate, as before."""
    runs = [
        f"hf-fast:0={_log(tmp_path / 'h0.log', [2.0] * 60)}",
        f"hf-fast:1={_log(tmp_path / 'h1.log', [2.1] * 60)}",
        f"fusepatch:0={_log(tmp_path / 'f0.log', [2.05] * 60)}",
        f"fusepatch:1={_log(tmp_path / 'f1.log', [2.1] * 60)}",
    ]
    assert loss_curves.main(runs) == 0
    text = capsys.readouterr().out
    assert "hf-fast's run-to-run spread (largest 25-step window difference between seeds): 0.1000" in text
    assert "fusepatch's largest window difference from hf-fast at the same seed: 0.0500 -> within the spread" in text
    assert "| after step 50 | 0.1000 | 0.0500 | within |" in text
