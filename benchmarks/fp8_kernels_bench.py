"""The FP8 layout kernels alone (``fusepatch/kernels/fp8.py``) at the 27B projection widths, median of 20 CUDA-event
timings each: the tiled FP8 transpose (a frozen weight's input gradient) against the strided copy it replaces,
and the column quantization (transposed, padded) against a transposed copy followed by the row quantization.

    python benchmarks/fp8_kernels_bench.py          # prints one JSON object: milliseconds per case
"""

from __future__ import annotations

import json

import torch


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return round(times[len(times) // 2], 4)


def main() -> int:
    from fusepatch.kernels.fp8 import quantize_columns, quantize_rows, transpose

    out = {}
    for shape in [(17408, 5120), (5120, 17408), (12288, 5120)]:
        q = quantize_rows(torch.randn(shape, device="cuda", dtype=torch.bfloat16))[0]
        out[f"transpose {shape}"] = {
            "strided_copy_ms": median_ms(lambda q=q: q.t().contiguous()),
            "tiled_ms": median_ms(lambda q=q: transpose(q)),
        }
    for shape in [(4096, 5120), (4096, 17408)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out[f"columns {shape}"] = {
            "quantize_columns_ms": median_ms(lambda x=x: quantize_columns(x, 16)),
            "copy_then_rows_ms": median_ms(lambda x=x: quantize_rows(x.t().contiguous())),
            "rows_ms": median_ms(lambda x=x: quantize_rows(x)),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
