"""A fault inside one stage of a composite kernel is refused by the self-test.

The fault tests of test_gpu_selftest_faults.py wrap a whole kernel. A composite candidate (the delta rule's eleven
fla and fusepatch stages, causal-conv1d's forward and backward, the cross-entropy's chunk kernels, FP8's quantize
and GEMM steps) can be wrong in one stage only, its error diluted by the other stages' terms. Here each stage the
candidate calls is replaced, under its own name, by a wrapper that calls it and then spoils one of its outputs:
x1.02, x0.98, one NaN, a zeroed 64 x 64 tile. The self-test (``selftest.compare``, every case of the op) must
refuse each. A sweep of smaller and larger factors records, per stage, the smallest factor refused, with the
errors and bounds (``FUSEPATCH_STAGE_RECORD``: a JSON-lines file per worker), for docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.gpu

FAULTS = ("x1.02", "x0.98", "nan", "zero_tile")
SWEEP = ("x1.01",)  # recorded, not asserted: whether a stage's fault is refused at half the factor
GDN = "fla.ops.gated_delta_rule.chunk"


@dataclass(frozen=True)
class Stage:
    """A function a candidate calls, found by its module and name at call time.

    ``writes``: the arguments (positions or keyword names) it writes its results into, in place; its return value
    counts too where ``returns``; ``loader``: ``name`` returns the stage function (``dqkwg.load``), which is then
    wrapped."""

    module: str
    name: str
    writes: tuple[int | str, ...] = ()
    returns: bool = False
    loader: bool = False

    @property
    def label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


FLA_DELTA_RULE = tuple(
    Stage(GDN, name)
    for name in (
        *("gdn_gate_chunk_cumsum", "chunk_local_cumsum", "fused_beta_sigmoid", "l2norm_fwd"),
        *("chunk_gated_delta_rule_fwd_intra", "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"),
        *("chunk_bwd_dv_local", "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dqkwg", "prepare_wy_repr_bwd"),
        *("gdn_gate_bwd", "fused_beta_sigmoid_bwd", "l2norm_bwd"),
    )
)
# fusepatch's delta rule calls fla's stages one by one, its TileLang dqkwg through ops/gated_delta_rule/dqkwg.py,
# and its own input kernels
SAVED_STATES = (
    *(stage for stage in FLA_DELTA_RULE if stage.name != "chunk_bwd_dqkwg"),
    Stage("fusepatch.ops.gated_delta_rule.dqkwg", "load", loader=True),
    Stage("fusepatch.kernels.delta_rule_inputs", "delta_rule_inputs"),
    Stage("fusepatch.kernels.delta_rule_inputs", "delta_rule_inputs_bwd"),
    Stage("fusepatch.kernels.l2norm", "l2norm_bwd_grouped"),
    Stage("fusepatch.kernels.heads", "repeat_heads"),
)
FP8 = (
    Stage("fusepatch.kernels.fp8", "quantize_rows"),
    Stage("fusepatch.kernels.fp8", "quantize_columns"),
    Stage("fusepatch.kernels.fp8", "transpose"),
    Stage("torch", "_scaled_mm"),
)
# (op, candidate) -> the stages it may call; a stage a call does not reach is recorded as such
COMPOSITES: dict[tuple[str, str], tuple[Stage, ...]] = {
    ("gated_delta_rule", "fla-saved-states-grouped"): SAVED_STATES,
    ("gated_delta_rule", "fla-saved-states"): SAVED_STATES,
    ("gated_delta_rule", "fla"): FLA_DELTA_RULE,
    ("gated_delta_rule", "fla-gate-outside"): FLA_DELTA_RULE,
    ("causal_conv1d", "causal-conv1d"): (
        Stage("causal_conv1d_cuda", "causal_conv1d_fwd", writes=(5,)),
        Stage("causal_conv1d_cuda", "causal_conv1d_bwd", writes=(7, 8, 9)),
    ),
    ("causal_conv1d", "fla-conv"): (
        Stage("fla.modules.causal_conv1d.ops", "causal_conv1d_fwd"),
        Stage("fla.modules.causal_conv1d.ops", "causal_conv1d_bwd"),
    ),
    ("linear_cross_entropy", "fla"): (
        Stage("fla.modules.fused_cross_entropy.ops", "cross_entropy_fwd"),
        # the gradient is written into the logits (inplace_backward=True)
        Stage("fla.modules.fused_cross_entropy.ops", "cross_entropy_bwd", writes=("logits",)),
    ),
    # the loss returned, the gradient written into the logits
    ("linear_cross_entropy", "triton"): (Stage("fusepatch.kernels.cross_entropy", "cross_entropy_", (0,), True),),
    ("fp8_linear", "scaled-mm"): FP8,
}
PACKED = ("gated_delta_rule", "causal_conv1d")
# the Qwen3.5-27B layer's head sizes: the self-test runs at the layer's own (``SelfTest.dims_from``)
DIMS_27B = {"gated_delta_rule": {"hk": 16, "hv": 48, "dk": 128, "dv": 128}}


def _spoil(tensor: torch.Tensor, fault: str, in_place: bool) -> torch.Tensor:
    """``tensor`` with ``fault``: a factor, one NaN, or a zeroed tile of 64 rows x 64 columns (rows: the tensor
    flattened over its last dimension) in its middle."""
    if fault.startswith("x"):
        changed = tensor.float() * float(fault[1:])
    else:
        changed = tensor.float().clone()
        flat = changed.reshape(-1, changed.shape[-1]) if changed.ndim else changed.reshape(1, 1)
        middle = flat.shape[0] // 2 // 64 * 64
        if fault == "nan":
            flat[flat.shape[0] // 2, flat.shape[1] // 2] = float("nan")
        else:
            flat[middle : middle + 64, :64] = 0
    changed = changed.to(tensor.dtype)
    if in_place:
        tensor.copy_(changed)
        return tensor
    return changed


def _spoilable(value, fault: str) -> bool:
    """A float tensor with elements; an FP8 tensor takes no factor (x1.02 rounds back to the same FP8 value)."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0):
        return False
    return not (fault.startswith("x") and value.element_size() == 1)


class Wrapper:
    """Calls the stage, then spoils its output ``index`` with ``fault``: the outputs are the tensors it returns,
    then the arguments it writes (``Stage.writes``: positions or keyword names). Counts calls, so a stage that a
    call never reaches is told from one whose fault passed."""

    def __init__(self, stage: Stage, fault: str | None, index: int):
        self.stage, self.fault, self.index = stage, fault, index
        self.calls = 0
        self.outputs = 0
        self.applied = False  # the fault took (an FP8 output takes no factor; a None output nothing)

    def _written(self, args, kwargs) -> list:
        return [kwargs.get(w) if isinstance(w, str) else args[w] if w < len(args) else None for w in self.stage.writes]

    def wrap(self, fn):
        @functools.wraps(fn)
        def stage(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.calls += 1
            outs = out if isinstance(out, tuple) else (out,)
            written = self._written(args, kwargs)
            returned = () if self.stage.writes and not self.stage.returns else outs
            self.outputs = len(returned) + len(written)
            if self.fault is None or self.index >= self.outputs:
                return out
            if self.index >= len(returned):
                target = written[self.index - len(returned)]
                if _spoilable(target, self.fault):
                    _spoil(target, self.fault, in_place=True)
                    self.applied = True
                return out
            if _spoilable(outs[self.index], self.fault):
                outs = (*outs[: self.index], _spoil(outs[self.index], self.fault, False), *outs[self.index + 1 :])
                self.applied = True
            return outs if isinstance(out, tuple) else outs[0]

        return stage


@contextlib.contextmanager
def injected(stage: Stage, fault: str | None, index: int = 0):
    module = importlib.import_module(stage.module)
    original = getattr(module, stage.name)
    wrapper = Wrapper(stage, fault, index)
    if stage.loader:
        replacement = functools.wraps(original)(lambda *a, **k: wrapper.wrap(original(*a, **k)))
    else:
        replacement = wrapper.wrap(original)
    setattr(module, stage.name, replacement)
    try:
        yield wrapper
    finally:
        setattr(module, stage.name, original)


def _candidate(op_name: str, name: str):
    from fusepatch.base.env import capture
    from fusepatch.base.requirements import Inputs
    from fusepatch.engine.resolve import static_verdict
    from fusepatch.ops import OPS

    candidate = next(c for c in OPS[op_name].candidates if c.name == name)
    verdict, _ = static_verdict(candidate, capture())
    if not (verdict.ok and candidate.inputs.check(Inputs("cuda", "bfloat16")).ok):
        if os.environ.get("FUSEPATCH_GPU_REQUIRE") == "1" and (op_name, name) != ("linear_cross_entropy", "triton"):
            pytest.fail(f"{op_name}/{name}: {verdict.reason}")
        pytest.skip(f"{op_name}/{name}: {verdict.reason}")
    return candidate


def _record(row: dict) -> None:
    folder = os.environ.get("FUSEPATCH_GPU_REPORT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"stage-faults-{worker}.jsonl"), "a") as file:
            file.write(json.dumps(row) + "\n")


def _same(errors: dict[str, float], clean: dict[str, float]) -> bool:
    return errors.keys() == clean.keys() and all(abs(errors[q] - clean[q]) <= 0.05 * clean[q] + 1e-6 for q in clean)


def _measured(op_name, candidate, stage, fault, index, packed, dims, seed):
    """(verdict, errors, bounds, wrapper) of the self-test of ``candidate`` with ``stage`` spoiled by ``fault``."""
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op = OPS[op_name]
    with injected(stage, fault, index) as wrapper:
        fn = candidate.load()  # loaded with the wrapper in place: a stage bound at load time is wrapped too
        found = selftest.measure(op, fn, "cuda", "bfloat16", packed=packed, dims=dims, seed=seed)
    if not isinstance(found, tuple):  # wrong shapes
        return found, {}, {}, wrapper
    errors, limits = found
    return selftest.judge(op, errors, limits, "cuda", "bfloat16"), errors, limits, wrapper


# Faults the H200 runs saw pass (benchmarks/records/2026-12-05-stage-faults-h200.jsonl, x1.02 / x0.98 on one
# output): open work, kept visible; a stage that comes to be refused shows as XPASS.
SEEN_PASSING = {
    ("fla", "chunk_gated_delta_rule_fwd_intra"): "w x1.02 in the packed no-state case",
    ("fla", "recompute_w_u_fwd"): "w x1.02 in the packed no-state case",
    ("fla", "prepare_wy_repr_bwd"): "dk and dg x1.02",
    ("fla", "gdn_gate_bwd"): "dA_log and ddt_bias x1.02 (under the former 0.25 floor)",
    ("fla-gate-outside", "chunk_gated_delta_rule_fwd_intra"): "w x1.02 in the packed no-state case",
    ("fla-gate-outside", "recompute_w_u_fwd"): "w x1.02 in the packed no-state case",
    ("fla-saved-states", "chunk_gated_delta_rule_fwd_intra"): "w x1.02 in the packed no-state case",
    ("fla-saved-states", "prepare_wy_repr_bwd"): "dk and dg x1.02",
    ("fla-saved-states", "gdn_gate_bwd"): "dA_log and ddt_bias x1.02 (under the former 0.25 floor)",
    ("fla-saved-states-grouped", "chunk_gated_delta_rule_fwd_intra"): "w x1.02 in the packed no-state case",
}


def _params() -> list:
    """Every (op, candidate, stage), grouped for ``--dist loadgroup``: a worker that keeps one candidate's stages
    compiles and autotunes its kernels once (the delta rule's in two halves, the longest)."""
    params = []
    for (op, name), stages in COMPOSITES.items():
        for number, stage in enumerate(stages):
            group = f"{op}/{name}" + (f"/{number % 2}" if op == "gated_delta_rule" else "")
            marks = [pytest.mark.xdist_group(group)]
            if (name, stage.name) in SEEN_PASSING:
                marks.append(pytest.mark.xfail(reason=f"seen passing: {SEEN_PASSING[name, stage.name]}", strict=False))
            params.append(pytest.param(op, name, stage, marks=marks, id=f"{name}-{stage.label}"))
    return params


@pytest.mark.parametrize("op_name,name,stage", _params())
def test_a_fault_inside_one_stage_is_refused(op_name, name, stage):
    """Each fault of ``FAULTS`` in each output the stage gives is refused, packed and not (and, for the default
    delta rule, at the 27B layer's head sizes). An output nothing reads (an unused final state, a bias gradient
    without a bias) changes no error by a NaN: recorded as unread, not a pass."""
    from fusepatch.engine.selftest import worst

    candidate = _candidate(op_name, name)
    configurations = [(False, None)]
    if op_name in PACKED:
        configurations.append((True, None))
    if op_name in DIMS_27B and name == "fla-saved-states-grouped":
        configurations.append((False, DIMS_27B[op_name]))
    base = {"op": op_name, "candidate": name, "stage": stage.label}
    clean = {}
    for packed, dims in configurations:
        verdict, errors, limits, probe = _measured(op_name, candidate, stage, None, 0, packed, dims, seed=11)
        _record({**base, "fault": None, "packed": packed, "dims": dims, "refused": not verdict.ok,
                 "calls": probe.calls, "outputs": probe.outputs, "errors": errors, "bounds": limits})  # fmt: skip
        assert verdict.ok, f"{op_name}/{name} fails its self-test with no fault: {verdict.reason}"
        clean[packed, json.dumps(dims)] = (errors, probe)
    if clean[False, "null"][1].calls == 0:
        pytest.skip(f"{stage.label} is not called by {op_name}/{name} on this machine")
    passed = []
    for packed, dims in configurations:
        clean_errors, probe = clean[packed, json.dumps(dims)]
        sweep = SWEEP if not packed and name == "fla-saved-states-grouped" else ()  # the default candidate's
        faults = ("nan", "x1.02", "zero_tile") if dims else ("nan", *FAULTS[:2], "zero_tile", *sweep)
        for index in range(probe.outputs):
            for fault in faults:
                verdict, errors, limits, wrapper = _measured(op_name, candidate, stage, fault, index, packed, dims, 11)
                if not wrapper.applied:
                    continue
                # a NaN that no error sees (beyond the run-to-run noise of atomic sums): nothing reads this output
                unread = fault == "nan" and verdict.ok and _same(errors, clean_errors)
                found = worst(errors, limits) if errors else "shape"
                _record({**base, "output": index, "fault": fault, "packed": packed, "dims": dims,
                         "refused": not verdict.ok, "unread": unread, "worst": found, "error": errors.get(found),
                         "bound": limits.get(found), "errors": errors, "bounds": limits})  # fmt: skip
                if unread:  # nothing reads this output: no other fault of it can show either
                    break
                if verdict.ok and fault in FAULTS:
                    passed.append(f"output {index} {fault} packed={packed} dims={dims}: {found} {errors[found]:.2e}")
    assert not passed, f"{op_name}/{name}: faults in {stage.label} passed the self-test: {passed}"
