"""MoE experts as grouped GEMMs: against the loop-over-experts reference, and inside every MoE family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import HOST_READS, MOE, loss_and_grads

import fusepatch
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.ops import OPS
from fusepatch.ops.moe_experts import moe_experts_grouped
from fusepatch.ops.moe_experts.reference import moe_experts_reference
from fusepatch.tools.tiny import tiny_model


def _inputs(tokens=53, experts=6, hidden=24, inter=16, top_k=2):
    h = torch.randn(tokens, hidden, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    index[3] = torch.tensor([experts, 1])  # a dropped slot (index == expert count) is skipped, as transformers does
    weights = torch.rand(tokens, top_k).softmax(-1).requires_grad_(True)
    gate_up = torch.randn(experts, 2 * inter, hidden, requires_grad=True)
    down = torch.randn(experts, hidden, inter, requires_grad=True)
    return h, index, weights, gate_up, down


def test_grouped_experts_match_the_loop():
    h, index, weights, gate_up, down = _inputs()
    leaves = (h, weights, gate_up, down)
    ref = moe_experts_reference(h, index, weights, gate_up, down)
    out = moe_experts_grouped(h, index, weights, gate_up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    cot = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, leaves, cot), torch.autograd.grad(ref, leaves, cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_an_expert_without_tokens():
    h, index, weights, gate_up, down = _inputs(experts=6)
    index[index == 4] = 5  # expert 4 gets nothing
    torch.testing.assert_close(
        moe_experts_grouped(h, index, weights, gate_up, down),
        moe_experts_reference(h, index, weights, gate_up, down),
        rtol=1e-5,
        atol=1e-5,
    )


def test_a_dropped_slot_reads_nothing_of_its_token():
    """A dropped slot runs in the last expert's group on a zero row, not its token's: a token whose every slot is
    dropped (all its experts on other ranks) with a non-finite row leaves the output, the last expert's gradient
    and every other gradient as the loop leaves them (masking the slot's output after the GEMMs, the NaN reached
    the last expert's weight gradient through the activation's backward)."""
    h, index, weights, gate_up, down = _inputs()
    index[5] = 6  # every slot of token 5 dropped
    with torch.no_grad():
        h[5] = float("nan")
    leaves = (h, weights, gate_up, down)
    ref = moe_experts_reference(h, index, weights, gate_up, down)
    out = moe_experts_grouped(h, index, weights, gate_up, down)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    cot = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, leaves, cot), torch.autograd.grad(ref, leaves, cot)):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_no_pass_masks_every_slot_row():
    """Dropped slots cost no elementwise pass over every slot's row (a ``where`` over the ``slots x hidden`` output
    and its backward: 2.7 ms a step at the MoE shape on the H200, the H200 run of 2026-12-01): their rows are zero from the gather
    on."""
    h, index, weights, gate_up, down = _inputs()
    slots = index.numel()
    with torch.profiler.profile(record_shapes=True) as prof:
        moe_experts_grouped(h, index, weights, gate_up, down).sum().backward()
    masks = [e.input_shapes for e in prof.events() if e.name == "aten::where" and [slots, h.shape[1]] in e.input_shapes]
    assert not masks, masks


def test_grouped_experts_read_nothing_back():
    """The CPU stand-in for tests/gpu's sync test of the MoE families: no op that waits for a GPU (a scalar read,
    ``nonzero``, or ``bincount``, whose CUDA kernel reads its input's maximum back), dropped slot included. torch's
    CPU ``grouped_mm`` reads each group's offset inside its own loop; its CUDA kernel takes them on the device, so
    reads under it are not counted."""
    h, index, weights, gate_up, down = _inputs()
    with torch.profiler.profile() as prof:
        moe_experts_grouped(h, index, weights, gate_up, down).sum().backward()

    def under_grouped_mm(event) -> bool:
        while event is not None:
            if event.name == "aten::_grouped_mm":
                return True
            event = event.cpu_parent
        return False

    reads = {*HOST_READS, "aten::item", "aten::bincount"}
    found = [e.name for e in prof.events() if e.name in reads and not under_grouped_mm(e)]
    assert not found, found


def test_grouped_experts_move_rows_by_permutation_only():
    """One sort a call (the slots by expert), no accumulating ``index_put_`` (autograd's backward of a gather by
    token, which sorts its indices again on CUDA) and no ``index_add_`` over the rows (atomics on CUDA): the rows
    move by gathers, forward and backward, and each token's slots are summed."""
    h, index, weights, gate_up, down = _inputs()
    with torch.profiler.profile(record_shapes=True) as prof:
        moe_experts_grouped(h, index, weights, gate_up, down).sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::sort") == 1, names.count("aten::sort")
    assert not [n for n in names if n.startswith(("aten::index_put", "aten::_index_put"))]
    # the one scatter left: the routing weights' gradient (one value a slot), through a permutation
    adds = [e for e in prof.events() if e.name == "aten::index_add_"]
    assert len(adds) == 1, [e.input_shapes for e in adds]


def test_grouped_experts_bf16_sum_each_token_in_fp32():
    """bf16: each token's slots are summed once in fp32 and rounded once; against the fp64 loop, the output within
    bf16 rounding. (Run to run equality matters on CUDA, where the accumulating scatter it replaces used atomics:
    tests/gpu/test_other_ops.py checks it there.)"""
    h, index, weights, gate_up, down = _inputs()
    args = [t.detach().bfloat16() if t.is_floating_point() else t for t in (h, index, weights, gate_up, down)]
    first = moe_experts_grouped(*args)
    assert torch.equal(first, moe_experts_grouped(*args))
    ref = moe_experts_reference(*[t.double() if t.is_floating_point() else t for t in args])
    assert (first.double() - ref).norm() / ref.norm() < 1e-2


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    op = OPS["moe_experts"]
    grouped = next(c for c in op.candidates if c.name == "torch-grouped-mm")
    # the GPU-only candidate, allowed on CPU for the test (torch's grouped_mm has a CPU kernel)
    cpu = dataclasses.replace(
        grouped, requirements=(), inputs=InputRule(devices=("cpu", "cuda"), dtypes=("float32", "bfloat16"))
    )
    monkeypatch.setitem(OPS, "moe_experts", dataclasses.replace(op, candidates=(cpu,)))
    selftest.clear_cache()


@pytest.mark.parametrize("model_type", MOE)
def test_moe_families_use_grouped_experts(grouped_on_cpu, model_type):
    reference = tiny_model(model_type)
    model = tiny_model(model_type)
    ids = torch.randint(0, 512, (2, 29))
    loss0, logits0, grads0 = loss_and_grads(reference, input_ids=ids, labels=ids)
    report = fusepatch.apply(model, exclude=["linear_cross_entropy"])
    experts = next(layer for layer in report.layers if layer.layer.endswith("Experts"))
    assert experts.choices[0].chosen == "torch-grouped-mm"
    calls = []
    dispatch = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))._fusepatch.ops["moe_experts"]
    original = dispatch.implementation
    dispatch.implementation = lambda *a: (calls.append(a), original(*a))[1]
    loss1, logits1, grads1 = loss_and_grads(model, input_ids=ids, labels=ids)
    assert calls
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-3, atol=1e-6, msg=name)


def test_experts_stay_with_transformers_on_cpu():
    model = tiny_model("qwen3_moe")
    report = fusepatch.apply(model)
    experts = next(layer for layer in report.layers if layer.layer == "Qwen3MoeExperts")
    # A CPU build says so; a CUDA build on a machine without a GPU (what a plain index installs) says that instead.
    expected = "CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
    assert experts.choices[0].chosen == "eager" and expected in experts.choices[0].reason_text()
