"""FSDP2 (fully_shard) with world size 2 on CPU (gloo): the patched, sharded model trains like the unpatched,
unsharded one, whichever order patching and sharding happen in, with and without activation checkpointing."""

from __future__ import annotations

import json
import os

import pytest
from helpers import FP8_FSDP2_WORKER, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "fsdp2_worker.py")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "extra",
    # each order, and checkpointing, with the fused decoder paths on (they include the plain ones' wiring)
    [
        [],
        ["--order", "shard-then-patch", "--standin-add-norm"],
        ["--checkpointing", "--standin-add-norm", "--fused-projections"],
    ],
    ids=["patch-first", "shard-first-fused-decoder", "checkpointing-fused-decoder-projections"],
)
def test_fsdp2_world_size_2_matches_unsharded_unpatched(tmp_path, extra):
    out = tmp_path / "result.json"
    result = torchrun(WORKER, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["world"] == 2 and data["patched_modules"] == 26 and data["gdn_forward_patched"]
    assert data["loss_diff"] < 1e-5
    # fp32; the eager chunked delta rule is fusepatch's own formulation of transformers' reference
    assert data["worst_grad_rel_err"] < 2e-3, data
    if "--standin-add-norm" in extra:  # 4 decoder layers ran their fused forward (checkpointed: and its recompute)
        assert data["add_norm_calls"] >= (8 if "--checkpointing" in extra else 4), data
    if "--fused-projections" in extra:  # the GPU-only projection paths ran under FSDP2 (and its recompute)
        assert data["shared_input_calls"] > 0 and data["residual_gemm_calls"] > 0, data


MIXED_PRECISION_WORKER = """
import json, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import fusepatch
from fusepatch.tools.tiny import tiny_model

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))
model = tiny_model("qwen3_5_text", seed=0)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
# as accelerate (1.15) shards it: the final norm and lm_head as one unit, gathered when the norm runs
fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
fully_shard(model, mesh=mesh, mp_policy=policy)
report = fusepatch.apply(model)
ids = torch.randint(0, 512, (2, 24))
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
loss_dtypes = sorted({c.dtype for c in model._fusepatch.ops["linear_cross_entropy"].seen()})
json.dump({"report_dtype": report.dtype, "param_dtype": str(next(model.parameters()).dtype),
           "loss": float(loss), "loss_dtypes": loss_dtypes}, open(sys.argv[1], "w"))
dist.barrier()
time.sleep(0.2)  # gloo's worker threads release the last collectives' tensors (see examples/sft_ultrachat.py)
dist.destroy_process_group()
"""


def test_fsdp2_mixed_precision_is_checked_in_its_compute_dtype(tmp_path):
    """The Trainer's FSDP2 keeps sharded parameters in fp32 and computes in bf16 (MixedPrecisionPolicy): apply
    must choose and self-test kernels for bf16 (on the H200, fp32 self-tests at 27B shapes cost minutes)."""
    script, out = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(MIXED_PRECISION_WORKER)
    result = torchrun(str(script), str(out), processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["param_dtype"] == "torch.float32" and data["report_dtype"] == "bfloat16", data
    # the loss is chosen for bf16 too, though lm_head's weight is still a sharded fp32 DTensor when the forward
    # starts (the H200's FSDP2 run chose, and self-tested, an fp32 loss)
    assert data["loss_dtypes"] == ["bfloat16"], data
    assert 0 < data["loss"] < 20


def test_fsdp2_trains_fp8_projections_as_the_unsharded_model(tmp_path):
    """FSDP2 (world size 1, gloo) with ``precision="fp8"``: every projection runs its FP8 GEMMs on the gathered
    weights of a bf16 model, and loss and projection gradients equal the unsharded FP8 model's (same quantized
    operands, same FP8 GEMMs)."""
    script, out = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(FP8_FSDP2_WORKER)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = torchrun(str(script), str(out), tests, "cpu", processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["chosen"] == "cpu-standin" and data["calls"] > 0 and data["errors"], data
    assert abs(data["loss"] - data["ref_loss"]) < 1e-4 and max(data["errors"].values()) < 1e-3, data


FROZEN_FP8_WORKER = """
import copy, json, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[2])
import pytest
from helpers import cpu_candidates
import fusepatch
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear, quantize_weight
from fusepatch.ops.prepared import PreparedWeights
from fusepatch.tools.tiny import tiny_model

monkeypatch = pytest.MonkeyPatch()
cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
stale, calls = [], []
kept = PreparedWeights.handle


def checked(self, candidate, weight):  # each call's copy against the weight it computes for, bit for bit
    copy = kept(self, candidate, weight)
    fresh = quantize_weight(weight)
    calls.append(1)
    if not torch.equal(copy.q.view(torch.uint8), fresh.q.view(torch.uint8)):
        stale.append(1)
    return copy


monkeypatch.setattr(PreparedWeights, "handle", checked)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))
model = tiny_model("qwen3", seed=0, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
model.requires_grad_(False)  # a reference model (or LoRA's bases): every projection keeps an FP8 copy
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
fusepatch.apply(model, precision="fp8", verbose=False)
ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
per_step = []
for step in range(4):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    per_step.append(len(stale))
    for p in model.parameters():  # the shards rewritten between steps, as TRL's reference sync writes them
        p.data.mul_(0.9).add_(0.01)
full = {name: v.full_tensor() if hasattr(v, "full_tensor") else v for name, v in model.state_dict().items()}
reference = tiny_model("qwen3", seed=0, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
reference.load_state_dict(full)
reference.requires_grad_(False)
fusepatch.apply(reference, precision="fp8", verbose=False)
with torch.no_grad():
    got = model(input_ids=ids, use_cache=False).logits
    want = reference(input_ids=ids, use_cache=False).logits
result = {"stale": len(stale), "per_step": per_step, "calls": len(calls), "equal": bool(torch.equal(got, want))}
json.dump(result, open(sys.argv[1], "w"))
dist.barrier()
time.sleep(0.2)
dist.destroy_process_group()
"""


def test_fsdp2_rewritten_frozen_weights_are_requantized(tmp_path):
    """FSDP2 (world size 1, gloo) gathers a frozen weight into the same unsharded parameter at each step, often at
    the same address, keeping its version: with the shards rewritten between steps (a reference model's sync),
    every FP8 call computes with the copy of the values it was given, and the last step equals an unsharded model
    quantized afresh, exactly."""
    script, out = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(FROZEN_FP8_WORKER)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = torchrun(str(script), str(out), tests, processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["calls"] == 6 * 28 and data["stale"] == 0 and data["equal"], data  # 5 sharded calls, 1 reference
