"""The self-test refuses wrong kernels: the fault matrix (tests/faults.py) on stand-ins made of each op's reference,
in fp32 and bf16 on the CPU; tests/gpu/test_gpu_selftest_faults.py runs the same faults around the real kernels.

The bounds are a multiple of the reference's own error in the dtype plus a floor (``selftest.bounds``): a kernel 2%
off, a flipped sign in 1% of a gradient, an error at document starts or an argument dropped is refused; the
reference itself (the stand-in with no fault) passes."""

from __future__ import annotations

import pytest
import torch
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


def test_the_gate_and_beta_gradients_have_their_own_floors_per_case():
    """bf16: the gate's and beta's gradients at twice the op's floor in the random cases (the unnamed one included),
    the gate's three times in one-chunk, every no-state quantity twice, each statistic's multiplier applied; fp16 and the
    other quantities keep the op's floors, the decay parameters' their own."""
    op = OPS["gated_delta_rule"]
    names = ["grad[3]", "grad[3]:scale", "grad[3]:tile", "no-state/grad[4]", "one-chunk/grad[3]", "one-chunk/grad[4]"]
    names += ["erase/grad[4]", "erase/grad[3]", "state-only/output", "no-state/output", "output", "grad[5]"]
    names += ["decay/grad[5]:scale", "no-state/grad[2]", "state-only/grad[2]"]
    got = selftest.bounds(op, "bfloat16", dict.fromkeys(names, 0.0))
    assert got == pytest.approx(
        {
            "grad[3]": 0.016,
            "grad[3]:scale": 0.008,
            "grad[3]:tile": 0.032,
            "no-state/grad[4]": 0.016,
            "one-chunk/grad[3]": 0.024,
            "one-chunk/grad[4]": 0.016,
            "erase/grad[4]": 0.008,
            "erase/grad[3]": 0.016,
            "state-only/output": 0.008,
            "no-state/output": 0.016,
            "no-state/grad[2]": 0.016,
            "state-only/grad[2]": 0.008,
            "output": 0.008,
            "grad[5]": 0.05,
            "decay/grad[5]:scale": 0.004,
        }
    )
    assert selftest.bounds(op, "float16", {"grad[3]": 0.0, "one-chunk/grad[3]": 0.0}) == pytest.approx(
        {"grad[3]": 0.002, "one-chunk/grad[3]": 0.002}
    )


def test_a_factor_shows_along_the_reference_through_noise_that_hides_it():
    """``scale_error``: a 2% factor is 0.02 along the reference, where rounding-like noise four times its size has
    almost no component (``relative_error`` cannot tell the two apart)."""
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(4096, generator=generator)
    noise = 0.08 * torch.randn(4096, generator=generator)
    assert selftest.scale_error(reference * 1.02, reference) == pytest.approx(0.02, rel=1e-6)
    assert selftest.scale_error(reference + noise, reference) < 0.005
    assert selftest.error(reference + noise, reference, []) > 4 * selftest.error(reference * 1.02, reference, [])


def test_a_zeroed_tile_shows_whatever_the_tensor_size():
    """``tile_error``: one zeroed 64 x 64 block of a [4096, 256] tensor is ~1, where its relative error is 6%."""
    reference = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1))
    spoiled = reference.clone()
    spoiled[1024:1088, 64:128] = 0
    assert selftest.tile_error(spoiled, reference) == pytest.approx(1.0, abs=0.1)
    assert selftest.error(spoiled, reference, []) < 0.07
    assert selftest.tile_error(reference, reference) == 0.0


def test_each_case_is_compared_and_named():
    """The delta rule's self-test runs every declared case; each quantity carries its case's name, and a case
    that switches the output's gradient off still compares the final state's path."""
    op = OPS["gated_delta_rule"]
    verdict, errors = selftest.compare(op, op.reference, "cpu", "float32", packed=True, seed=0)
    assert verdict.ok
    for case in op.selftest.cases:
        prefix = f"{case.name}/" if case.name else ""
        if case.only:  # a case for some quantities alone compares those
            assert {n.partition("/")[2].partition(":")[0] for n in errors if n.startswith(prefix)} == set(case.only)
            continue
        assert f"{prefix}output" in errors and f"{prefix}grad[2]:scale" in errors and f"{prefix}grad[0]:tile" in errors
    assert "no-state/output[1]" not in errors and "state-only/output[1]" in errors


def test_a_fault_confined_to_one_case_is_refused_by_that_case():
    """A stand-in that is wrong only without a start state (training's own call) passes the cached call and is
    refused by the ``no-state`` case, which names it."""
    reference = OPS["gated_delta_rule"].reference

    def wrong_without_state(*args, initial_state=None, **kwargs):
        out = reference(*args, initial_state=initial_state, **kwargs)
        return out if initial_state is not None else out * 1.02

    verdict, _ = selftest.compare(OPS["gated_delta_rule"], wrong_without_state, "cpu", "float32", packed=False, seed=0)
    assert not verdict.ok and "no-state/" in verdict.reason


def test_every_quantity_past_its_bound_is_refused_not_only_the_worst():
    """A quantity at a bound of 0 with no error, or with a NaN error, does not hide another one past its bound; a
    NaN is refused on its own; a statistic without a bound is judged by its relative error alone."""
    op = OPS["swiglu"]
    assert not selftest.judge(op, {"a": 0.0, "b": 5.0}, {"a": 0.0, "b": 1.0}, "cpu", "float32").ok
    assert not selftest.judge(op, {"a": float("nan"), "b": 0.5}, {"a": 1.0, "b": 1.0}, "cpu", "float32").ok
    assert selftest.judge(op, {"a": 0.5, "a:tile": 3.0}, {"a": 1.0}, "cpu", "float32").ok
    verdict = selftest.judge(op, {"a": 0.5, "b": 2.0, "c": 3.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, "cpu", "float32")
    assert not verdict.ok and "c differs" in verdict.reason


def test_a_zeroed_tile_of_a_narrow_tensor_shows_in_full():
    """A tensor narrower than a tile (a gate's gradient, one column a head): a zeroed block of 64 rows is ~1 too."""
    reference = torch.randn(4096, 4, generator=torch.Generator().manual_seed(2))
    spoiled = reference.clone()
    spoiled[1024:1088] = 0
    assert selftest.tile_error(spoiled, reference) == pytest.approx(1.0, abs=0.25)
