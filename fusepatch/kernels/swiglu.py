"""SwiGLU ``silu(gate) * up`` forward and backward as two elementwise Triton kernels with one fixed launch
configuration.

Why not fla's: fla's SwiGLU kernels autotune 30 configurations each, for every hidden width and dtype, so the
first step of a fresh process (and ``doctor``) spends minutes compiling them (measured on the H200). An
elementwise kernel is memory-bound; a fixed block of 2048 elements and 8 warps is within noise of the best
configuration, and compiles once per dtype. Math in fp32, results in the input dtype, as eager does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
WARPS = 8


@triton.jit
def swiglu_grads(g, u, dy):
    """``(d/dgate, d/dup)`` of ``silu(g) * u`` under the upstream gradient ``dy``, all fp32; shared with the MoE
    experts' weighted kernel (``kernels/moe_swiglu.py``), which passes ``dy`` already scaled by the routing weight.
    """
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * silu


@triton.jit
def _swiglu_fwd(gate, up, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = g * tl.sigmoid(g)
    tl.store(out + offsets, (silu * u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(gate, up, grad_out, grad_gate, grad_up, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(grad_out + offsets, mask=mask, other=0.0).to(tl.float32)
    dg, du = swiglu_grads(g, u, dy)
    tl.store(grad_gate + offsets, dg.to(grad_gate.dtype.element_ty), mask=mask)
    tl.store(grad_up + offsets, du.to(grad_up.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
            )
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _swiglu_fwd[_grid(n)](gate, up, out, n, BLOCK=BLOCK, num_warps=WARPS)
        ctx.save_for_backward(gate, up)  # two saved tensors where eager keeps three (gate, silu(gate), up)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd[_grid(n)](gate, up, grad_out, grad_gate, grad_up, n, BLOCK=BLOCK, num_warps=WARPS)
        return grad_gate, grad_up


@torch.compiler.disable  # a graph break under torch.compile, like fla's ops: dynamo never traces the launch
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with a fused backward; any shape, gate and up alike."""
    return _SwiGLU.apply(gate, up)
