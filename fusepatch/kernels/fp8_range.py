"""What the FP8 kernels (``kernels/fp8.py``) and their PyTorch twins (``ops/fp8_linear/scaled_mm.py``) share, which
must give the same bits: FP8 quantization's range. No Triton here: the twins run without it."""

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MULTIPLE = 16  # torch._scaled_mm's alignment of the reduction and output dimensions: both of a weight's
FP8_TINY = 1e-12  # the floor of a row's peak: an all-zero row gets a finite scale (its values stay zero)


def unaligned(shape: tuple[int, ...]) -> str | None:
    """Why a weight of this shape cannot be an FP8 GEMM's operand (both dimensions multiples of ``MULTIPLE``), or
    None: the one check behind the projections' and the LM head's."""
    if len(shape) == 2 and not shape[0] % MULTIPLE and not shape[1] % MULTIPLE:
        return None
    return f"weight {tuple(shape)}: FP8 GEMMs need both dimensions multiples of {MULTIPLE}"


def padded(rows: int, multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``multiple``: the tokens of an operand quantized by columns."""
    return -(-rows // multiple) * multiple
