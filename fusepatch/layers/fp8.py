"""The forward of a projection that ``apply(model, precision="fp8")`` trains with FP8 GEMMs (op ``fp8_linear``).

Only the instance's forward changes: the module stays a ``torch.nn.Linear`` with its bf16 (or fp32) weight, so
state dicts, optimizers, FSDP and peft see what they saw. The fused layers that compute several projections
themselves (``layers/support/projections.py``) call a projection patched here through its module, so its FP8
GEMMs run there too.
"""

from __future__ import annotations

import torch

from fusepatch.layers.support.hooks import autocast_dtype
from fusepatch.ops.fp8_linear.scaled_mm import MULTIPLE, QuantizedWeight, quantize_weight

# the decoder's projections that train in FP8: attention q/k/v/o, the Gated DeltaNet's input and output
# projections, the MLPs' (and the MoE shared expert's) gate/up/down. Left as they are: the embeddings, the norms,
# the LM head, the Gated DeltaNet's gate projections (in_proj_a/b, in_proj_ba: one output per head), routers,
# and everything fla computes.
PROJECTIONS = (
    *("q_proj", "k_proj", "v_proj", "o_proj"),
    *("in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj"),
    *("gate_proj", "up_proj", "down_proj"),
)
UNALIGNED = (
    f"a weight dimension that is not a multiple of {MULTIPLE} (FP8 GEMMs need it): this projection runs as before"
)


def fp8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``self(x)`` with FP8 GEMMs where the op chose a kernel for ``x``'s device and compute dtype; the
    projection as before otherwise (the fallback, said by ``apply`` with its reason)."""
    state = self._fusepatch
    if self.weight.shape[0] % MULTIPLE or self.weight.shape[1] % MULTIPLE:
        state.transformers_calls[UNALIGNED] = state.transformers_calls.get(UNALIGNED, 0) + 1
        return state.original(x)
    fp8_linear = state.ops["fp8_linear"]
    cast = autocast_dtype(x)
    if cast is not None:  # autocast would run the projection in its dtype: quantize from that input
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.to(cast)
            return fp8_linear(x.to(cast), self.weight, bias, frozen=frozen_weight(self, state.cache))
    return fp8_linear(x, self.weight, self.bias, frozen=frozen_weight(self, state.cache))


def frozen_weight(module: torch.nn.Module, cache: dict) -> QuantizedWeight | None:
    """A frozen weight's FP8 copy, quantized once per weight version (LoRA's base: every step reuses it); None
    for a weight that trains (quantized afresh at every GEMM) or inside ``torch.compile`` (traced as a fresh
    quantization). Keyed by the tensor's storage, version, shape and dtype: an in-place update, a load or a new
    tensor quantizes again."""
    weight = module.weight
    if weight.requires_grad or torch.compiler.is_compiling():
        return None
    key = (weight.device, weight.data_ptr(), weight._version, weight.shape, weight.dtype)
    held = cache.get("fp8")
    if held is None or held[0] != key:
        held = cache["fp8"] = (key, quantize_weight(weight))
    return held[1]
