"""moe_experts: the experts of a MoE block as two grouped GEMMs instead of a Python loop over experts.

Op signature::

    out = moe_experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H], down_proj [E, H, I])

Each token goes through its K experts, ``down(silu(gate) * up)``, weighted by its routing weight; the router's
math is untouched (it runs before). Layout: transformers' concatenated ``[gate; up]`` rows, not transposed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import (
    CudaDevice,
    DistributionVersion,
    Importable,
    InputRule,
    MinCapability,
    TorchVersion,
)
from fusepatch.ops.common import TRITON_FIX, rand
from fusepatch.ops.moe_experts.reference import moe_experts_reference, weighted_swiglu_reference


def _grouped_mm():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no grouped_mm; torch >= 2.9 has it (pip install 'torch>=2.9')"
        )
    return fn


def _to_slots(hidden: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Each slot's token row in the slots' sorted order (``source``: the row of each sorted slot; the row past the
    last token, a zero row appended here, for a dropped slot)."""
    return torch.cat((hidden, hidden.new_zeros(1, hidden.shape[-1]))).index_select(0, source)


def _to_tokens(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's ``top_k`` sorted rows summed (``inverse``: the sort's inverse permutation); ``sum`` adds in
    fp32 inside, the same way every run."""
    return rows.index_select(0, inverse).view(-1, top_k, rows.shape[-1]).sum(1)


class _Regroup(torch.autograd.Function):
    """``_to_slots`` (``to_tokens`` False) or ``_to_tokens`` (True); the backward is the other one, as the two are
    each other's transpose (a dropped slot's row, zero forward, gets an exactly zero gradient: see
    ``moe_experts_grouped``). Left to autograd, the gather by token's backward is an accumulating ``index_put_``,
    which on CUDA sorts its indices first (several launches a layer), and the combination's is an atomic
    ``index_add_`` over every slot after a copy of the sum's expanded gradient. Gathers both ways cost a fraction
    of those scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, source: torch.Tensor, inverse: torch.Tensor, top_k: int, to_tokens: bool):
        ctx.save_for_backward(source, inverse)
        ctx.top_k, ctx.to_tokens = top_k, to_tokens
        return _to_tokens(x, inverse, top_k) if to_tokens else _to_slots(x, source)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        source, inverse = ctx.saved_tensors
        regrouped = _to_slots(grad, source) if ctx.to_tokens else _to_tokens(grad, inverse, ctx.top_k)
        return regrouped, None, None, None, None


def moe_experts_grouped(
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation=weighted_swiglu_reference
):
    """Slots sorted by expert, then one grouped GEMM for all gate/up projections and one for all down ones;
    ``activation(gate_up, weights)`` between them, which applies the routing weights too (the down projection is
    linear in its input: the weight scales the ``inter``-wide activation, not the ``hidden``-wide output).

    Nothing here reads the GPU: a training loop queues the next step behind this one. So every slot is computed,
    a dropped one (index equal to the expert count, as expert parallelism marks experts of another rank) in the
    last expert's group, on a zero row instead of its token's: its output is exactly zero, and so is every
    gradient through it (to the experts, the token and its weight), without a pass over every slot's row to mask
    it, and a non-finite token row cannot reach the last expert's gradient through a slot routed elsewhere.
    Counting the kept slots to slice them off (``int(keep.sum())``) and ``bincount`` (which reads its input's
    maximum back) each waited for the GPU once per MoE layer (tests/gpu's sync test checks that none does).

    Rows move by gathers only (``index_select`` with the sort's order, its inverse, or the slots' tokens), and
    each token sums its ``top_k`` rows, forward and backward, with ``sum`` (fp32 inside, as transformers'
    grouped_mm experts do): no accumulating scatter, so no sort-based ``index_put_`` in the backward and no bf16
    atomics (run-to-run differences) in either direction."""
    grouped_mm = _grouped_mm()
    experts = gate_up_proj.shape[0]
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    keep = flat < experts
    expert, order = torch.sort(torch.where(keep, flat, experts - 1), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # each sorted slot's row: its token's (slot // top_k), or the zero row appended after the last token if dropped
    source = torch.where(keep.index_select(0, order), order // top_k, tokens)
    # group ends: how many slots go to experts 0..e (bincount's cumsum, without its host read)
    offsets = torch.searchsorted(expert, torch.arange(experts, device=expert.device), right=True).to(torch.int32)
    rows = _Regroup.apply(hidden, source, inverse, top_k, False)
    gate_up = grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offsets)
    act = activation(gate_up, top_k_weights.reshape(-1).index_select(0, order).to(gate_up.dtype))
    out = grouped_mm(act, down_proj.transpose(1, 2), offs=offsets)
    return _Regroup.apply(out, source, inverse, top_k, True).to(hidden.dtype)


def _load_triton():
    from fusepatch.kernels.moe_swiglu import weighted_swiglu

    def moe_experts_grouped_triton(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
        return moe_experts_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, weighted_swiglu)

    return moe_experts_grouped_triton


def _inputs(device, dtype, generator, packed=False, dims=None):
    dims = dims or {}
    experts, hidden_size, inter = dims.get("experts", 8), dims.get("hidden", 64), dims.get("inter", 32)
    tokens, top_k = 37, min(2, experts)
    hidden = rand((tokens, hidden_size), device, dtype, generator)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(device)
    weights = (
        torch.rand(tokens, top_k, generator=generator).softmax(-1).to(device=device, dtype=dtype).requires_grad_(True)
    )
    gate_up = rand((experts, 2 * inter, hidden_size), device, dtype, generator, scale=hidden_size**-0.5)
    down = rand((experts, hidden_size, inter), device, dtype, generator, scale=inter**-0.5)
    return (hidden, index, weights, gate_up, down), {}


def _dims(module) -> dict[str, int]:
    experts, two_inter, hidden = module.gate_up_proj.shape
    return {"experts": experts, "hidden": hidden, "inter": two_inter // 2}


# torch's grouped_mm: sm_80+ from torch 2.9/2.10 (Hopper only before), bf16 on the GPU; both candidates' GEMMs
GROUPED_MM = (CudaDevice(), MinCapability((8, 0), "torch's grouped_mm"), TorchVersion(">=2.9"))
GROUPED_MM_DTYPES = ("bfloat16", "float32")

MOE_EXPERTS = Op(
    name="moe_experts",
    summary="MoE experts as two grouped GEMMs instead of a Python loop over experts",
    reference=moe_experts_reference,
    candidates=(
        # the same GEMMs with fusepatch's Triton activation between them (one kernel each way, the routing weight
        # and its gradient inside); the plain one after it, for a torch without Triton
        Candidate(
            name="grouped-mm-triton",
            source="pip",
            requirements=(
                *GROUPED_MM,
                DistributionVersion("triton", ">=3.0", TRITON_FIX),
                Importable("triton", "triton", TRITON_FIX),
            ),
            load=_load_triton,
            inputs=InputRule(
                devices=("cuda",),
                dtypes=GROUPED_MM_DTYPES,
                kernel="torch's grouped_mm with fusepatch's Triton weighted SwiGLU",
            ),
            provides=(
                "fusepatch.ops.moe_experts.moe_experts_grouped (torch grouped_mm) with "
                "fusepatch.kernels.moe_swiglu.weighted_swiglu between the GEMMs (fixed launch configuration)"
            ),
            distribution="torch",
        ),
        Candidate(
            name="torch-grouped-mm",
            source="pip",
            requirements=GROUPED_MM,
            load=lambda: moe_experts_grouped,
            inputs=InputRule(devices=("cuda",), dtypes=GROUPED_MM_DTYPES, kernel="torch's grouped_mm"),
            provides="fusepatch.ops.moe_experts.moe_experts_grouped (torch grouped_mm)",
            distribution="torch",
        ),
    ),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}, _dims),
)
