"""Norms, SwiGLU and the fused linear cross-entropy on a real GPU, against an fp64 reference on fresh inputs.

Tolerances (relative error of the output and of every input gradient): bf16 2e-2, fp32 1e-3 (Triton's tf32
dots in fla's fused cross-entropy); the norms and SwiGLU are elementwise, far inside them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compare, kernel

from fusepatch.ops import OPS

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _compare(fn, reference, args, dtype, extra=(), **kwargs):
    compare(fn, reference, args, dtype, TOL[dtype], extra, **kwargs)


@DTYPES
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_zero_centered"])
def test_rms_norms(op, dtype):
    fn = kernel(op, "fla", dtype)
    x = torch.randn(3, 1001, 2048, device="cuda")
    w = 0.1 * torch.randn(2048, device="cuda") + (1.0 if op == "rms_norm" else 0.0)
    _compare(fn, OPS[op].reference, [x, w], dtype, extra=(1e-6,))


@DTYPES
@pytest.mark.parametrize("name", ["triton", "fla"])
def test_swiglu(name, dtype):
    fn = kernel("swiglu", name, dtype)
    _compare(
        fn,
        OPS["swiglu"].reference,
        [torch.randn(4, 333, 1536, device="cuda"), torch.randn(4, 333, 1536, device="cuda")],
        dtype,
    )


@DTYPES
@pytest.mark.parametrize("name", ["fla", "torch-chunked"])
def test_linear_cross_entropy(name, dtype):
    fn = kernel("linear_cross_entropy", name, dtype)
    tokens, hidden, vocab = 2049, 1024, 32003
    h = torch.randn(tokens, hidden, device="cuda")
    w = torch.randn(vocab, hidden, device="cuda") * hidden**-0.5
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[::9] = -100
    items = torch.tensor(1500, device="cuda")
    _compare(fn, OPS["linear_cross_entropy"].reference, [h, w, y], dtype, num_items_in_batch=items)


@DTYPES
def test_moe_experts_grouped(dtype):
    fn = kernel("moe_experts", "torch-grouped-mm", dtype)
    tokens, experts, hidden, inter, top_k = 1031, 16, 1024, 512, 4
    h = torch.randn(tokens, hidden, device="cuda")
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5
    _compare(fn, OPS["moe_experts"].reference, [h, index, weights, gate_up, down], dtype)
