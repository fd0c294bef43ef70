"""An nvcc front that keeps only the GPU architectures asked for.

Some packages hard-code a long ``-gencode`` list in their setup.py (causal-conv1d compiles nine architectures)
and torch then ignores ``TORCH_CUDA_ARCH_LIST``. Set as ``PYTORCH_NVCC`` (torch's ninja builds honour it), this
drops every ``-gencode`` whose architecture is not kept, adds the kept ones if none remain, and runs nvcc.

    PYTORCH_NVCC="python -m fusepatch.tools.nvcc_filter --keep 90 --nvcc /usr/local/cuda/bin/nvcc --"
"""

from __future__ import annotations

import os
import re
import sys

_ARCH = re.compile(r"arch=compute_(\d+a?),code=(?:sm|compute)_(\d+a?)")


def filter_gencodes(args: list[str], keep: set[str]) -> list[str]:
    """``args`` without the ``-gencode`` pairs (``-gencode X`` or ``-gencode=X``) whose sm is not in ``keep``."""
    out: list[str] = []
    kept = False
    i = 0
    while i < len(args):
        arg = args[i]
        value = None
        if arg == "-gencode" and i + 1 < len(args):
            value, width = args[i + 1], 2
        elif arg.startswith("-gencode="):
            value, width = arg.split("=", 1)[1], 1
        if value is None:
            out.append(arg)
            i += 1
            continue
        match = _ARCH.search(value)
        if match is None or match.group(2) in keep:
            out += args[i : i + width]
            kept = kept or match is not None
        i += width
    if not kept:
        for arch in sorted(keep):
            out += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep: set[str] = set()
    nvcc = "nvcc"
    while argv and argv[0] != "--":
        flag = argv.pop(0)
        if flag == "--keep":
            keep.update(a.strip() for a in argv.pop(0).split(",") if a.strip())
        elif flag == "--nvcc":
            nvcc = argv.pop(0)
        else:
            print(f"nvcc_filter: unknown option {flag}", file=sys.stderr)
            return 2
    if argv and argv[0] == "--":
        argv.pop(0)
    args = filter_gencodes(argv, keep) if keep else argv
    os.execvp(nvcc, [nvcc, *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
