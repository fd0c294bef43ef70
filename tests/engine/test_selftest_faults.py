"""The self-test refuses wrong kernels: the fault matrix (tests/faults.py) on stand-ins made of each op's reference,
in fp32 and bf16 on the CPU; tests/gpu/test_gpu_selftest_faults.py runs the same faults around the real kernels.

The bounds are a multiple of the reference's own error in the dtype plus a floor (``selftest.bounds``): a kernel 2%
off, a flipped sign in 1% of a gradient, an error at document starts or an argument dropped is refused; the
reference itself (the stand-in with no fault) passes."""

from __future__ import annotations

import pytest
from faults import cases, faulty

from fusepatch.engine import selftest
from fusepatch.ops import OPS

DTYPES = ["float32", "bfloat16"]


def _packed(op: str) -> bool:
    return op in ("gated_delta_rule", "causal_conv1d")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["gated_delta_rule", "causal_conv1d", "rms_norm", "swiglu", "linear_cross_entropy"])
def test_the_reference_passes(op, dtype):
    """The control: with no fault, a stand-in passes on fresh inputs (several seeds)."""
    for seed in range(3):
        verdict, errors = selftest.compare(OPS[op], OPS[op].reference, "cpu", dtype, packed=_packed(op), seed=seed)
        assert verdict.ok, (verdict.reason, errors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,fault", cases())
def test_fault_is_refused(op, fault, dtype):
    fn = faulty(OPS[op].reference, op, fault)
    for seed in range(2):
        verdict, errors = selftest.compare(OPS[op], fn, "cpu", dtype, packed=_packed(op), seed=seed)
        assert not verdict.ok, f"{op} with {fault} passed: {errors}"
        assert "self-test" in verdict.reason and verdict.fix


def test_bounds_follow_the_reference_error():
    """A bound is ratio x the reference's own error + the floor, per quantity (the decay gradients' own floors)."""
    op = OPS["gated_delta_rule"]
    got = selftest.bounds(op, "bfloat16", {"output": 0.003, "grad[5]": 0.003})
    assert got["output"] == pytest.approx(op.selftest.ratio * 0.003 + op.selftest.tolerance["bfloat16"])
    assert got["grad[5]"] == pytest.approx(op.selftest.ratio * 0.003 + op.selftest.looser["bfloat16"]["grad[5]"])
