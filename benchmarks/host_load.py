"""How busy the host's CPUs were while the timed steps ran, and how much of it was other processes.

Why: a CPU-bound forward runs as fast as its one Python thread gets a core. In the H200 run of 2026-12-02 the same
library code spent 113 ms of host time on the 2B-like forward where the H200 run of 2026-12-01 spent 41, and hf-fast's profiled
step idled 89 ms where it had idled 12: the benchmarks ran right after a GPU test group that had been cut off at
its time limit, and nothing recorded whether anything else was running. This does, from ``/proc/stat`` (every
core's busy time) and this process's own CPU time: what remains is other processes'. Those include the clock
sampler's ``nvidia-smi`` (gpu_clocks.py; a small part of one core), which is why a row is marked shared only from
a whole core up. Linux only; elsewhere the summary says why it is empty.
"""

from __future__ import annotations

import os
import time

# Other processes using this many cores (or more) on average over the timed steps: the row's host was shared.
SHARED_CORES = 1.0


def _busy_s() -> float | None:
    """All cores' busy seconds since boot (``/proc/stat``'s first line), or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user .. steal (guest time is already counted in user)
    return (total - idle) / os.sysconf("SC_CLK_TCK")


class HostLoad:
    """``with HostLoad() as load: ...`` then ``load.summary()``: cores busy on average over the block, this
    process's share (all its threads) and the rest's, and the 1-minute load average at the end."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._own = self._wall = 0.0
        self._end: float | None = None

    def __enter__(self) -> HostLoad:
        self._start = _busy_s()
        self._own, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._end = _busy_s()
        self._own = time.process_time() - self._own
        self._wall = time.perf_counter() - self._wall

    def summary(self) -> dict:
        if self._start is None or self._end is None:
            return {"error": "no /proc/stat on this system"}
        cores = os.cpu_count() or 1
        wall = max(self._wall, 1e-9)  # the block's wall time (perf_counter: monotonic)
        busy_cores = (self._end - self._start) / wall
        own_cores = self._own / wall
        other = max(0.0, busy_cores - own_cores)
        result = {
            "cores": cores,
            "busy_cores": round(busy_cores, 2),
            "own_cores": round(own_cores, 2),
            "other_cores": round(other, 2),
            "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        }
        result["shared"] = result["other_cores"] >= SHARED_CORES  # the figure the line shows decides
        return result
