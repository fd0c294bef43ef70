"""varlen_attention: causal softmax attention within each packed document, over the document boundaries.

Op signature (tokens of every row flattened, as flash-attention's varlen functions take them)::

    out [T, Hq, D] = varlen_attention(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], cu_seqlens [N+1] int32,
                                      max_seqlen: int, scale: float | None)

Hq is a multiple of Hk (grouped-query attention). For a packed row transformers builds a block-causal 4D mask
and sdpa runs it through cuDNN or the memory-efficient kernel, which compute every masked-out block and, with
cuDNN, plan anew for every new row length (tens of milliseconds each in the forward, the checkpoint recompute and
the backward). A varlen flash kernel skips the blocks between documents and needs no
plan. The eager path of this op is transformers' own masked attention (the layer simply is not routed); the
reference below only checks candidates.
"""

from __future__ import annotations

import inspect

import torch

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import CudaDevice, Importable, InputRule, MinCapability
from fusepatch.ops.common import rand
from fusepatch.ops.varlen_attention.reference import varlen_attention_reference

TORCH_FIX = 'pip install -U "torch>=2.10"   (torch.nn.attention.varlen ships with torch 2.10 and newer)'


def torch_varlen_adapter(varlen_attn):
    """The op's signature over ``torch.nn.attention.varlen.varlen_attn``, whose keywords moved between torch
    releases: causality was ``is_causal=True`` and became ``window_size=(-1, 0)``; ``scale`` and
    ``enable_gqa`` arrived later. What the installed signature lacks is done around it (q pre-scaled, k/v
    heads repeated), so every torch that has the function computes the same thing."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        raise ImportError(
            f"torch {torch.__version__}: torch.nn.attention.varlen.varlen_attn takes neither window_size nor "
            f"is_causal (parameters: {', '.join(params)}); fix: {TORCH_FIX}"
        )
    takes_scale, takes_gqa = "scale" in params, "enable_gqa" in params

    def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=None):
        extra = dict(causal)
        if q.shape[1] != k.shape[1]:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if scale is not None:
            if takes_scale:
                extra["scale"] = scale
            else:
                q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **extra)

    return varlen_attention


def _load_torch():
    from torch.nn.attention.varlen import varlen_attn

    return torch_varlen_adapter(varlen_attn)


LENGTHS = (17, 1, 29, 8)  # a one-token document among them: the edge a boundary bug shows first


def _inputs(device, dtype, generator, packed=True, dims=None):
    dims = dims or {}
    hq, hk, dim = (dims.get(n, d) for n, d in (("hq", 4), ("hk", 2), ("dim", 64)))
    total = sum(LENGTHS)
    q = rand((total, hq, dim), device, dtype, generator)
    k = rand((total, hk, dim), device, dtype, generator)
    v = rand((total, hk, dim), device, dtype, generator)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (q, k, v, cu, max(LENGTHS), 0.9 * dim**-0.5), {}  # a scale other than the default: it must be honoured


def _dims(module) -> dict[str, int]:
    config = module.config
    return {
        "hq": config.num_attention_heads,
        "hk": config.num_key_value_heads,
        "dim": getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    }


VARLEN_ATTENTION = Op(
    name="varlen_attention",
    summary="packed rows' causal attention within each document by a varlen flash kernel (no 4D mask, no plans)",
    reference=varlen_attention_reference,
    candidates=(
        Candidate(
            name="torch",
            source="pip",
            requirements=(
                CudaDevice(),
                MinCapability((8, 0), "FlashAttention-2 in torch"),
                Importable("torch.nn.attention.varlen", "torch", TORCH_FIX),
            ),
            load=_load_torch,
            inputs=InputRule(
                dtypes=("bfloat16", "float16"),
                kernel="torch's FlashAttention varlen kernel",
                why={"float32": "FlashAttention computes in 16-bit"},
                notes={"float32": "train in bf16 (Trainer(bf16=True) or torch_dtype=torch.bfloat16)"},
            ),
            provides="torch.nn.attention.varlen.varlen_attn",
            distribution="torch",
        ),
    ),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3}, _dims),
)
