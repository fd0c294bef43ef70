"""Every ``apply`` argument and every ``FUSEPATCH_*`` variable takes its documented values only: anything else is an
error that names the option, the value and what it accepts, never a silent default (fusepatch/base/options.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO

import fusepatch
from fusepatch.base import options
from fusepatch.tools.tiny import tiny_model

ALL_VARIABLES = (
    "FUSEPATCH_DISABLE",
    "FUSEPATCH_MLP_RECOMPUTE",
    "FUSEPATCH_VERBOSITY",
    "FUSEPATCH_PREFER",
    "FUSEPATCH_SKIP",
    "FUSEPATCH_CE_LOGITS_MIB",
    "FUSEPATCH_TRUST_KERNELS",
    "FUSEPATCH_KERNELS_LOCK",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for variable in ALL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"strict": "no"}, TypeError, r"strict expects True or False, got 'no' \(str\); fix: strict=False"),
        ({"strict": 1}, TypeError, r"strict expects True or False, got 1 \(int\)"),
        ({"verbose": "yes"}, TypeError, r"verbose expects True, False or None, got 'yes' \(str\); fix: verbose=True"),
        (
            {"cuda_graphs": "yes"},
            TypeError,
            r"cuda_graphs expects True or False, got 'yes' \(str\); fix: cuda_graphs=True",
        ),
        ({"compute_dtype": torch.int8}, ValueError, r"compute_dtype=torch.int8: .*torch.bfloat16, torch.float16"),
        ({"compute_dtype": "int8"}, ValueError, r"compute_dtype='int8': .*'bf16'"),
        ({"compute_dtype": "auto"}, ValueError, r"compute_dtype='auto'"),
        ({"compute_dtype": 16}, TypeError, r"compute_dtype expects a torch floating dtype or its name, got 16 \(int\)"),
    ],
)
def test_apply_refuses_an_argument_outside_its_values(kwargs, error, match):
    model = tiny_model("qwen3")
    with pytest.raises(error, match=match):
        fusepatch.apply(model, **kwargs)
    assert not any(hasattr(m, "_fusepatch") for m in model.modules())


@pytest.mark.parametrize(
    "value, dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("FP16", torch.float16),
        ("fp32", torch.float32),
        (None, None),
    ],
)
def test_compute_dtype_takes_torch_dtypes_and_their_names(value, dtype):
    """As transformers' ``dtype="bfloat16"``: the names of torch's floating dtypes and the short bf16/fp16/fp32."""
    assert options.compute_dtype(value) is dtype


def test_a_compute_dtype_name_is_the_dtype_apply_and_report_use():
    model = tiny_model("qwen3")
    assert fusepatch.apply(model, compute_dtype="bf16", verbose=False).dtype == "bfloat16"
    assert fusepatch.report(model, compute_dtype="bf16").dtype == "bfloat16"


@pytest.mark.parametrize(
    "variable, value, match",
    [
        ("FUSEPATCH_DISABLE", "maybe", r"FUSEPATCH_DISABLE='maybe'.*1, true, yes, on.*0, false, no, off"),
        ("FUSEPATCH_MLP_RECOMPUTE", "2", r"FUSEPATCH_MLP_RECOMPUTE='2'"),
        ("FUSEPATCH_VERBOSITY", "loud", r"FUSEPATCH_VERBOSITY='loud'.*error, warning, info, debug"),
        ("FUSEPATCH_PREFER", "conda", r"FUSEPATCH_PREFER='conda'.*'pip', 'hub'"),
        ("FUSEPATCH_SKIP", "nosuchop/x", r"FUSEPATCH_SKIP='nosuchop/x': no op 'nosuchop'.*rms_norm.*\*"),
        ("FUSEPATCH_SKIP", "rms_norm/nosuch", r"FUSEPATCH_SKIP='rms_norm/nosuch': rms_norm has no candidate 'nosuch'"),
        ("FUSEPATCH_SKIP", "*/nosuch", r"FUSEPATCH_SKIP='\*/nosuch': no op has a candidate 'nosuch'.*triton"),
        ("FUSEPATCH_SKIP", "rms_norm", r"FUSEPATCH_SKIP='rms_norm': expected op/candidate"),
        ("FUSEPATCH_CE_LOGITS_MIB", "lots", r"FUSEPATCH_CE_LOGITS_MIB='lots': expected a whole number"),
        ("FUSEPATCH_CE_LOGITS_MIB", "0", r"FUSEPATCH_CE_LOGITS_MIB='0': expected a positive number of MiB"),
        ("FUSEPATCH_TRUST_KERNELS", "my org", r"FUSEPATCH_TRUST_KERNELS='my org': 'my org' is not"),
        ("FUSEPATCH_KERNELS_LOCK", "/no/such/kernels.lock", r"FUSEPATCH_KERNELS_LOCK='/no/such/kernels.lock': no such"),
    ],
)
def test_apply_refuses_an_environment_value_outside_its_values(monkeypatch, variable, value, match):
    """Read at ``apply``, a value a variable does not take raises there, with the variable, the value and the values
    it takes; a variable read later (the loss's chunk budget, the Hub's) is checked then too."""
    model = tiny_model("qwen3")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=match):
        fusepatch.apply(model)
    assert not any(hasattr(m, "_fusepatch") for m in model.modules())


def test_every_variable_is_checked_and_reported_together(monkeypatch):
    monkeypatch.setenv("FUSEPATCH_DISABLE", "maybe")
    monkeypatch.setenv("FUSEPATCH_VERBOSITY", "loud")
    with pytest.raises(ValueError) as raised:
        options.check_environment({"rms_norm": ("triton", "fla")})
    assert "FUSEPATCH_DISABLE='maybe'" in str(raised.value) and "FUSEPATCH_VERBOSITY='loud'" in str(raised.value)


def test_a_retired_variable_is_said_and_apply_still_patches(monkeypatch, caplog):
    """A variable fusepatch no longer reads is not silently ignored: apply says so, with what replaced it."""
    monkeypatch.setenv("FUSEPATCH_CUDA_GRAPHS", "1")
    with caplog.at_level("WARNING", logger="fusepatch"):
        report = fusepatch.apply(tiny_model("qwen3"), verbose=False)
    said = [r.getMessage() for r in caplog.records if "FUSEPATCH_CUDA_GRAPHS" in r.getMessage()]
    assert len(said) == 1 and "cuda_graphs=True" in said[0] and "unset it" in said[0]
    assert report.newly_patched > 0


@pytest.mark.parametrize("value", ["1", "TRUE", "Yes", "on", " On "])
def test_switch_on_values(monkeypatch, value):
    monkeypatch.setenv("FUSEPATCH_DISABLE", value)
    assert options.switch("FUSEPATCH_DISABLE") is True
    report = fusepatch.apply(tiny_model("qwen3"))
    assert report.newly_patched == 0 and "FUSEPATCH_DISABLE" in report.message


@pytest.mark.parametrize("value", ["0", "false", "NO", "off", ""])
def test_switch_off_values(monkeypatch, value):
    monkeypatch.setenv("FUSEPATCH_DISABLE", value)
    assert options.switch("FUSEPATCH_DISABLE") is False
    assert fusepatch.apply(tiny_model("qwen3"), verbose=False).newly_patched > 0


def test_skip_takes_every_op_and_candidate_name(monkeypatch):
    catalogue = {
        "rms_norm": ("triton", "fla"),
        "causal_conv1d": ("causal-conv1d", "hub:kernels-community/causal-conv1d"),
    }
    text = "rms_norm/triton; */fla, causal_conv1d/hub:kernels-community/causal-conv1d"
    assert options.skip_pairs(text, catalogue) == {
        ("rms_norm", "triton"),
        ("*", "fla"),
        ("causal_conv1d", "hub:kernels-community/causal-conv1d"),
    }
    assert options.skip_pairs(" ", catalogue) == set()
    monkeypatch.setenv("FUSEPATCH_SKIP", "rms_norm/triton,*/fla")
    assert fusepatch.apply(tiny_model("qwen3"), verbose=False).newly_patched > 0


def test_trusted_publishers(monkeypatch):
    assert options.trusted_kernels() == ()
    for value in ("1", "all", "*", "TRUE"):
        monkeypatch.setenv("FUSEPATCH_TRUST_KERNELS", value)
        assert options.trusted_kernels() == ("*",)
    monkeypatch.setenv("FUSEPATCH_TRUST_KERNELS", "acme/swiglu, other")
    assert options.trusted_kernels() == ("acme/swiglu", "other")
    from fusepatch.backends.kernels_hub import trusted

    assert trusted("acme/swiglu") and trusted("other/rms_norm") and trusted("kernels-community/x")  # a publisher: all
    assert not trusted("acme/other") and not trusted("others/x")
    monkeypatch.setenv("FUSEPATCH_TRUST_KERNELS", "0")
    assert options.trusted_kernels() == ()


def test_env_vars_page_lists_every_variable_fusepatch_reads():
    """docs/env-vars.md and the package agree: every FUSEPATCH_ variable the package reads is on the page, and
    every one on the page is checked by check_environment (or is a path: FUSEPATCH_CACHE)."""
    import re

    root = REPO
    page = (root / "docs" / "env-vars.md").read_text()
    documented = set(re.findall(r"^\| `(FUSEPATCH_[A-Z_]+)`", page, re.M))
    read = set()
    for path in (root / "fusepatch").rglob("*.py"):
        read |= set(re.findall(r"\"(FUSEPATCH_[A-Z_]+)\"", path.read_text()))
    assert read - set(options.RETIRED) <= documented, read - documented
    assert documented - {"FUSEPATCH_CACHE"} == set(options.VARIABLES)
    assert all(f"`{variable}`" in page for variable in options.RETIRED)  # said as no longer read
