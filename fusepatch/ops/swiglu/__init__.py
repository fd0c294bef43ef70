"""swiglu: ``silu(gate) * up`` fused into one kernel (the projections stay cuBLAS matmuls)."""

from __future__ import annotations

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import InputRule
from fusepatch.ops.common import fla_requirements, own_triton_candidate, rand
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
        Candidate(
            name="fla",
            source="pip",
            requirements=fla_requirements("fla.modules.activations"),
            load=_load_fla,
            inputs=InputRule(kernel="fla's fused SwiGLU"),
            provides="fla.modules.activations.swiglu",
            distribution="fla-core",
        ),
    ),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-5}, _dims),
)
