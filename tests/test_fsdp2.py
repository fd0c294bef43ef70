"""FSDP2 (fully_shard) with world size 2 on CPU (gloo): the patched, sharded model trains like the unpatched,
unsharded one, whichever order patching and sharding happen in, with and without activation checkpointing."""

from __future__ import annotations

import json
import os

import pytest
from helpers import torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "fsdp2_worker.py")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "extra",
    [[], ["--order", "shard-then-patch"], ["--checkpointing"]],
    ids=["patch-first", "shard-first", "checkpointing"],
)
def test_fsdp2_world_size_2_matches_unsharded_unpatched(tmp_path, extra):
    out = tmp_path / "result.json"
    result = torchrun(WORKER, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["world"] == 2 and data["patched_modules"] == 23 and data["gdn_forward_patched"]
    assert data["loss_diff"] < 1e-5
    # fp32; the eager chunked delta rule is fusepatch's own formulation of transformers' reference
    assert data["worst_grad_rel_err"] < 2e-3, data
