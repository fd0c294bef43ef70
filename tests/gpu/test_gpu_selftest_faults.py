"""The self-test's bounds around the real kernels on the GPU: every candidate that loads passes them on fresh
inputs (bf16, packed and not), and each fault of tests/faults.py injected around it is refused.

Every measured error and bound is printed (``-s``) and recorded, so the floors in the ops' ``SelfTest`` are set
from these numbers (docs/kernels.md)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import record  # noqa: E402
from faults import PACKED_OPS, cases, faulty  # noqa: E402

pytestmark = pytest.mark.gpu
OPS_CHECKED = (
    "gated_delta_rule",
    "causal_conv1d",
    "gated_rms_norm",
    "rms_norm",
    "rms_norm_zero_centered",
    "add_rms_norm",
    "add_rms_norm_zero_centered",
    "swiglu",
    "rotary",
    "attention_gate",
    "varlen_attention",
    "linear_cross_entropy",
    "moe_experts",
    "fp8_linear",
)
# the layers' own head sizes the self-test runs at in training (SelfTest.dims_from): Qwen3.5-27B's and -2B's
LAYER_DIMS = {
    "gated_delta_rule": ({"hk": 16, "hv": 48, "dk": 128, "dv": 128}, {"hk": 16, "hv": 16, "dk": 128, "dv": 128})
}


def _loaded(op_name: str):
    """(candidate name, kernel) of every non-eager candidate of ``op_name`` whose checks pass here."""
    from fusepatch.base.env import capture
    from fusepatch.base.requirements import Inputs
    from fusepatch.engine.resolve import static_verdict
    from fusepatch.ops import OPS

    found = []
    for candidate in OPS[op_name].candidates:
        verdict, _ = static_verdict(candidate, capture())
        if verdict.ok and candidate.inputs.check(Inputs("cuda", "bfloat16")).ok:
            try:
                found.append((candidate.name, candidate.load()))
            except Exception as exc:  # noqa: BLE001 - a candidate that does not load is not this test's subject
                print(f"{op_name}/{candidate.name}: not loaded ({type(exc).__name__}: {exc})")
    return found


@pytest.mark.parametrize("op_name", OPS_CHECKED)
def test_real_kernels_pass_their_bounds(op_name):
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    op = OPS[op_name]
    kernels = _loaded(op_name)
    if not kernels:
        pytest.skip(f"no {op_name} kernel loads here")
    failures = []
    for name, fn in kernels:
        for packed in (False, True) if op_name in (*PACKED_OPS, "varlen_attention") else (False,):
            for dims in (None, *LAYER_DIMS.get(op_name, ())):
                for seed in range(3):
                    verdict, errors = selftest.compare(
                        op, fn, "cuda", "bfloat16", packed=packed, dims=dims, seed=1000 + seed
                    )
                    label = f"{op_name}/{name}/packed={packed}/dims={dims}/seed={seed}"
                    print(f"{label}: {verdict.ok} {errors}")
                    record(label, {"ok": verdict.ok, "errors": errors})
                    if not verdict.ok:
                        failures.append(f"{name} packed={packed} dims={dims}: {verdict.reason}")
    assert not failures, failures


@pytest.mark.parametrize("op_name,fault", cases())
def test_faults_around_real_kernels_are_refused(op_name, fault):
    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    kernels = _loaded(op_name)
    if not kernels:
        pytest.skip(f"no {op_name} kernel loads here")
    name, fn = kernels[0]
    packed = op_name in PACKED_OPS
    verdict, errors = selftest.compare(OPS[op_name], faulty(fn, op_name, fault), "cuda", "bfloat16", packed=packed)
    print(f"{op_name}/{name} with {fault}: {verdict.ok} {errors}")
    assert not verdict.ok, f"{op_name}/{name} with {fault} passed: {errors}"
