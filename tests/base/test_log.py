"""fusepatch's log is visible without any logging set up, once, at the level FUSEPATCH_VERBOSITY asks for."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import fusepatch
from fusepatch.base.state import current as process_state
from fusepatch.tools.tiny import tiny_model

pytestmark = pytest.mark.slow

APPLY = "import fusepatch\nfrom fusepatch.tools.tiny import tiny_model\nfusepatch.apply(tiny_model('qwen3'){args})\n"


def _stderr(code: str, **env: str) -> str:
    import os

    environment = {k: v for k, v in os.environ.items() if k != "FUSEPATCH_VERBOSITY"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**environment, **env}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_apply_is_seen_without_logging_configured_and_each_reason_once():
    err = _stderr(APPLY.format(args=""))
    lines = err.strip().splitlines()
    assert lines[0].startswith("fusepatch: Qwen3ForCausalLM on cpu/float32: ") and "of 6 ops fused" in lines[0]
    cpu = [line for line in lines if "CPU-only build" in line]
    assert len(cpu) == 1 and "fix: run on a machine with an NVIDIA GPU" in cpu[0]
    assert len(lines) == len(set(lines))


def test_with_logging_configured_each_line_is_shown_once():
    err = _stderr("import logging\nlogging.basicConfig(format='%(message)s')\n" + APPLY.format(args=""))
    lines = err.strip().splitlines()
    assert sum("CPU-only build" in line for line in lines) == 1
    assert sum(line.startswith("fusepatch: Qwen3ForCausalLM on cpu/float32") for line in lines) == 1


def test_verbosity_switches(monkeypatch, caplog):
    from fusepatch.base import log

    monkeypatch.setenv("FUSEPATCH_VERBOSITY", "warning")
    assert log.verbosity() == logging.WARNING
    monkeypatch.setenv("FUSEPATCH_VERBOSITY", "DEBUG")
    assert log.verbosity() == logging.DEBUG
    monkeypatch.setenv("FUSEPATCH_VERBOSITY", "loud")
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert log.verbosity() == logging.INFO
    assert "is not one of error, warning, info, debug" in caplog.text
    monkeypatch.delenv("FUSEPATCH_VERBOSITY")  # apply refuses the value (tests/base/test_options.py)
    for verbose, table, totals in ((True, True, False), (None, False, True), (False, False, False)):
        caplog.clear()
        process_state().said.reset()  # as in a fresh process: each reason is said once per process
        with caplog.at_level(logging.INFO, logger="fusepatch"):
            report = fusepatch.apply(tiny_model("qwen3"), verbose=verbose)
        infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("why not fused" in m for m in infos) == table
        assert (report.totals() in infos) == totals
        assert warnings == report.grouped_fallbacks() and warnings  # a fallback is never silent


def test_fallbacks_are_grouped_by_reason(caplog):
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        report = fusepatch.apply(tiny_model("qwen3_5_text"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == report.grouped_fallbacks()
    reasons = [line.split(": ", 2)[2] for line in warnings]
    assert len(reasons) == len(set(reasons))
    gdn = next(line for line in warnings if "fla-core is not installed" in line)
    assert "gated_delta_rule" in gdn and "fix: pip install" in gdn
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert report.totals() in infos


def test_each_fallback_reason_is_logged_once_per_process(caplog):
    """A TRL SFT run logged one reason 22 times in 45 lines: every apply, and every new dtype or packed call a layer
    met after it, said its reasons again. Each distinct reason is said once per process, with its fix."""
    import torch
    from helpers import assert_each_reason_once, fallback_reasons

    ids = torch.randint(0, 512, (1, 12))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
    with caplog.at_level(logging.INFO, logger="fusepatch"):
        models = [tiny_model("qwen3"), tiny_model("qwen3_5_text"), tiny_model("qwen3")]
        for model in models:
            fusepatch.apply(model)
            model(input_ids=ids, labels=ids, use_cache=False)
            model.to(torch.bfloat16)(input_ids=ids, labels=ids, position_ids=packed, use_cache=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    reasons = fallback_reasons(*models)
    assert_each_reason_once(warnings, reasons)
