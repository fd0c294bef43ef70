"""attention_gate: the output gate of Qwen3.5 / Qwen3-Next full attention, ``attn * sigmoid(gate)``.

Op signature::

    gated = attention_gate(attn [.., heads x head_dim], gate [.., heads, head_dim])

``gate`` is the gate half of ``q_proj``'s output, a strided view; the fused kernel reads it in place, where
transformers copies it out first (``gate.reshape``) and then runs four more elementwise passes forward and back.
"""

from __future__ import annotations

from fusepatch.base.op import Op, SelfTest
from fusepatch.ops.attention_gate.reference import attention_gate_reference
from fusepatch.ops.common import own_triton_candidate, rand


def _load_triton():
    from fusepatch.kernels.gate import sigmoid_gate

    return sigmoid_gate


def _inputs(device, dtype, generator, packed=False, dims=None):
    dims = dims or {}
    heads, dim = dims.get("heads", 3), dims.get("dim", 80)
    attn = rand((2, 37, heads * dim), device, dtype, generator)
    gate = rand((2, 37, heads, dim), device, dtype, generator, scale=2.0)
    return (attn, gate), {}


def _dims(module) -> dict[str, int]:
    config = module.config
    dim = getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"heads": config.num_attention_heads, "dim": dim}


ATTENTION_GATE = Op(
    name="attention_gate",
    summary="gated attention's output gate attn * sigmoid(gate), the gate read in place, fwd+bwd fused",
    reference=attention_gate_reference,
    candidates=(
        own_triton_candidate(
            _load_triton, "fusepatch's Triton attention output gate", "fusepatch.kernels.gate.sigmoid_gate"
        ),
    ),
    selftest=SelfTest(_inputs, {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-5}, _dims),
)
