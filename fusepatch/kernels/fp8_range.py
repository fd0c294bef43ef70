"""FP8 quantization's range, one pair of constants for the Triton kernel (``kernels/fp8.py``) and its PyTorch twin
(``ops/fp8_linear/scaled_mm.py``), which must give the same bits. No Triton here: the twin runs without it."""

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_TINY = 1e-12  # the floor of a row's peak: an all-zero row gets a finite scale (its values stay zero)


def padded(rows: int, multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``multiple``: the tokens of an operand quantized by columns."""
    return -(-rows // multiple) * multiple
