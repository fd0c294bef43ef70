"""FSDP2 (fully_shard) on CPU (gloo): the patched, sharded model trains like the unpatched, unsharded one, through
accelerate's FSDP2 plugin and the Trainer's ``fsdp`` arguments at world sizes 2 and 4 (each world size one launch of
many cases), with ``fully_shard`` called directly in either order with patching, with and without activation
checkpointing; LoRA over FP8 bases kept sharded (each rank its rows in FP8, gathered in FP8) with and without
``drop_frozen_weights``, and DoRA's bases quantized at each call, bit for bit the unsharded model patched alike;
and what each rank holds is what ``benchmarks/studies/static_memory.py`` computes."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
from helpers import FP8_FSDP2_WORKER, torchrun

CASES_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "fsdp2_cases.py")
CHECKS = os.path.join(os.path.dirname(CASES_WORKER), "fp8_checks.py")


def fp8_checks():
    """``distributed/fp8_checks.py`` (loaded by its path: the GPU test shares it)."""
    spec = importlib.util.spec_from_file_location("fp8_checks", CHECKS)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


pytestmark = pytest.mark.slow

ENGINE_CASES = [
    f"{engine}-{mode}-{precision}"
    for engine in ("accelerate", "trainer")
    for mode in ("full", "lora")
    for precision in ("fp32", "bf16")
]
# fully_shard called directly (fsdp2_worker.py), each order with patching (patching first is the accelerate cases'
# order), and activation checkpointing, with the fused decoder paths on (they include the plain ones' wiring)
DIRECT_CASES = ["fully_shard-shard_first", "fully_shard-checkpointing_projections"]
# every engine x mode x precision case runs at world size 2; at 4 (the extended tier) the fewest that still cover
# each engine, mode and precision there; the memory check at both
FOUR = ["accelerate-lora-bf16", "trainer-full-fp32"]
# LoRA over FP8 bases kept sharded by FSDP2 (fully_shard per layer), with their values and dropped; DoRA's bases,
# which the adapters read, quantized at each call
FP8_CASES = ["fp8-lora-keep", "fp8-lora-drop", "fp8-dora-keep"]
LAUNCHES = {
    2: [*ENGINE_CASES, "memory-lora-fp8", *FP8_CASES, *DIRECT_CASES],
    4: [*FOUR, "memory-lora-fp8"],
}
# Floors under the measured bounds: what one rounding of the loss and of an update can move in each precision
FLOORS = {"fp32": {"loss": 1e-6, "params": 1e-5}, "bf16": {"loss": 1e-4, "params": 1e-2}}


def engine_case_problems(name: str, case: dict) -> list[str]:
    """The patched, sharded run against the unpatched, unsharded one, bounded by what this model's own runs
    measure: patching alone (patched, unsharded) plus three times what sharding alone costs (unpatched, sharded:
    the reduction order of the sharded gradients differs; the cases measured here needed at most 1.3 times), plus a
    floor. Parameters are compared by their updates
    (AdamW's first steps amplify a gradient's rounding where it is near zero, so bf16's bound is wide)."""
    problems = []
    precision = name.rsplit("-", 1)[1]
    for label in ("sharded_unpatched", "unsharded_patched", "sharded_patched"):
        if case[label]["steps"] != 2:
            problems.append(f"{name}: {label} ran {case[label]['steps']} steps, not 2")
    for what in ("loss", "params"):
        bound = case["unsharded_patched"][what] + 3 * case["sharded_unpatched"][what] + FLOORS[precision][what]
        if not case["sharded_patched"][what] <= bound:
            problems.append(f"{name}: sharded patched {what} error {case['sharded_patched'][what]:.3g} > {bound:.3g}")
    dtype = "bfloat16" if precision == "bf16" else "float32"
    if f"gated_delta_rule:{dtype}" not in case["patch_use"]["ops"] or case["patch_use"]["transformers_calls"]:
        problems.append(f"{name}: the patched layers did not run their own forwards: {case['patch_use']}")
    return problems


def direct_problems(name: str, data: dict) -> list[str]:
    """``fully_shard`` called directly: one fp32 step's loss and gradients against the unsharded, unpatched model
    (the eager chunked delta rule is fusepatch's own formulation of transformers' reference: 2e-3)."""
    checks = {
        "patched": data["patched_modules"] == 26 and data["gdn_forward_patched"],
        "loss": data["loss_diff"] < 1e-5,
        "gradients": data["worst_grad_rel_err"] < 2e-3,
        # 4 decoder layers ran their fused forward (checkpointed: and its recompute)
        "fused decoder": data["add_norm_calls"] >= (8 if "checkpointing" in name else 4),
        # the GPU-only projection paths ran under FSDP2 (and its recompute)
        "projections": "projections" not in name
        or (data["shared_input_calls"] > 0 and data["residual_gemm_calls"] > 0),
    }
    return [f"{name}: {check} failed: {data}" for check, ok in checks.items() if not ok]


def memory_problems(world: int, case: dict) -> list[str]:
    """Each rank holds what ``static_memory.per_rank`` computes for rank 0 (the chunks are even here), part by
    part: the FP8 copies sharded like the weights (each rank its rows), with the bf16 rows of the dropped bases
    gone (``fp8+drop``), less than a whole copy on every rank."""
    problems = []
    for precision in ("fp8", "fp8+drop"):
        computed, whole = case["computed"][precision], case["computed"]["whole"]
        for rank, held in enumerate(case["held"][precision]):
            for part in ("parameters", "gradients", "optimizer_states", "projections_fp8"):
                if held[part] != computed[part]:
                    problems.append(
                        f"memory {precision} rank {rank}/{world}: {part} {held[part]} bytes, computed {computed[part]}"
                    )
        if not computed["projections_fp8"] < whole["projections_fp8"]:
            problems.append(f"memory {precision}: the sharded copies are no less than whole ones: {case['computed']}")
    return problems


@pytest.mark.parametrize(
    # world size 4: four processes on CI's two cores took a minute of the run's wall time (the extended tier)
    "world",
    [pytest.param(world, marks=pytest.mark.extended) if world > 2 else world for world in sorted(LAUNCHES)],
)
def test_fsdp2_engines_as_users_run_them_match_unsharded_unpatched(tmp_path, world):
    """One launch of ``world`` CPU processes runs every case (accelerate's FSDP2 plugin and the Trainer's fsdp
    arguments; full and LoRA; fp32 and bf16 autocast; two optimizer steps, clipped) and the per-rank memory check."""
    out = tmp_path / "result.json"
    started = time.perf_counter()
    result = torchrun(CASES_WORKER, "--cases", ",".join(LAUNCHES[world]), "--out", str(out), processes=world)
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["world"] == world and set(data["cases"]) == set(LAUNCHES[world])
    problems = []
    for name, case in data["cases"].items():
        if name.startswith("memory"):
            problems += memory_problems(world, case)
        elif name in FP8_CASES:
            problems += fp8_checks().fp8_problems(name, world, case)
        elif name in DIRECT_CASES:
            problems += direct_problems(name, case)
        else:
            problems += engine_case_problems(name, case)
    assert not problems, "\n".join(problems) + f"\n(launch {seconds:.1f} s; per case {data['seconds']})"


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


def test_fsdp2_names_fusepatch_reads_are_in_this_torch():
    """backends/fsdp2.py's table and the FSDPParam methods it calls are in the installed torch (a torch that lacks
    them keeps no FP8 copy sharded, said once as drift); and the table was checked on a torch of this release."""
    from fusepatch.backends import fsdp2

    assert fsdp2.NAMES.missing() == [] and not fsdp2._torch_lacks()
    assert fsdp2.NAMES.is_checked(), (fsdp2.NAMES.installed(), fsdp2.NAMES.checked)
