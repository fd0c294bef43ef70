"""Norms, SwiGLU and the fused linear cross-entropy on a real GPU, against an fp64 reference on fresh inputs.

Tolerances (relative error of the output and of every input gradient): bf16 2e-2, fp32 1e-3 (Triton's tf32
dots in fla's fused cross-entropy); the norms and SwiGLU are elementwise, far inside them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require

from fusepatch.env import capture
from fusepatch.ops import OPS
from fusepatch.ops._common import relative_error
from fusepatch.requirements import Inputs
from fusepatch.resolve import static_verdict

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _kernel(op, name, dtype):
    candidate = next(c for c in OPS[op].candidates if c.name == name)
    verdict, _ = static_verdict(candidate, capture(refresh=True))
    require(verdict, f"{op}/{name}")
    require(candidate.inputs.check(Inputs("cuda", str(dtype)[6:])), f"{op}/{name}")
    return candidate.load()


def _compare(fn, reference, inputs, dtype, extra=()):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    out = fn(*[t.to(dtype) for t in leaves], *extra)
    ref = reference(*ref_leaves, *extra)
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, cot.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    errors = {"out": relative_error(out, ref)} | {
        f"d{i}": relative_error(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads))
    }
    assert all(e <= TOL[dtype] for e in errors.values()), errors


@DTYPES
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_zero_centered"])
def test_rms_norms(op, dtype):
    fn = _kernel(op, "fla", dtype)
    x = torch.randn(3, 1001, 2048, device="cuda")
    w = 0.1 * torch.randn(2048, device="cuda") + (1.0 if op == "rms_norm" else 0.0)
    _compare(fn, OPS[op].reference, [x, w], dtype, extra=(1e-6,))


@DTYPES
def test_swiglu(dtype):
    fn = _kernel("swiglu", "fla", dtype)
    _compare(
        fn,
        OPS["swiglu"].reference,
        [torch.randn(4, 333, 1536, device="cuda"), torch.randn(4, 333, 1536, device="cuda")],
        dtype,
    )


@DTYPES
@pytest.mark.parametrize("name", ["fla", "torch-chunked"])
def test_linear_cross_entropy(name, dtype):
    fn = _kernel("linear_cross_entropy", name, dtype)
    tokens, hidden, vocab = 2049, 1024, 32003
    h = torch.randn(tokens, hidden, device="cuda")
    w = torch.randn(vocab, hidden, device="cuda") * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[::9] = -100
    leaves = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    ref_leaves = [h.double().requires_grad_(True), w.double().requires_grad_(True)]
    out = fn(leaves[0].to(dtype), leaves[1].to(dtype), y, num_items_in_batch=torch.tensor(1500, device="cuda"))
    ref = OPS["linear_cross_entropy"].reference(*ref_leaves, y, num_items_in_batch=torch.tensor(1500, device="cuda"))
    grads = torch.autograd.grad(out, leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    errors = {"loss": relative_error(out, ref)} | {
        f"d{i}": relative_error(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads))
    }
    assert all(e <= TOL[dtype] for e in errors.values()), errors


@DTYPES
def test_moe_experts_grouped(dtype):
    fn = _kernel("moe_experts", "torch-grouped-mm", dtype)
    tokens, experts, hidden, inter, top_k = 1031, 16, 1024, 512, 4
    h = torch.randn(tokens, hidden, device="cuda")
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5
    leaves = [t.clone().requires_grad_(True) for t in (h, weights, gate_up, down)]
    ref_leaves = [t.double().requires_grad_(True) for t in (h, weights, gate_up, down)]
    out = fn(leaves[0].to(dtype), index, *[t.to(dtype) for t in leaves[1:]])
    ref = OPS["moe_experts"].reference(ref_leaves[0], index, *ref_leaves[1:])
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, cot.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    errors = {"out": relative_error(out, ref)} | {
        f"d{i}": relative_error(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads))
    }
    assert all(e <= TOL[dtype] for e in errors.values()), errors
