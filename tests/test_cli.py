"""The command line as a user runs it: subprocesses, exit codes, the JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusepatch.ops import OPS
from fusepatch.registry import all_rows

pytestmark = pytest.mark.slow


def _run(*args: str, check_rc: int | None = 0):
    result = subprocess.run([sys.executable, "-m", "fusepatch", *args], capture_output=True, text=True, timeout=600)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stderr[-3000:]
    return result


def test_doctor_json_lists_every_op_of_every_family_with_a_verdict():
    data = json.loads(_run("doctor", "--json").stdout)
    assert {
        "fusepatch",
        "environment",
        "known_issues",
        "ops",
        "families",
        "fallbacks",
        "fixes",
        "target",
        "recommended",
    } <= set(data)
    assert set(data["ops"]) == set(OPS)
    for name, op in data["ops"].items():
        assert op["chosen"] == "eager"  # CPU machine
        for candidate in op["candidates"]:
            assert {"name", "source", "ok", "reason", "fix", "planned"} <= set(candidate)
            if candidate["source"] != "eager":
                assert not candidate["ok"] and candidate["reason"], (name, candidate)
    families = data["families"]
    for row in all_rows():
        for model_type in row.model_types:
            for op in (*row.ops, *row.planned):
                assert families[model_type][row.layer][op]["status"] in ("fused", "fallback", "planned")
    assert any("flash-linear-attention[cuda]" in fix for fix in data["fixes"])
    assert data["known_issues"][0]["affects_this_machine"] is False


def test_doctor_text_strict_and_narrowing():
    text = _run("doctor", "--model-type", "qwen3_5").stdout
    assert "Known-bad stacks" in text and "gated_delta_rule" in text and "Would fall back" in text
    assert "Qwen3NextGatedDeltaNet" not in text
    assert _run("doctor", "--strict", check_rc=1).returncode == 1
    bad = _run("doctor", "--model-type", "llama", check_rc=2)
    assert "no fusepatch rows" in bad.stderr


def test_list_shows_the_registry():
    text = _run("list").stdout
    assert (
        "Qwen3_5GatedDeltaNet" in text
        and "gated_delta_rule [fla > fla-gate-outside > hub:kernels-community/fla" in text
    )
    data = json.loads(_run("list", "--json").stdout)
    layers = {row["layer"] for row in data["rows"]}
    assert {"Qwen3_5GatedDeltaNet", "Qwen3NextGatedDeltaNet", "Qwen2RMSNorm", "Qwen3MoeExperts"} <= layers


def test_demo_trains_eager_and_patched_on_cpu():
    out = _run("demo", "--steps", "3", "--seq-len", "64").stdout
    assert "Qwen3_5GatedDeltaNet x3" in out and "gated_delta_rule" in out
    eager = [float(x) for x in out.split("eager   losses:")[1].split("steps/s")[0].split()[:3]]
    patched = [float(x) for x in out.split("patched losses:")[1].split("steps/s")[0].split()[:3]]
    assert all(abs(a - b) < 1e-3 for a, b in zip(eager, patched))
    assert "steps/s" in out
