"""The benchmark driver's configuration labels (the GPU runs themselves are recorded in benchmarks/RESULTS.md)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import run_all  # noqa: E402


def test_labels_carry_environment_settings_for_variants():
    assert run_all.parse_label("hf-fast") == ("hf-fast", {})
    assert run_all.parse_label("fusepatch+FUSEPATCH_CE_LOGITS_MIB=1024+X=a=b") == (
        "fusepatch",
        {"FUSEPATCH_CE_LOGITS_MIB": "1024", "X": "a=b"},
    )
    with pytest.raises(ValueError, match="unknown configuration 'fusepach'"):
        run_all.parse_label("fusepach")
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        run_all.parse_label("fusepatch+1024")
