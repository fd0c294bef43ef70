"""RMSNorm in its three Qwen forms: plain (Qwen2/3), zero-centered ``x * (1 + w)`` (Qwen3.5/Next), and gated
``norm(x) * w * silu(z)`` (the Gated DeltaNet output norm); and the residual add fused into the first two
(the decoder layer's ``h = residual + attn_out; post_attention_layernorm(h)``).

The eager references repeat transformers' arithmetic step for step, so an unpatched and a patched-but-eager
model give bit-identical results.
"""

from __future__ import annotations

import torch

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import InputRule
from fusepatch.ops.common import fla_candidate, own_triton_candidate, rand
from fusepatch.ops.rms_norm.reference import (
    add_rms_norm_reference,
    add_rms_norm_zero_centered_reference,
    gated_rms_norm_reference,
    rms_norm_reference,
    rms_norm_zero_centered_reference,
)


def _load_fla_rms_norm(zero_centered: bool, residual: bool):
    """fla's Triton RMSNorm in the op's signature: ``(x, weight, eps)``, or ``(x, residual, weight, eps)``."""
    from fla.modules.norm.layernorm import rms_norm

    def scale(weight):
        # The (1 + w) shift is one [D]-sized op; autograd carries its gradient to w unchanged.
        return 1.0 + weight.float() if zero_centered else weight

    def rms_norm_fla(x, weight, eps):
        return rms_norm(x, scale(weight), None, eps=eps)

    def add_rms_norm_fla(x, residual, weight, eps):
        # One kernel reads x and the residual, writes the sum (the next residual, in the residual's dtype) and
        # the normed sum (normalised from the fp32 sum, before it is rounded); its backward adds the next
        # residual's gradient into the input gradient instead of a separate add.
        return rms_norm(x, scale(weight), None, residual=residual, eps=eps, prenorm=True)

    return add_rms_norm_fla if residual else rms_norm_fla


def _triton_norm_candidate(name: str) -> Candidate:
    """fusepatch's own RMSNorm (``fusepatch/kernels/rms_norm.py``; ``name``: its function, the op's name):
    compiled once per feature size and dtype, where fla's compiles and autotunes again for each new row-count
    bucket (the per-head q/k norms, the gated norm over value heads) and, with the residual add at the model
    width, compiles its backward again for each rows-per-program count (``cdiv(rows, SMs)``, a constexpr)."""

    def load():
        from fusepatch.kernels import rms_norm

        return getattr(rms_norm, name)

    return own_triton_candidate(load, "fusepatch's Triton RMSNorm", f"fusepatch.kernels.rms_norm.{name}")


def _fla_norm_candidate(zero_centered: bool, residual: bool = False) -> Candidate:
    """The fla candidate of the four RMSNorm ops (plain / zero-centered, with or without the residual add)."""
    return fla_candidate(
        "fla",
        "fla.modules.norm.layernorm",
        lambda: _load_fla_rms_norm(zero_centered, residual),
        FLA_NORM_INPUTS,
        "fla.modules.norm.layernorm.rms_norm"
        + ("(residual=..., prenorm=True)" if residual else "")
        + (" with weight 1 + w" if zero_centered else ""),
    )


def _load_fla_gated():
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    def gated_rms_norm_fla(x, gate, weight, eps):
        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)

    return gated_rms_norm_fla


def _norm_inputs(device, dtype, generator, packed=False, dims=None):
    dim = (dims or {}).get("dim", 200)
    x = rand((3, 37, dim), device, dtype, generator)
    weight = rand((dim,), device, dtype, generator, scale=0.1)
    return (x, weight, 1e-6), {}


def _add_norm_inputs(device, dtype, generator, packed=False, dims=None):
    dim = (dims or {}).get("dim", 200)
    x = rand((3, 37, dim), device, dtype, generator)
    residual = rand((3, 37, dim), device, dtype, generator, scale=4.0)  # a residual stream is larger than x
    weight = rand((dim,), device, dtype, generator, scale=0.1)
    return (x, residual, weight, 1e-6), {}


def _gated_inputs(device, dtype, generator, packed=False, dims=None):
    dim = (dims or {}).get("dim", 128)
    x = rand((211, dim), device, dtype, generator)
    gate = rand((211, dim), device, dtype, generator)
    weight = (1 + rand((dim,), device, torch.float32, generator, scale=0.1, grad=False)).to(dtype).requires_grad_(True)
    return (x, gate, weight, 1e-6), {}


def _norm_dims(module) -> dict[str, int]:
    return {"dim": module.weight.shape[0]}


def _add_norm_dims(module) -> dict[str, int]:
    return {"dim": module.post_attention_layernorm.weight.shape[0]}  # the decoder layer's second norm


def _gated_dims(module) -> dict[str, int]:
    return {"dim": module.head_v_dim}  # the Gated DeltaNet layer: its output norm is per value head


NORM_TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}
FLA_NORM_INPUTS = InputRule(kernel="fla's Triton RMSNorm")


def _norm_op(name: str, summary: str, reference, *, zero_centered: bool, residual: bool = False) -> Op:
    """One of the four RMSNorm ops (plain / zero-centered, with or without the residual add): fusepatch's Triton
    kernel, then fla's; the residual forms hold both outputs, the normed sum and the sum itself (the residual
    stream the layer returns)."""
    selftest = (
        SelfTest(_add_norm_inputs, NORM_TOLERANCE, _add_norm_dims, outputs=2)
        if residual
        else SelfTest(_norm_inputs, NORM_TOLERANCE, _norm_dims)
    )
    candidates = (_triton_norm_candidate(name), _fla_norm_candidate(zero_centered, residual))
    return Op(name=name, summary=summary, reference=reference, candidates=candidates, selftest=selftest)


RMS_NORM = _norm_op("rms_norm", "RMSNorm fwd+bwd (Qwen2/Qwen3 form, x * w)", rms_norm_reference, zero_centered=False)
RMS_NORM_ZERO_CENTERED = _norm_op(
    "rms_norm_zero_centered",
    "RMSNorm fwd+bwd (Qwen3.5/Qwen3-Next form, x * (1 + w))",
    rms_norm_zero_centered_reference,
    zero_centered=True,
)
ADD_RMS_NORM = _norm_op(
    "add_rms_norm",
    "residual add + RMSNorm in one kernel, fwd+bwd (decoder layer, Qwen2/Qwen3 form)",
    add_rms_norm_reference,
    zero_centered=False,
    residual=True,
)
ADD_RMS_NORM_ZERO_CENTERED = _norm_op(
    "add_rms_norm_zero_centered",
    "residual add + RMSNorm in one kernel, fwd+bwd (decoder layer, Qwen3.5/Qwen3-Next form)",
    add_rms_norm_zero_centered_reference,
    zero_centered=True,
    residual=True,
)

GATED_RMS_NORM = Op(
    name="gated_rms_norm",
    summary="gated RMSNorm norm(x) * w * silu(z), fwd+bwd in one kernel",
    reference=gated_rms_norm_reference,
    candidates=(
        _triton_norm_candidate("gated_rms_norm"),
        fla_candidate(
            "fla",
            "fla.modules.norm.fused_norm_gate",
            _load_fla_gated,
            "fla's fused gated RMSNorm",
            "fla.modules.norm.fused_norm_gate.rms_norm_gated",
        ),
    ),
    selftest=SelfTest(_gated_inputs, NORM_TOLERANCE, _gated_dims),
)
