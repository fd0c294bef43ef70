"""swiglu: ``silu(gate) * up`` fused into one kernel (the projections stay cuBLAS matmuls)."""

from __future__ import annotations

from fusepatch.base.op import Op, SelfTest
from fusepatch.ops.common import fla_candidate, own_triton_candidate, rand
from fusepatch.ops.swiglu.reference import swiglu_reference


def _load_triton():
    from fusepatch.kernels.swiglu import swiglu

    return swiglu


def _load_fla():
    from fla.modules.activations import swiglu

    return swiglu


def _inputs(device, dtype, generator, packed=False, dims=None):
    dim = (dims or {}).get("dim", 300)
    return (rand((5, 33, dim), device, dtype, generator), rand((5, 33, dim), device, dtype, generator)), {}


def _dims(module) -> dict[str, int]:
    return {"dim": module.intermediate_size} if hasattr(module, "intermediate_size") else {}


SWIGLU = Op(
    name="swiglu",
    summary="SwiGLU activation silu(gate) * up, fwd+bwd fused",
    reference=swiglu_reference,
    candidates=(
        own_triton_candidate(_load_triton, "fusepatch's Triton SwiGLU", "fusepatch.kernels.swiglu.swiglu"),
        fla_candidate(
            "fla",
            "fla.modules.activations",
            _load_fla,
            "fla's fused SwiGLU",
            "fla.modules.activations.swiglu",
        ),
    ),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-5}, _dims),
)
