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


def _compare(fn, reference, args, dtype, extra=(), **kwargs):
    """fn on ``args`` cast to ``dtype`` against ``reference`` on fp64 copies: output and every float input's
    gradient (integer arguments, such as labels or expert indices, pass through)."""
    floats = [i for i, a in enumerate(args) if a.is_floating_point()]
    leaves = {i: args[i].detach().clone().requires_grad_(True) for i in floats}
    ref_leaves = {i: args[i].detach().double().requires_grad_(True) for i in floats}
    out = fn(*[leaves[i].to(dtype) if i in leaves else a for i, a in enumerate(args)], *extra, **kwargs)
    ref = reference(*[ref_leaves.get(i, a) for i, a in enumerate(args)], *extra, **kwargs)
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, list(leaves.values()), cot.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()), cot)
    errors = {"out": relative_error(out, ref)}
    errors |= {f"d{i}": relative_error(g, r) for i, g, r in zip(floats, grads, ref_grads)}
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
    items = torch.tensor(1500, device="cuda")
    _compare(fn, OPS["linear_cross_entropy"].reference, [h, w, y], dtype, num_items_in_batch=items)


@DTYPES
def test_moe_experts_grouped(dtype):
    fn = _kernel("moe_experts", "torch-grouped-mm", dtype)
    tokens, experts, hidden, inter, top_k = 1031, 16, 1024, 512, 4
    h = torch.randn(tokens, hidden, device="cuda")
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5
    _compare(fn, OPS["moe_experts"].reference, [h, index, weights, gate_up, down], dtype)
