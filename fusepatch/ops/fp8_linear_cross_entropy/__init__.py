"""fp8_linear_cross_entropy: the fused loss (``linear_cross_entropy``) with the LM head's GEMMs in FP8, asked for
with ``apply(model, lm_head_precision="fp8")``.

Op signature: ``linear_cross_entropy``'s::

    loss = fp8_linear_cross_entropy(hidden [N, H], weight [V, H], labels [N], ignore_index=-100,
                                    num_items_in_batch=None)

The logits, the hidden-state gradient and the weight gradient run on FP8 tensor cores (``scaled_mm.FP8Gemms``); the
loss's softmax and the logits' gradient are computed in fp32 from the bf16 logits, as in the bf16 loss. FP8's
rounding moves the loss and both gradients further from fp32 than bf16's does (docs/fp8.md, "Precision"), which
is why the head stays bf16 unless asked. The self-test's bound is FP8's error with room, as ``fp8_linear``'s.

Where this op cannot run (no FP8 tensor cores, a CPU, fp32, a vocabulary or hidden size not a multiple of 16),
the head computes the model's own precision's fused loss (``linear_cross_entropy``), and ``apply`` says why.
"""

from __future__ import annotations

from fusepatch.base.op import Op, SelfTest
from fusepatch.kernels.fp8_range import unaligned
from fusepatch.ops.fp8_linear import scaled_mm_candidate
from fusepatch.ops.linear_cross_entropy import hidden_dims, loss_inputs
from fusepatch.ops.linear_cross_entropy.reference import linear_cross_entropy_reference


def aligned(weight_shape: tuple[int, ...]) -> str | None:
    """Why an LM head of this weight shape cannot run its GEMMs in FP8 (the vocabulary is the hidden-state
    gradient's reduction dimension), or None."""
    why = unaligned(weight_shape)
    return None if why is None else f"lm_head {why}"


def _load():
    from fusepatch.ops.fp8_linear_cross_entropy.scaled_mm import load

    return load()


def _inputs(device, dtype, generator, packed=False, dims=None):
    """The bf16 loss's self-test call with a vocabulary that is a multiple of 16 (the FP8 GEMMs' alignment); its
    257 tokens pad the weight gradient's."""
    return loss_inputs(device, dtype, generator, packed, dims, vocab=1024)


FP8_LINEAR_CROSS_ENTROPY = Op(
    name="fp8_linear_cross_entropy",
    summary="lm_head + cross-entropy with the head's three GEMMs in FP8 (e4m3, rowwise scales)",
    reference=linear_cross_entropy_reference,
    candidates=(
        scaled_mm_candidate(
            _load,
            "FP8 LM head",
            "torch._scaled_mm (float8_e4m3fn, rowwise scales) in fusepatch's fused loss loop "
            "(fusepatch.kernels.cross_entropy)",
        ),
    ),
    # FP8 rounding, as fp8_linear's: the gradients land a few percent off fp32 (measured below the bound on the
    # CPU with torch's own _scaled_mm; the loss far less)
    selftest=SelfTest(_inputs, {"bfloat16": 0.05, "float16": 0.05}, hidden_dims),
    fits=aligned,
)
