"""DeepSpeed ZeRO-2 and ZeRO-3 with world size 2 on CPU (DeepSpeed's CPU accelerator, gloo): the patched model
trains as the unsharded, unpatched one, full fine-tuning and LoRA, on padded and packed batches, through
``deepspeed.initialize`` and through the Trainer's ``deepspeed=`` config. Every case runs in one launch of two
processes (tests/integrations/distributed/deepspeed_worker.py)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import TESTS, torchrun

pytest.importorskip("deepspeed")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "deepspeed_worker.py")
pytestmark = pytest.mark.slow

# what the stand-ins' calls show ran fused in every case (the projections' GPU paths are counted apart)
FUSED = {"linear_cross_entropy", "add_rms_norm_zero_centered", "gated_rms_norm", "causal_conv1d", "gated_delta_rule"}


def test_deepspeed_zero_world_size_2_trains_as_unsharded_unpatched(tmp_path):
    out = tmp_path / "result.json"
    result = torchrun(WORKER, "--out", str(out), "--tests", str(TESTS), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    cases = json.loads(out.read_text())
    errors = {name: case["error"] for name, case in cases.items() if "error" in case}
    assert not errors, "\n\n".join(f"{name}:\n{error}" for name, error in errors.items())
    wrong = {}
    for name, case in cases.items():
        # fp32; two SGD steps; the eager chunked delta rule is fusepatch's own formulation of transformers' reference
        if not (case["loss_diff"] < 1e-5 and case["worst_update_rel_err"] < 2e-3 and FUSED <= set(case["fused"])):
            wrong[name] = case
    assert not wrong, json.dumps(wrong, indent=1)
