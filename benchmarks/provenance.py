"""Where, when and how a record row was measured: its date, GPU, package versions, code commit and command, and the
CUDA-event timing the studies share. One module, so that the rows of every script say these the same way (the
docs' figures are checked against them, ``figures.py``) and a study needs no copy of its own.

Light on import: torch is imported only by the functions that need a GPU.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)

# The distributions a training step's speed or numbers depend on, as ``train_step.py`` records them.
PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "fla-core",
    "causal-conv1d",
    "tilelang",
    "liger-kernel",
    "torchao",
    "fusepatch",
)


def versions(names: Iterable[str] = PACKAGES, *, absent: bool = True) -> dict[str, str | None]:
    """The installed version of each distribution in ``names``, in that order. One not installed is None (the row
    says it was looked for and missing), or left out with ``absent=False``."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if absent:
                found[name] = None
    return found


def code() -> str | None:
    """The repository's commit (short hash), or None where it is no git checkout or git is missing."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def command(script: str, argv: Sequence[str] | None = None) -> str:
    """How to run this again from the repository root: ``python <script's path> <its arguments>``."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", os.path.relpath(os.path.abspath(script), REPO), *args])


def append_rows(path: str | None, rows: Iterable[dict]) -> None:
    """Append ``rows`` to the JSON-lines record at ``path`` (nothing where ``path`` is None)."""
    if not path:
        return
    import json

    with open(path, "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def today() -> str:
    """The date of the run, ``YYYY-MM-DD`` (the records' ``date``)."""
    return datetime.date.today().isoformat()


def gpu_name(index: int = 0) -> str:
    """The CUDA device's name, as torch reports it."""
    import torch

    return torch.cuda.get_device_name(index)


def cuda_times_ms(fn: Callable[[], object], warmup: int, repeat: int) -> list[float]:
    """Milliseconds of GPU time of each of ``repeat`` calls of ``fn`` (CUDA events around each, waited for),
    after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn: Callable[[], object], warmup: int, repeat: int) -> float:
    """The median of :func:`cuda_times_ms`: one figure for a call, robust to a stray slow one."""
    return statistics.median(cuda_times_ms(fn, warmup, repeat))
