"""The command line as a user runs it: exit codes, the JSON schema, what each stream shows. Most commands run in
this process through ``cli.main`` (what ``python -m fusepatch`` calls); the demo, ``--version`` and a doctor run
as real processes, which is also how ``python -m fusepatch`` itself is checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import in_process

from fusepatch.base.env import TRANSFORMERS_REQUIREMENT
from fusepatch.engine.registry import all_rows
from fusepatch.ops import OPS

pytestmark = pytest.mark.slow


def _run(*args: str, check_rc: int | None = 0, process: bool = False):
    """``python -m fusepatch ARGS``: in a new process where ``process``, else through ``cli.main`` in this one
    (argparse's own exits included), with the same exit code and streams."""
    if process:
        result = subprocess.run([sys.executable, "-m", "fusepatch", *args], capture_output=True, text=True, timeout=600)
    else:
        code, out, err = in_process(list(args))
        result = subprocess.CompletedProcess(["fusepatch", *args], code, out, err)
    if check_rc is not None:
        assert result.returncode == check_rc, result.stderr[-3000:]
    return result


def test_doctor_json_lists_every_op_of_every_family_with_a_verdict():
    data = json.loads(_run("doctor", "--json", process=True).stdout)
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
            assert {"name", "source", "ok", "reason", "fix"} <= set(candidate)
            if candidate["source"] != "eager":
                assert not candidate["ok"] and candidate["reason"], (name, candidate)
    families = data["families"]
    for row in all_rows():
        for model_type in row.model_types:
            for op in row.ops:
                assert families[model_type][row.layer][op]["status"] in ("fused", "fallback")
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
    text = _run("list", "--wide").stdout
    assert (
        "Qwen3_5GatedDeltaNet" in text
        and "gated_delta_rule [fla-saved-states-grouped > fla-saved-states > fla > fla-gate-outside > eager]" in text
    )
    # a row with no kernel op says what its forward does instead
    assert "Qwen3RotaryEmbedding                 patched      (cos/sin of plain positions computed once" in text
    data = json.loads(_run("list", "--json").stdout)
    layers = {row["layer"] for row in data["rows"]}
    assert {"Qwen3_5GatedDeltaNet", "Qwen3NextGatedDeltaNet", "Qwen2RMSNorm", "Qwen3MoeExperts"} <= layers


def test_demo_trains_eager_and_patched_on_cpu():
    out = _run("demo", "--steps", "3", "--seq-len", "64", process=True).stdout
    assert "Qwen3_5GatedDeltaNet x3" in out and "gated_delta_rule" in out
    eager = [float(x) for x in out.split("eager   losses:")[1].split("steps/s")[0].split()[:3]]
    patched = [float(x) for x in out.split("patched losses:")[1].split("steps/s")[0].split()[:3]]
    assert all(abs(a - b) < 1e-3 for a, b in zip(eager, patched))
    assert "steps/s" in out


def test_doctor_logs_each_candidate_and_static_loads_nothing(caplog):
    """doctor self-tests every candidate (minutes of compiling on a fresh GPU machine): each verdict is logged as
    it finishes with its time; --static checks versions/device/dtype only and loads no kernel."""
    import dataclasses
    import logging

    import torch
    from helpers import cpu_env

    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.tools.doctor import examine_op

    loads = []

    def load():
        loads.append(1)
        return lambda gate, up: torch.nn.functional.silu(gate) * up

    cpu = InputRule(devices=("cpu",), dtypes=("float32",))
    op = dataclasses.replace(OPS["swiglu"], candidates=(Candidate("good", "pip", (), load, inputs=cpu),))
    selftest.clear_cache()
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        full = examine_op(op, cpu_env(), "cpu", "float32", ("pip",))
    assert full["chosen"] == "good" and loads == [1]
    assert full["candidates"][0]["checked"] == "self-test" and full["candidates"][0]["seconds"] >= 0
    assert any("doctor: swiglu/good ok" in r.getMessage() for r in caplog.records)
    static = examine_op(op, cpu_env(), "cpu", "float32", ("pip",), static_only=True)
    assert static["chosen"] == "good" and static["candidates"][0]["checked"] == "static" and loads == [1]
    refused = examine_op(op, cpu_env(), "cpu", "bfloat16", ("pip",), static_only=True)
    assert refused["chosen"] == "eager" and "bfloat16 inputs" in refused["candidates"][0]["reason"]


def test_doctor_self_tests_up_to_the_chosen_candidate():
    """A backup candidate after the chosen one gets the checks only (a cold GPU doctor spent minutes autotuning
    kernels no model would run); ``every`` self-tests it too."""
    import dataclasses

    import torch
    from helpers import cpu_env

    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import InputRule
    from fusepatch.engine import selftest
    from fusepatch.tools.doctor import examine_op, render

    loads = []

    def load(name):
        def loader():
            loads.append(name)
            return lambda gate, up: torch.nn.functional.silu(gate) * up

        return loader

    cpu = InputRule(devices=("cpu",), dtypes=("float32",))
    first, backup = (Candidate(n, "pip", (), load(n), inputs=cpu) for n in ("first", "backup"))
    op = dataclasses.replace(OPS["swiglu"], candidates=(first, backup))
    selftest.clear_cache()
    quick = examine_op(op, cpu_env(), "cpu", "float32", ("pip",))
    assert quick["chosen"] == "first" and loads == ["first"]
    assert [c["checked"] for c in quick["candidates"][:2]] == ["self-test", "static"]
    text = render(
        {
            "environment": {
                "gpus": [],
                "python": "3",
                "torch": "2",
                "torch_cuda": None,
                "triton": None,
                "transformers": None,
                "distributions": {},
            },
            "fusepatch": "x",
            "target": {"device": "cpu", "dtype": "float32"},
            "self_tests": True,
            "known_issues": [],
            "ops": {"swiglu": quick},
            "families": {},
            "fallbacks": [],
            "fixes": [],
            "recommended": [],
        }
    )
    assert "checks   backup (pip): passes the checks; not self-tested" in text, text
    full = examine_op(op, cpu_env(), "cpu", "float32", ("pip",), every=True)
    assert loads.count("backup") == 1, loads
    assert [c["checked"] for c in full["candidates"][:2]] == ["self-test", "self-test"]


def test_doctor_static_says_so():
    text = _run("doctor", "--static", "--model-type", "qwen3").stdout
    assert "--static: checks only" in text


def test_doctor_checks_every_fusepatch_variable_as_apply_does(monkeypatch, stand_ins):
    """Each FUSEPATCH_* value apply refuses is reported with the values it takes and the rest of the report still
    comes (checked as if it were unset); FUSEPATCH_DISABLE on is said plainly; --strict fails for either. The CPU
    stand-ins leave no fallback, so the exit code is the variables' alone."""
    import torch

    import fusepatch
    from fusepatch.tools.doctor import variables

    args = ("doctor", "--static", "--model-type", "qwen3")
    assert _run(*args, "--strict").returncode == 0
    bad = {"FUSEPATCH_CE_LOGITS_MIB": "-3", "FUSEPATCH_SKIP": "swiglu/nope", "FUSEPATCH_MLP_RECOMPUTE": "maybe"}
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FUSEPATCH_PREFER", "pip")
    problems = variables()["problems"]
    for name in bad:
        with pytest.raises(ValueError) as raised:
            fusepatch.apply(torch.nn.Linear(1, 1))  # apply's own check: the same message, as one of several
        assert problems[name] in str(raised.value)
    text = _run(*args).stdout
    assert "apply raises ValueError for 3 of them and patches nothing" in text
    assert "BAD FUSEPATCH_SKIP='swiglu/nope': swiglu has no candidate 'nope'; its candidates: cpu-standin" in text
    assert "BAD FUSEPATCH_MLP_RECOMPUTE='maybe' is not a switch value; fix: set it to one of 1, true" in text
    assert "ok  FUSEPATCH_PREFER='pip'" in text and "swiglu: cpu-standin" in text  # the ops, checked as if unset
    assert _run(*args, "--strict", check_rc=1).returncode == 1
    assert set(json.loads(_run(*args, "--json").stdout)["variables"]["problems"]) == set(bad)
    for name in bad:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FUSEPATCH_DISABLE", "1")
    text = _run(*args).stdout
    assert "FUSEPATCH_DISABLE is on: fusepatch.apply patches nothing" in text and "fix: unset FUSEPATCH_DISABLE" in text
    assert "every op: FUSEPATCH_DISABLE is on" in text.split("Would fall back")[1]
    assert _run(*args, "--strict", check_rc=1).returncode == 1
    assert json.loads(_run(*args, "--json").stdout)["variables"]["disabled"] is True


HIDE_TRANSFORMERS = """
import sys
class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
sys.meta_path.insert(0, _Hidden())
"""


# Each command as ``python -m fusepatch`` runs it, in one process (the imports paid once): its exit status, and what it
# wrote to stderr; then what tiny_model raises.
EVERY_COMMAND = """
import contextlib, io, json, runpy, sys
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    sys.argv = ["fusepatch", *args]
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("fusepatch", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    results.append({"args": args, "code": code, "stderr": err.getvalue()})
import fusepatch.tools.tiny
try:
    fusepatch.tools.tiny.tiny_model()
    tiny = ""
except ImportError as e:
    tiny = str(e)
print(json.dumps({"commands": results, "tiny": tiny}))
"""


def test_without_transformers_every_command_is_one_line_with_the_fix(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_TRANSFORMERS)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    failing = [["demo", "--steps", "1"], ["warmup", "qwen3_5_text", "--device", "cpu"], ["doctor", "--static"]]
    commands = json.dumps([*failing, ["list"]])
    result = subprocess.run(
        [sys.executable, "-c", EVERY_COMMAND, commands], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for ran in data["commands"]:
        if ran["args"] == ["list"]:
            assert ran["code"] == 0, ran
            continue
        assert ran["code"] == 2, ran
        assert "Traceback" not in ran["stderr"]
        assert f"pip install '{TRANSFORMERS_REQUIREMENT}'" in ran["stderr"], ran
    assert f"fix: pip install '{TRANSFORMERS_REQUIREMENT}'" in data["tiny"], data["tiny"]


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--static"], ["doctor", "--json"]])
def test_doctor_without_transformers_fails_with_the_install_fix(monkeypatch, capsys, args):
    """Without transformers nothing can be patched: doctor must not exit 0 as if all were well."""
    from fusepatch.tools import cli

    monkeypatch.setitem(sys.modules, "transformers", None)  # ``import transformers`` raises ModuleNotFoundError
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("python -m fusepatch doctor: error: ")
        and f"fix: pip install '{TRANSFORMERS_REQUIREMENT}'" in err
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be 1 or more, got 0"),
        (["demo", "--model-type", "llama"], "argument --model-type: invalid choice: 'llama'"),
        (["warmup", "qwen3_5_text", "--dtype", "float64x"], "argument --dtype: invalid choice: 'float64x'"),
        (["doctor", "--model-type", "llama", "--static"], "no fusepatch rows for model_type ['llama']"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    result = _run(*args, check_rc=None)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("json_output", [False, True])
def test_list_of_an_unknown_model_type_is_an_error_naming_the_supported_ones(json_output):
    from fusepatch.engine.registry import known_model_types

    result = _run("list", "--model-type", "llama", *(["--json"] if json_output else []), check_rc=None)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m fusepatch list: error: ") and "'llama'" in line
    assert f"supported: {', '.join(known_model_types())}" in line


def test_demo_on_a_missing_gpu_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    result = _run("demo", "--device", "cuda", check_rc=2)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m fusepatch demo: error: --device cuda: torch ") and "fix:" in line


def test_version_verbose_everywhere_and_lines_fit_100_columns():
    import fusepatch

    assert _run("--version", process=True).stdout.strip() == f"fusepatch {fusepatch.__version__}"
    doctor = _run("doctor", "-v", "--static").stdout
    listing = _run("list").stdout
    for text in (doctor, listing):
        assert max(len(line) for line in text.splitlines()) <= 100
    assert listing.splitlines()[0].startswith("model types")
    assert doctor.count("CPU-only build") <= 1  # a reason every candidate shares is said once
    assert max(len(line) for line in _run("list", "--wide").stdout.splitlines()) > 100


def test_help_does_not_import_torch():
    code = "import sys, runpy; sys.argv = ['fusepatch', '--help']\ntry:\n    runpy.run_module('fusepatch', run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr[-2000:]
