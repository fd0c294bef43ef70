"""fp8_linear: a linear projection trained with FP8 GEMMs (``apply(model, precision="fp8")``).

Op signature::

    y = fp8_linear(x, weight, bias=None)        # F.linear(x, weight, bias), in x's dtype

A frozen weight (LoRA's base) is quantized once: the candidate's ``prepare`` makes its FP8 copy, which the
dispatcher keeps and checks against the weight at every call (``ops/prepared.py``) and passes as ``prepared=``.

The forward, input-gradient and weight-gradient GEMMs run on the GPU's FP8 tensor cores (twice the bf16 rate
on Hopper) with rowwise scales; the weight, its gradient and the optimizer stay in their own dtype. FP8 is less
precise than bf16 by design: float8_e4m3fn keeps 3 mantissa bits, and a GEMM of FP8 operands lands about 3.8%
(relative norm) off the fp32 product on random inputs where bf16 lands 0.17%, the same on the CPU and the
H200. The self-test's bound is that error with room, not bf16's: it refuses a wrong kernel (a scale off by a
factor, a transposed operand), not FP8's rounding. Where FP8 cannot run, the eager candidate is the projection as
it was (``F.linear``), and the fallback is said with its reason, never a silent bf16 run.
"""

from __future__ import annotations

from fusepatch.base.op import Candidate, Op, SelfTest
from fusepatch.base.requirements import DistributionVersion, InputRule, MinCapability
from fusepatch.kernels.fp8_range import MULTIPLE
from fusepatch.ops.common import TRITON_FIX, package_requirements, rand
from fusepatch.ops.fp8_linear.reference import fp8_linear_reference

__all__ = ["FP8_LINEAR", "MULTIPLE", "scaled_mm_candidate"]

TORCH_FIX = "pip install --upgrade torch   (a CUDA build: torch._scaled_mm with rowwise scales)"
# what an FP8 candidate on torch._scaled_mm needs (the projections' and the LM head's)
_REQUIREMENTS = (
    *package_requirements("triton", ">=3.0", "triton", TRITON_FIX),
    MinCapability((8, 9), "FP8 tensor cores (Ada, Hopper or newer)"),
    DistributionVersion("torch", ">=2.5", TORCH_FIX, why="torch._scaled_mm with rowwise scales"),
)


def scaled_mm_candidate(load, kernel: str, provides: str, **extra) -> Candidate:
    """An FP8 candidate on ``torch._scaled_mm`` (the projections' and the LM head's): FP8 tensor cores, Triton for
    the quantization kernels, bf16 or fp16 compute (an fp32 model keeps its fp32 GEMMs, and is told how to train in
    bf16); ``extra``: the candidate's other fields (a frozen weight's ``prepare``)."""
    inputs = InputRule(
        kernel=kernel,
        dtypes=("bfloat16", "float16"),
        why={"float32": "FP8 training replaces bf16 GEMMs; an fp32 model computes in fp32"},
        notes={"float32": "train in bf16 (torch_dtype=torch.bfloat16, or Trainer(bf16=True))"},
    )
    return Candidate("scaled-mm", "pip", _REQUIREMENTS, load, inputs, provides, distribution="torch", **extra)


def _load():
    from fusepatch.ops.fp8_linear.scaled_mm import load

    return load()


# a frozen weight's FP8 copy, prepared once and kept by the dispatcher (``ops/prepared.py``); imported when first
# used, as ``load`` is
def _prepare(weight):
    from fusepatch.ops.fp8_linear import scaled_mm

    return scaled_mm.prepare(weight)


def _refresh(weight, handle, stale) -> None:
    from fusepatch.ops.fp8_linear import scaled_mm

    scaled_mm.refresh(weight, handle, stale)


def _restore(handle):
    from fusepatch.ops.fp8_linear import scaled_mm

    return scaled_mm.restore(handle)


def _inputs(device, dtype, generator, packed=False, dims=None):
    dims = dims or {}
    inputs, outputs = dims.get("in", 256), dims.get("out", 192)
    x = rand((3, 37, inputs), device, dtype, generator)
    weight = rand((outputs, inputs), device, dtype, generator, scale=inputs**-0.5)
    return (x, weight), {}


FP8_LINEAR = Op(
    name="fp8_linear",
    summary="linear projection with FP8 (e4m3, rowwise scales) forward and backward GEMMs",
    reference=fp8_linear_reference,
    candidates=(
        scaled_mm_candidate(
            _load,
            "FP8 training",
            "torch._scaled_mm (float8_e4m3fn, rowwise scales) with fusepatch.kernels.fp8.quantize_rows",
            prepare=_prepare,
            refresh=_refresh,
            restore=_restore,
        ),
    ),
    # FP8 rounding: 3.8% measured on these inputs (out, dx, dW alike); the bound leaves 1.3x of room
    # small aligned sizes of its own, not the layer's (a 27B MLP weight is 178 MB)
    selftest=SelfTest(_inputs, {"bfloat16": 0.05, "float16": 0.05}),
    prepares=1,  # the weight: a frozen one is quantized once (``scaled_mm.prepare``), not at every call
)
