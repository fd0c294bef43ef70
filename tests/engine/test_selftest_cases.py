"""A self-test case's own settings (``Case``): a gradient along the output, a case's own floors, a case that compares
some quantities only. The delta rule's "erase" and "decay" cases rely on them to show a factor on one stage's
output (tests/stage_faults_interpreter.py, tests/gpu/test_gpu_stage_faults.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusepatch.base.op import Case, Op, SelfTest
from fusepatch.engine import selftest


def _inputs(device, dtype, generator, packed=False, dims=None):
    x = torch.randn(64, 32, generator=generator).to(dtype).requires_grad_(True)
    w = torch.randn(32, generator=generator).to(dtype).requires_grad_(True)
    return (x, w), {}


def _op(*cases: Case) -> Op:
    def reference(x, w):
        return x * w

    return Op("scaled", "x * w", reference, (), SelfTest(_inputs, {"float32": 1e-5}, cases=cases))


def _w_grad_off(x, w):
    """x * w with w's gradient 2% too large."""

    class Off(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, (grad * x).sum(0) * 1.02

    return Off.apply(x, w)


def test_a_gradient_along_the_output_is_the_output_itself():
    generator = torch.Generator().manual_seed(0)
    (x, w), _ = _inputs("cpu", torch.float64, generator)
    outs, grads, cotangents = selftest._forward_backward(lambda x, w: x * w, (x, w), {}, None, along=True)
    assert torch.equal(cotangents[0], outs[0].float())
    assert torch.allclose(grads[1], (x * x * w).sum(0).detach())  # the gradient of half the squared norm


def test_a_case_floor_replaces_the_looser_one_for_its_dtype_only():
    op = _op(Case("tight", floors={"float32": {"grad[1]": 1e-5}}))
    op = dataclasses.replace(op, selftest=dataclasses.replace(op.selftest, looser={"float32": {"grad[1]": 0.05}}))
    got = selftest.bounds(op, "float32", {"tight/grad[1]": 0.0, "tight/grad[1]:scale": 0.0, "grad[1]": 0.0})
    assert got["tight/grad[1]"] == pytest.approx(1e-5)
    assert got["tight/grad[1]:scale"] == pytest.approx(1e-5 * op.selftest.statistics["scale"])
    assert got["grad[1]"] == pytest.approx(0.05)  # the plain call keeps the op's looser floor
    assert selftest.bounds(op, "bfloat16", {"tight/grad[1]": 0.0})["tight/grad[1]"] == pytest.approx(1e-2)


def test_a_case_compares_only_its_quantities():
    op = _op(Case(), Case("w", only=("grad[1]",)))
    errors, limits = selftest.measure(op, op.reference, "cpu", "float32", packed=False, seed=0)
    assert {name for name in errors if name.startswith("w/")} == {"w/grad[1]", "w/grad[1]:tile", "w/grad[1]:scale"}
    assert errors.keys() == limits.keys() and "output" in errors


def test_a_factor_on_a_summed_gradient_is_refused_by_a_case_with_its_own_floor():
    """w's gradient off by 2%, under a floor of 0.05 (a noisy sum's): passed; a case holding it to its own floor
    refuses it."""
    loose = _op(Case())
    loose = dataclasses.replace(
        loose, selftest=dataclasses.replace(loose.selftest, looser={"float32": {"grad[1]": 0.05}})
    )
    verdict, _ = selftest.compare(loose, _w_grad_off, "cpu", "float32", packed=False, seed=0)
    assert verdict.ok
    tight = dataclasses.replace(
        loose,
        selftest=dataclasses.replace(
            loose.selftest,
            cases=(Case(), Case("w", along=True, floors={"float32": {"grad[1]": 1e-3}}, only=("grad[1]",))),
        ),
    )
    verdict, errors = selftest.compare(tight, _w_grad_off, "cpu", "float32", packed=False, seed=0)
    assert not verdict.ok and "w/grad[1]" in verdict.reason, errors


def test_a_cases_inputs_do_not_depend_on_the_cases_before_it():
    """A case draws from a generator of its own: alone or after others, the same inputs and the same errors (a fault
    one case refuses when run alone is refused by the whole self-test, tests/stage_faults_interpreter.py)."""
    drawn = {}

    def inputs(device, dtype, generator, packed=False, dims=None, tag=""):
        pair = _inputs(device, dtype, generator)
        drawn.setdefault(tag, []).append(pair[0][0].detach().clone())
        return pair

    def op_of(*cases: Case) -> Op:
        op = _op(*cases)
        return dataclasses.replace(op, selftest=dataclasses.replace(op.selftest, make_inputs=inputs))

    late = Case("late", {"tag": "late"})
    together = selftest.measure(
        op_of(Case(), Case("first", {"tag": "first"}), late), _w_grad_off, "cpu", "float32", seed=5
    )
    alone = selftest.measure(op_of(late), _w_grad_off, "cpu", "float32", seed=5)
    assert torch.equal(drawn["late"][0], drawn["late"][1])
    assert {n: e for n, e in together[0].items() if n.startswith("late/")} == alone[0]
