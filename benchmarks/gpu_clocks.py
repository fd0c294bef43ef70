"""The GPU's SM clock, power and temperature while the timed steps run, sampled by ``nvidia-smi`` in a child
process (no thread in the benchmark's own process, so the sampling takes no time from the CPU-bound forward).

Why: in the 27B-shaped step the same cuBLAS GEMMs took 3-4% longer in fusepatch's step than in hf-fast's of the
same run (H200 run of 2026-11-30), and the cuDNN attention backward 10% longer. A denser step (fewer
memory-bound kernels between the GEMMs) can draw more power and run at a lower clock; this records whether it
did. Nothing here changes the card's settings (device METHOD.md): it only reads them.
"""

from __future__ import annotations

import statistics
import subprocess
from collections import Counter

import torch

BASIC = "clocks.sm,power.draw,temperature.gpu"
# why the clock is held down, where the driver knows the fields (580 does); dropped if the query is refused
REASONS = "clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown"


def _gpu_id(device: torch.device) -> str | None:
    try:
        return f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    except Exception:  # an old torch without uuid: the sampler is off rather than reading another GPU
        return None


class ClockSampler:
    """``with ClockSampler(device) as clocks: ...`` then ``clocks.summary()``; an empty summary with the reason
    where ``nvidia-smi`` is missing or refuses the query."""

    def __init__(self, device: torch.device, interval_ms: int = 20):
        self.device, self.interval_ms = device, interval_ms
        self.fields = BASIC
        self.error: str | None = None
        self.lines: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._id = _gpu_id(device) if device.type == "cuda" else None

    def _query(self, fields: str, loop: bool) -> list[str]:
        cmd = ["nvidia-smi", f"--id={self._id}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
        return cmd + [f"-lms={self.interval_ms}"] if loop else cmd

    def __enter__(self) -> ClockSampler:
        if self._id is None:
            self.error = "not a CUDA device, or no GPU uuid from torch"
            return self
        for fields in (f"{BASIC},{REASONS}", BASIC):
            try:
                probe = subprocess.run(self._query(fields, loop=False), capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.error = f"nvidia-smi: {exc}"
                return self
            if probe.returncode == 0:
                self.fields = fields
                break
            self.error = f"nvidia-smi refused --query-gpu={fields}: {probe.stdout.strip()[:200]}"
        else:
            return self
        self.error = None
        self._proc = subprocess.Popen(
            self._query(self.fields, loop=True), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.lines = [line for line in out.splitlines() if line.strip()]

    def summary(self) -> dict:
        if self.error:
            return {"error": self.error}
        names = self.fields.split(",")
        clocks, power, temps, active = [], [], [], Counter()
        for line in self.lines:
            values = [v.strip() for v in line.split(",")]
            if len(values) != len(names):
                continue
            try:
                clocks.append(float(values[0]))
                power.append(float(values[1]))
                temps.append(float(values[2]))
            except ValueError:  # "[N/A]" and the like
                continue
            for name, value in zip(names[3:], values[3:]):
                if value.lower() == "active":
                    active[name.rsplit(".", 1)[1]] += 1
        if not clocks:
            return {"error": f"no samples ({len(self.lines)} lines)"}
        ordered = sorted(clocks)
        return {
            "samples": len(clocks),
            "interval_ms": self.interval_ms,
            "sm_mhz_median": statistics.median(clocks),
            "sm_mhz_p10": ordered[len(ordered) // 10],
            "sm_mhz_min": ordered[0],
            "power_w_median": round(statistics.median(power), 1),
            "power_w_max": round(max(power), 1),
            "temp_c_max": max(temps),
            # samples in which the driver named each reason for holding the clock down
            "reasons_active": dict(active),
        }
