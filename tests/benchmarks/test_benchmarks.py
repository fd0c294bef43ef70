"""The benchmark driver's configuration labels (the GPU runs themselves are recorded in benchmarks/records)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time

import pytest
from helpers import REPO

sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "studies")]  # the harness, the studies
import run_all  # noqa: E402


def test_labels_carry_environment_settings_for_variants():
    assert run_all.parse_label("hf-fast") == ("hf-fast", {}, [], run_all.ROOT)
    assert run_all.parse_label("fusepatch+FUSEPATCH_CE_LOGITS_MIB=1024+X=a=b") == (
        "fusepatch",
        {"FUSEPATCH_CE_LOGITS_MIB": "1024", "X": "a=b"},
        [],
        run_all.ROOT,
    )
    assert run_all.parse_label("hf-fast+compile") == ("hf-fast", {}, ["--compile"], run_all.ROOT)
    with pytest.raises(ValueError, match="unknown configuration 'fusepach'"):
        run_all.parse_label("fusepach")
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        run_all.parse_label("fusepatch+1024")


def test_a_label_can_import_an_older_commits_package(tmp_path, monkeypatch):
    """``+code=REV``: the package comes from ``.code/REV/`` (a before/after pair in one run); a missing folder says
    how to make it instead of silently measuring the working tree's package."""
    monkeypatch.setattr(run_all, "ROOT", str(tmp_path))
    with pytest.raises(ValueError, match=re.escape("git archive abc123 fusepatch | tar -x -C .code/abc123")):
        run_all.parse_label("fusepatch+code=abc123")
    (tmp_path / ".code" / "abc123" / "fusepatch").mkdir(parents=True)
    base, env, flags, root = run_all.parse_label("fusepatch+fp8+code=abc123")
    assert (base, env, flags, root) == ("fusepatch", {}, ["--precision", "fp8"], str(tmp_path / ".code" / "abc123"))


def _train_step_on_cpu(tmp_path, config: str, *flags: str) -> dict:
    """``train_step.py`` on the tiny shape on the CPU, in this process (the harness's imports are most of a
    subprocess's time); its JSON result, which must hold no error."""
    import json
    from unittest import mock

    import train_step

    out = tmp_path / f"{config}.json"
    argv = ["train_step.py", "--config", config, "--shape", "tiny", "--device", "cpu", *flags, "--json-out", str(out)]
    with mock.patch.object(sys, "argv", argv):
        assert train_step.main() == 0
    result = json.loads(out.read_text())
    assert "error" not in result, result.get("traceback")
    return result


def test_varying_packed_and_prompt_masked_steps(tmp_path):
    """``--vary-seq``, ``--packed-docs`` and ``--prompt`` in one run. Varying lengths: the harness case the
    fixed-length tables missed (H200 run of 2026-11-29); the same draws for every configuration, tokens/s over all
    timed tokens and time, the slowest step in the table. Packed rows: K documents a row, new cut points every
    step, the same for every configuration, passed to the model as ``position_ids``. Prompt: the first F of every
    row's labels are -100, so the loss differs from the same run without it."""
    import math
    import random

    import train_step

    for length, docs in ((256, 4), (5, 9)):
        positions = train_step.packed_positions(length, docs, random.Random(0))
        assert positions.shape == (length,) and int((positions == 0).sum()) == min(docs, length)
        assert positions.tolist() == train_step.packed_positions(length, docs, random.Random(0)).tolist()
    flags = ("--steps", "3", "--warmup", "1", "--vary-seq", "0.5", "--packed-docs", "3")
    result = _train_step_on_cpu(tmp_path, "fusepatch", *flags, "--prompt", "0.5")
    draws = random.Random(1234)
    assert result["lengths"] == [draws.randint(128, 256) for _ in range(3)]
    seconds = sum(result["step_ms"]) / 1000
    assert (
        abs(result["tokens_per_s"] - result["batch"] * sum(result["lengths"]) / seconds) < 0.01 * result["tokens_per_s"]
    )
    assert result["max_step_ms"] == max(result["step_ms"])
    # host pauses over the timed steps: collections counted with their time (none on the allocator without CUDA)
    pauses = result["host_pauses"]
    assert pauses["timed_steps"] == 3 and pauses["allocator_over_timed_steps"] == {}
    assert set(pauses["gc_collections"]) == set(pauses["gc_ms"])
    assert {"busy_cores", "own_cores", "other_cores", "shared"} <= set(result["host_load"])  # Linux: /proc/stat
    row = run_all.table([result | {"config": "fusepatch"}]).splitlines()[-1]
    assert f"| {result['median_step_ms']} | {result['max_step_ms']} |" in row
    assert result["packed_docs"] == 3 and len(result["step_ms"]) == 3
    (tmp_path / "unmasked").mkdir()
    unmasked = _train_step_on_cpu(tmp_path / "unmasked", "fusepatch", *flags)
    assert result["prompt"] == 0.5 and "prompt" not in unmasked
    assert math.isfinite(result["losses"][0]) and result["losses"][0] != unmasked["losses"][0]


def _driver_args(workdir, timeout: int):
    """``run_all.run_one``'s arguments for one tiny-shape step, no warm-up, no workload options."""
    import argparse

    return argparse.Namespace(
        shape="tiny", steps=1, warmup=0, timeout=timeout, workdir=str(workdir), site_fla="", site_tl="", layers=None,
        checkpointing=False, vary_seq=0.0, packed_docs=0, prompt=0.0, sft=False, doc_tokens=1024, lora=0,
    )  # fmt: skip


def test_a_label_with_a_slash_gets_its_own_files(tmp_path):
    """``fusepatch+FUSEPATCH_SKIP=rms_norm/triton``: the label names files, so its '/' must not make a folder."""
    args = _driver_args(tmp_path, timeout=300)
    result = run_all.run_one("eager+FUSEPATCH_SKIP=rms_norm/triton", args)
    assert result["config"] == "eager+FUSEPATCH_SKIP=rms_norm/triton"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["tiny-eager+FUSEPATCH_SKIP=rms_norm_triton.json", "tiny-eager+FUSEPATCH_SKIP=rms_norm_triton.log"]


def test_a_configuration_cut_off_by_its_limit_keeps_what_it_printed(tmp_path, monkeypatch):
    """A compiled first step can outlast the limit (hf-fast + compile made none in 420 s on the H200): the row
    then names the heartbeat's last line (how far the step got) and the log keeps the whole output, where the
    driver used to keep only "timed out"."""
    import train_step

    # what dynamo made so far in this process: none here (a compile test before this one would have counted some)
    monkeypatch.setattr(train_step, "dynamo_made", lambda: {"unique_graphs": 0, "graph_breaks": 0})
    beat = train_step.Heartbeat(every=0.05)
    assert beat.line().endswith("first step: forward; dynamo: 0 graphs, 0 breaks")
    beat.mark("forward")
    assert "first step: backward" in beat.line()
    with beat:  # the thread writes its lines on stderr until the block ends
        time.sleep(0.2)
    beat.mark("optimizer")
    assert "] done;" in beat.line()

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "train_step.py").write_text(
        "import sys, time\n"
        "print('building', flush=True)\n"
        "print('[30 s] first step: backward; dynamo: 3 graphs, 1 breaks', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(run_all, "HERE", str(fake))
    args = _driver_args(tmp_path, timeout=3)
    result = run_all.run_one("hf-fast+compile", args)
    assert result["error"] == "timed out after 3s; last: [30 s] first step: backward; dynamo: 3 graphs, 1 breaks"
    log = (tmp_path / "tiny-hf-fast+compile.log").read_text()
    assert "building" in log and "3 graphs" in log


def test_gpu_idle_is_attributed_to_the_innermost_cpu_op_and_phase():
    """``gpu_idle_by_op`` on a hand-made trace: two gaps between three kernels (one of them under two
    overlapping kernels, which count as one busy span), each charged to the shortest CPU op covering its middle
    and to the ``bench:`` phase it fell in; the lead before the first kernel."""
    from types import SimpleNamespace as Event

    import step_diagnostics
    import torch

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, start, end, device=cpu, parent=None):
        return Event(name=name, time_range=Event(start=start, end=end), device_type=device, cpu_parent=parent)

    step = event("bench:step", 0, 1000)
    backward = event("bench:backward", 400, 900)
    layer = event("fusepatch::Qwen3_5GatedDeltaNet", 90, 850, parent=backward)  # a bench: caller is left out
    engine = event("autograd::engine::evaluate_function: MmBackward0", 100, 800, parent=layer)
    launch = event("aten::mm", 550, 650, parent=engine)
    events = [
        step,
        event("bench:forward", 0, 400),
        backward,
        layer,
        engine,
        launch,
        event("k1", 10, 200, cuda),
        event("k2", 150, 300, cuda),  # overlaps k1: one busy span 10-300
        event("k3", 500, 520, cuda),  # gap 300-500, middle 400: the forward's last instant, under the engine op
        event("k4", 700, 710, cuda),  # gap 520-700, middle 610: inside aten::mm, in the backward
    ]
    events.append(event("cudaMemcpyAsync", 560, 600, parent=launch))  # a wait inside the mm (as .item() would)
    events.append(event("cudaDeviceSynchronize", 1100, 1200))  # after the step: not one of its waits
    idle = step_diagnostics.gpu_idle_by_op(events)
    assert idle["host_waits"] == [
        [
            "cudaMemcpyAsync < aten::mm < autograd::engine::evaluate_function: MmBackward0 < "
            "fusepatch::Qwen3_5GatedDeltaNet",
            1,
            0.04,
        ]
    ]
    assert idle["gaps"] == 2 and idle["lead_ms"] == 0.01
    assert idle["gap_ms_total"] == 0.38
    assert idle["by_op"] == [  # the innermost op with its callers (up to three), outermost first
        ["fusepatch::Qwen3_5GatedDeltaNet > autograd::engine::evaluate_function: MmBackward0", 0.2, 1],
        ["fusepatch::Qwen3_5GatedDeltaNet > autograd::engine::evaluate_function: MmBackward0 > aten::mm", 0.18, 1],
    ]
    assert idle["by_phase"] == {"bench:forward": 0.2, "bench:backward": 0.18}
    assert idle["longest"] == [  # step order, ms from the step's start
        [0.3, 200.0, "fusepatch::Qwen3_5GatedDeltaNet > autograd::engine::evaluate_function: MmBackward0"],
        [0.52, 180.0, "fusepatch::Qwen3_5GatedDeltaNet > autograd::engine::evaluate_function: MmBackward0 > aten::mm"],
    ]
    assert idle["by_window_ms"] == {"0-10": 0.38}
    assert step_diagnostics.gpu_idle_by_op(events, longest_gaps=1)["longest"] == [idle["longest"][0]]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_norm_sweep_runs_every_configuration_in_the_interpreter(tmp_path):
    """``norm_sweep.py`` under Triton's CPU interpreter at two tokens: the library's default and one other
    configuration a site run the library's kernels through the module's own ``_blocks`` / ``BWD_STEPS`` and match
    the fp64 reference, and the default is among them for every site (so the GPU table can rank it)."""
    import json
    import subprocess

    out = tmp_path / "sweep.json"
    script = str(REPO / "benchmarks" / "studies" / "norm_sweep.py")
    root = str(REPO)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    cmd = [sys.executable, script, "--tokens", "2", "--reps", "1", "--at-most", "2", "--json-out", str(out)]
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(out.read_text())
    sites = {row["site"] for row in rows}
    assert len(sites) == 4 and all(any(r["default"] for r in rows if r["site"] == site) for site in sites)
    assert all(sum(r["site"] == site for r in rows) == 2 for site in sites)
    assert max(max(r["err_y"], r["err_dx"], r["err_dw"]) for r in rows) < 2e-2


def test_gemm_bench_sites_and_formulations():
    """The GEMM bench's sites count what fusepatch's step runs (the joined in_proj_b + a, not the separate pair,
    which is timed for comparison only), and every formulation of a role computes the same matrix."""
    import torch
    from gemm_bench import formulations, sites
    from shapes import SHAPES

    calls = {name: (k, n, c) for name, k, n, c in sites(SHAPES["27b"])}
    assert calls["gdn in_proj_b + a joined (fusepatch)"] == (5120, 96, 6)
    assert calls["gdn in_proj_b / a separate (hf; per GEMM, 2 a layer)"][2] == 0
    assert calls["mlp gate / up"] == (5120, 17408, 16) and calls["lm_head"] == (5120, 248320, 1)
    x, w, dy = (torch.randn(*s, dtype=torch.float64) for s in ((64, 32), (48, 32), (64, 48)))
    for forms in formulations(x, w, dy).values():
        first = next(iter(forms.values()))()
        for fn in forms.values():
            torch.testing.assert_close(fn(), first)


def _fake_nvidia_smi(tmp_path, monkeypatch, lines: str, refuse_reasons: bool = False) -> None:
    """An ``nvidia-smi`` on PATH that prints ``lines`` (and, asked for the clock-event reasons, exits 2 when
    ``refuse_reasons``, as a driver without those fields does)."""
    script = tmp_path / "nvidia-smi"
    refuse = 'case "$*" in *clocks_event_reasons*) echo "Field not valid"; exit 2;; esac\n' if refuse_reasons else ""
    script.write_text(f"#!/bin/sh\n{refuse}cat <<'END'\n{lines}\nEND\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_clock_sampler_reads_clock_power_and_reasons(tmp_path, monkeypatch):
    import gpu_clocks
    import torch

    monkeypatch.setattr(gpu_clocks, "_gpu_id", lambda device: "GPU-fake")
    _fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        "1980, 650.5, 61, Not Active, Not Active, Not Active\n1755, 700.1, 63, Active, Not Active, Not Active\n"
        "1830, 690.0, 62, Active, Not Active, Not Active\n[N/A], [N/A], 62, Active, Not Active, Not Active",
    )
    with gpu_clocks.ClockSampler(torch.device("cuda", 0), interval_ms=5) as clocks:
        clocks._proc.wait(timeout=30)  # the fake prints its lines and exits; the real one runs until stopped
    summary = clocks.summary()
    assert summary["samples"] == 3  # the [N/A] line is dropped
    assert summary["sm_mhz_median"] == 1830 and summary["sm_mhz_min"] == 1755
    assert summary["power_w_median"] == 690.0 and summary["power_w_max"] == 700.1
    assert summary["temp_c_max"] == 63
    assert summary["reasons_active"] == {"sw_power_cap": 2}


def test_clock_sampler_falls_back_to_the_basic_fields_and_says_when_it_cannot_sample(tmp_path, monkeypatch):
    import gpu_clocks
    import torch

    monkeypatch.setattr(gpu_clocks, "_gpu_id", lambda device: "GPU-fake")
    _fake_nvidia_smi(tmp_path, monkeypatch, "1500, 400, 50", refuse_reasons=True)
    with gpu_clocks.ClockSampler(torch.device("cuda", 0)) as clocks:
        clocks._proc.wait(timeout=30)
    assert clocks.fields == gpu_clocks.BASIC
    assert clocks.summary()["sm_mhz_median"] == 1500 and clocks.summary()["reasons_active"] == {}
    with gpu_clocks.ClockSampler(torch.device("cpu")) as off:
        pass
    assert "not a CUDA device" in off.summary()["error"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with gpu_clocks.ClockSampler(torch.device("cuda", 0)) as missing:
        pass
    assert missing.summary()["error"].startswith("nvidia-smi")


def test_back_to_back_times_each_step_between_the_events_around_it(monkeypatch):
    """``back_to_back``: one untimed step first, then each step's time is the span between the events recorded
    before it and after it (GPU time, here a fake clock that each step advances by its length in ms); no wait
    between steps (``sync`` only before and after); tokens/s over the summed time; the table's columns."""
    import torch
    import train_step

    clock = {"ms": 0.0}
    syncs = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, other):
            return other.at - self.at

    def step(length):
        clock["ms"] += length  # a step of `length` tokens takes `length` ms of GPU time
        return torch.tensor(float(length))

    monkeypatch.setattr(train_step.torch.cuda, "Event", Event)
    result = train_step.back_to_back(step, [100, 300, 200], batch=2, sync=lambda: syncs.append(clock["ms"]))
    assert syncs == [0.0, 700.0]  # before the untimed first step and after the last: none between steps
    assert result["b2b_step_ms"] == [100.0, 300.0, 200.0] and result["b2b_median_step_ms"] == 200.0
    assert result["b2b_tokens_per_s"] == round(2 * 600 / 0.6, 1) and result["b2b_losses"] == [100.0, 300.0, 200.0]
    base = {"config": "hf-fast", "tokens_per_s": 1.0, "median_step_ms": 1, "step_ms": [1], "peak_mem_gib": 1,
            "aten_ops_per_step": 1, "gpu_kernels_per_step": 1, "gpu_busy_fraction": 1.0, "mfu": 0.5,
            "b2b_tokens_per_s": 1000.0, "b2b_median_step_ms": 2}  # fmt: skip
    row = run_all.table([base, base | {"config": "fusepatch"} | result]).splitlines()[-1]
    assert "| 2,000 | 2.000x | 200.0 |" in row


def test_trainer_loop_times_steps_that_wait_after_the_backward(monkeypatch):
    """``trainer_loop``: the back-to-back timing of steps told to wait after their backward (where the Trainer's
    NaN/inf filter waits), its own keys, and its own table columns beside the back-to-back ones."""
    import torch
    import train_step

    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = len(calls)

        def elapsed_time(self, other):
            return (other.at - self.at) * 100.0

    def step(length, wait_after_backward=False):
        calls.append((length, wait_after_backward))
        return torch.tensor(1.0)

    monkeypatch.setattr(train_step.torch.cuda, "Event", Event)
    result = train_step.trainer_loop(step, [10, 10], batch=1, sync=lambda: None)
    assert calls == [(10, True)] * 3  # the untimed first step waits too
    assert result["trainer_step_ms"] == [100.0, 100.0] and result["trainer_tokens_per_s"] == 100.0
    assert not any(key.startswith("b2b") for key in result)
    base = {"config": "hf-fast", "tokens_per_s": 1.0, "median_step_ms": 1, "step_ms": [1], "peak_mem_gib": 1,
            "aten_ops_per_step": 1, "gpu_kernels_per_step": 1, "gpu_busy_fraction": 1.0, "mfu": 0.5,
            "b2b_tokens_per_s": 50.0, "b2b_median_step_ms": 2, "trainer_tokens_per_s": 80.0,
            "trainer_median_step_ms": 3}  # fmt: skip
    lines = run_all.table([base, base | {"config": "fusepatch"} | result]).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[-1].count("|")
    assert "| 50 | 1.000x | 2 | 100 | 1.250x | 100.0 |" in lines[-1]
    failed = run_all.table([base, {"config": "liger", "error": "boom"}]).splitlines()[-1]
    assert failed.count("|") == lines[0].count("|")


def test_memory_by_phase_reads_each_phase_peak_apart():
    """``memory_by_phase``: the allocator's peak is reset at every boundary (the decoder stack's end through a
    forward hook on ``body``, then the step's own marks), so each phase reports its own peak and what is left at
    its end; the hook is passive for fusepatch and removed after; run_all prints the phases and the peak's."""
    import step_diagnostics
    import torch

    memory = {"now": 10.0, "peak": 10.0}

    def alloc(gib: float) -> None:
        memory["now"] += gib
        memory["peak"] = max(memory["peak"], memory["now"])

    def reset():
        memory["peak"] = memory["now"]

    body = torch.nn.Identity()
    seen = []

    def step(length, at):
        seen.append(length)
        alloc(5.0)  # saved activations
        body(torch.zeros(1))  # the decoder stack ends: "layers"
        alloc(3.0)  # the loss's logits chunk, freed before the loss returns
        alloc(-3.0)
        at("forward")
        alloc(2.0)  # gradients, then the activations freed
        alloc(-5.0)
        at("backward")
        alloc(-2.0)
        at("optimizer")

    gib = 2**30
    result = step_diagnostics.memory_by_phase(
        step, 64, sync=lambda: None, body=body,
        allocated=lambda: memory["now"] * gib, peak=lambda: memory["peak"] * gib, reset=reset,
    )  # fmt: skip
    assert seen == [64]
    assert result["memory_by_phase"] == {
        "start_gib": 10.0,
        "layers": {"peak_gib": 15.0, "end_gib": 15.0},
        "loss": {"peak_gib": 18.0, "end_gib": 15.0},
        "backward": {"peak_gib": 17.0, "end_gib": 12.0},
        "optimizer": {"peak_gib": 12.0, "end_gib": 10.0},
    }
    assert result["peak_phase"] == "loss"
    assert not body._forward_hooks  # removed
    # without a body the first phase is the whole forward
    memory.update(now=10.0, peak=10.0)
    plain = step_diagnostics.memory_by_phase(
        step, 64, sync=lambda: None,
        allocated=lambda: memory["now"] * gib, peak=lambda: memory["peak"] * gib, reset=reset,
    )  # fmt: skip
    assert list(plain["memory_by_phase"]) == ["start_gib", "forward", "backward", "optimizer"]
    assert plain["memory_by_phase"]["forward"]["peak_gib"] == 18.0
    text = run_all.memory_lines([{"config": "fusepatch"} | result, {"config": "liger", "error": "boom"}])
    assert (
        "- fusepatch: layers 15.0 / 15.0, loss 18.0 / 15.0, backward 17.0 / 12.0, optimizer 12.0 / 10.0; the peak in loss"
        in text
    )
    assert "liger" not in text and run_all.memory_lines([{"config": "liger", "error": "boom"}]) == ""


class _FakeTimeline:
    """``step_diagnostics.CudaTimeline``'s interface over a GPU clock the test advances: a mark is the GPU time at
    which the work queued so far ends; ``passed`` says whether the GPU got past a mark before the CPU finished."""

    def __init__(self, sleeps_through: bool = True) -> None:
        self.queued_ms = 0.0
        self.completed_ms = 0.0  # what a sync has seen finish
        self.slept = []
        self.sleeps_through = sleeps_through

    def sleep(self, ms: float) -> None:
        self.slept.append(ms)
        self.queued_ms += ms

    def mark(self) -> float:
        return self.queued_ms

    def sync(self) -> None:
        self.completed_ms = self.queued_ms

    def between(self, start: float, end: float) -> float:
        if end > self.completed_ms:  # as CUDA events: no time before the GPU has reached both
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end - start

    def passed(self, mark: float) -> bool:
        return not self.sleeps_through


def test_host_time_by_phase_reads_the_cpu_and_the_gpu_apart():
    """``host_time_by_phase``: each phase's host time is the CPU clock across it, its GPU time the events around
    it, each phase queued behind its own sleep (calibrated first, outside the step) except the preamble before
    the decoder stack (host time only); layer classes' forward host time through passive hooks, nested ones
    included in their parents, every hook removed after; a phase is not clean when the GPU was past its sleep
    before the CPU had queued it; run_all prints it all."""
    import step_diagnostics
    import torch

    now = [100.0]

    class Layer(torch.nn.Module):
        def __init__(self, cost: float, kernels_ms: float, inner=None) -> None:
            super().__init__()
            self.cost, self.kernels_ms, self.inner = cost, kernels_ms, inner

        def forward(self, x):
            now[0] += self.cost
            gpu[0].queued_ms += self.kernels_ms
            return self.inner(x) if self.inner is not None else x

    mixer = Layer(0.004, 1.0)
    decoder = Layer(0.001, 0.5, inner=mixer)
    body = torch.nn.Sequential(decoder, decoder)
    gpu = [_FakeTimeline()]  # the timeline the step queues its kernels on

    def step(length, at):
        now[0] += 0.0003  # the preamble's host work
        gpu[0].queued_ms += 0.1
        body(torch.zeros(length))  # the layers' kernels: 2 x (0.5 + 1.0) ms
        now[0] += 0.001
        gpu[0].queued_ms += 2.0  # the loss's
        at("forward")
        now[0] += 0.002
        gpu[0].queued_ms += 9.0
        at("backward")
        now[0] += 0.0005
        gpu[0].queued_ms += 1.5
        at("optimizer")

    timeline = gpu[0]
    result = step_diagnostics.host_time_by_phase(
        step, 8, sync=timeline.sync, body=body, layers=[decoder, mixer], sleep_ms=500.0, gpu=timeline,
        clock=lambda: now[0],
    )["host_vs_gpu"]  # fmt: skip
    assert timeline.slept == [0.0, 500.0, 500.0, 500.0, 500.0, 500.0]  # calibration, then one before each phase
    assert result["phases"] == {
        "preamble": {"host_ms": 0.3, "gpu_ms": None, "clean": True},
        "layers": {"host_ms": 10.0, "gpu_ms": 3.0, "clean": True},
        "loss": {"host_ms": 1.0, "gpu_ms": 2.0, "clean": True},
        "backward": {"host_ms": 2.0, "gpu_ms": 9.0, "clean": True},
        "optimizer": {"host_ms": 0.5, "gpu_ms": 1.5, "clean": True},
    }
    assert result["forward_host_by_layer_ms"] == {"Layer": [18.0, 4]}  # 2 x (5 + 4): the parent includes its child
    for module in (body, decoder, mixer):
        assert not module._forward_hooks and not module._forward_pre_hooks

    woken = gpu[0] = _FakeTimeline(sleeps_through=False)
    found = step_diagnostics.host_time_by_phase(step, 8, sync=woken.sync, gpu=woken, clock=lambda: now[0])
    assert woken.slept == [0.0, 1000.0, 1000.0, 1000.0, 1000.0]  # no body: the forward behind a sleep too (default)
    assert list(found["host_vs_gpu"]["phases"]) == ["forward", "backward", "optimizer"]
    assert found["host_vs_gpu"]["phases"]["forward"] == {"host_ms": 11.3, "gpu_ms": 5.1, "clean": False}
    assert found["host_vs_gpu"]["forward_host_by_layer_ms"] == {}
    text = run_all.host_lines(
        [
            {"config": "fusepatch", "host_vs_gpu": result},
            {"config": "hf-fast"} | found,
            {"config": "x", "error": "e"},
            {"config": "liger", "host_vs_gpu_error": "RuntimeError: boom"},
        ]
    )
    assert (
        "- fusepatch: preamble 0.3 / -, layers 10.0 / 3.0, loss 1.0 / 2.0, backward 2.0 / 9.0, optimizer 0.5 / 1.5;"
        " forward host ms by layer (calls): Layer 18.0 (4)" in text
    )
    assert "- hf-fast: forward 11.3 / 5.1 (waited for the GPU), backward 2.0 / 9.0 (waited for the GPU)," in text
    assert "- liger: not measured (RuntimeError: boom)" in text
    assert "- x" not in text and run_all.host_lines([{"config": "x"}]) == ""
    waited = {**result, "phases": {**result["phases"], "layers": {**result["phases"]["layers"], "clean": False}}}
    text = run_all.host_lines([{"config": "fp8", "host_vs_gpu": waited}])
    assert (
        "forward host ms by layer (calls) (the forward waited for the GPU: a class's time includes that wait)" in text
    )


def test_host_profile_ranks_the_stack_forwards_python_by_function():
    """``host_profile`` (BENCH_HOST_PROFILE=1): cProfile over the decoder stack's forward only (not the rest of
    the step), behind a GPU sleep calibrated first; functions ranked by self time with their calls, self time
    summed by package; its hooks removed after; run_all prints the ranking, or why there is none."""
    import step_diagnostics
    import torch

    def slow_part(x):
        total = 0
        for i in range(20000):
            total += i
        return x

    def outside_the_stack():
        return sum(range(50000))

    class Layer(torch.nn.Module):
        def forward(self, x):
            return slow_part(x)

    body = torch.nn.Sequential(Layer(), Layer())
    timeline = _FakeTimeline()

    def step(length):
        outside_the_stack()
        body(torch.zeros(length))
        outside_the_stack()

    found = step_diagnostics.host_profile(step, 8, sync=timeline.sync, body=body, sleep_ms=700.0, gpu=timeline)
    profile = found["host_profile"]
    assert timeline.slept == [0.0, 700.0]
    assert profile["clean"] is True and profile["forward_ms"] > 0
    names = {row[0]: row for row in profile["self"]}
    slow = next(row for name, row in names.items() if name.endswith("(slow_part)"))
    assert slow[3] == 2 and slow[1] > 0  # two layers, one call each
    assert not any(name.endswith("(outside_the_stack)") for name in names)
    assert profile["by_package_ms"].keys() & {"tests", "benchmarks", "other"}  # this file's functions, by its folder
    assert not body._forward_hooks and not body._forward_pre_hooks
    text = run_all.profile_lines([{"config": "fusepatch"} | found, {"config": "x", "host_profile_error": "E: boom"}])
    assert "- fusepatch: forward " in text and "(slow_part)" in text
    assert "- x: not profiled (E: boom)" in text and run_all.profile_lines([{"config": "y"}]) == ""
    assert step_diagnostics._package("/a/site-packages/fla/ops/x.py") == "fla"
    assert step_diagnostics._package("~") == "builtins"


def test_host_syncs_names_each_wait_by_phase_and_the_code_that_asked(monkeypatch):
    """``host_syncs``: one more step under torch's sync debug mode, every synchronizing call and explicit event
    synchronize counted by phase (forward, backward, optimizer) and by the innermost code outside torch that made
    it; other warnings pass through; the debug mode and the wrapped synchronizes are put back after."""
    import warnings

    import step_diagnostics
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": len(modes)})
    waited = []
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waited.append(self))
    unwrapped = torch.cuda.Event.synchronize

    def reads_a_count():  # as a .item() in library code: torch warns from inside the op
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    def step(length, at):
        for _ in range(2):  # one site, twice
            reads_a_count()
        at("forward")
        torch.cuda.Event.synchronize(object())
        warnings.warn("something else", DeprecationWarning, stacklevel=1)
        at("backward")
        reads_a_count()
        at("optimizer")

    with warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("always")
        found = step_diagnostics.host_syncs(step, 8, sync=lambda: None)["host_syncs"]
    assert found["by_phase"] == {"forward": 2, "backward": 1, "optimizer": 1}
    sites = dict(found["sites"])
    forward = next(k for k in sites if k.startswith("forward: sync op at ") and "reads_a_count" in k)
    assert sites[forward] == 2 and "test_benchmarks.py:" in forward
    assert any(k.startswith("backward: event.synchronize at ") and " step" in k for k in sites)
    assert [str(w.message) for w in other] == ["something else"]
    assert modes == ["warn", 0] and found["allocator_retries"] == 2  # the stub: a retry per mode set
    assert torch.cuda.Event.synchronize is unwrapped and len(waited) == 1
    text = run_all.sync_lines([{"config": "fp8", "host_syncs": found}, {"config": "x", "host_syncs_error": "E"}])
    assert "- fp8: forward 2, backward 1, optimizer 1; allocator retries 2" in text and "- x: not read (E)" in text


def test_host_syncs_counts_a_stream_synchronize_once(monkeypatch):
    """A stream's ``synchronize`` is one wait: torch's sync debug mode warns inside it (c10's
    ``stream_synchronize``), and that warning is the wrapped call's own, not a second wait. Warnings other than
    the debug mode's keep the filters they had (an ignored one stays ignored)."""
    import warnings

    import step_diagnostics
    import torch

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})

    def stream_synchronize(self):  # as torch's: the debug mode's warning from inside the call
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at x.h:1.)", stacklevel=1)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", stream_synchronize)

    def step(length, at):
        torch.cuda.Stream.synchronize(object())
        warnings.warn("quiet", DeprecationWarning, stacklevel=1)
        at("forward")

    with warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("ignore", DeprecationWarning)
        found = step_diagnostics.host_syncs(step, 8, sync=lambda: None)["host_syncs"]
    assert other == []
    assert found["by_phase"] == {"forward": 1}
    assert [site.split(" at ")[0] for site, _ in found["sites"]] == ["forward: stream.synchronize"]


def test_host_syncs_puts_back_what_it_wrapped_when_a_wrap_fails(monkeypatch):
    """A synchronize that cannot be wrapped (here: a read-only attribute) fails the diagnostic, and the ones
    wrapped before it are put back: the process's later steps call torch's own."""
    import step_diagnostics
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: None)

    class ReadOnly:
        synchronize = property(lambda self: lambda: None)

    monkeypatch.setattr(torch.cuda, "Stream", ReadOnly())
    device, event = torch.cuda.synchronize, torch.cuda.Event.synchronize
    with pytest.raises(AttributeError):
        step_diagnostics.host_syncs(lambda length, at: None, 8, sync=lambda: None)
    assert torch.cuda.synchronize is device and torch.cuda.Event.synchronize is event
    assert modes in ([], [0])  # the debug mode, if it was set, is back too


def test_host_syncs_sites_skip_torch_but_not_packages_named_like_it():
    """A site's frames leave out torch's own files, not those of torchao (or any package whose folder name
    starts with "torch")."""
    import traceback

    import step_diagnostics
    import torch

    site = os.path.dirname(torch.__file__)
    stack = traceback.StackSummary.from_list(
        [("/a/train.py", 3, "step", None), (site + "ao/float8/linear.py", 7, "forward", None)]
        + [(os.path.join(site, "nn", "modules", "module.py"), 9, "_call_impl", None)]
    )
    assert step_diagnostics._site(stack) == "linear.py:7 forward < train.py:3 step"


def test_registry_modules_are_the_registry_classes_in_the_model():
    """``fusepatch.diagnostics.profile.registry_modules`` (the benchmark's host-time hooks and the profiler's labels): the
    modules whose class the registry names."""
    from fusepatch.diagnostics.profile import registry_modules
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3")
    found = {type(m).__name__ for m in registry_modules(model)}
    assert "Qwen3DecoderLayer" in found and "Qwen3MLP" in found and "Linear" not in found


def test_host_load_tells_other_processes_cpu_from_the_benchmarks_own():
    """A child spinning on a core while the benchmark sleeps is other processes' load; the benchmark spinning itself
    is its own. (On a host too busy to give the child a core the first half could not show it: the run would
    then be marked shared anyway, which is the point.)"""
    import subprocess
    import time

    import host_load

    spin = "import time\nend = time.perf_counter() + 0.6\nwhile time.perf_counter() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.05)  # the child is running before the window opens
    with host_load.HostLoad() as load:
        time.sleep(0.4)
    child.wait(timeout=30)
    other = load.summary()
    assert other["cores"] == os.cpu_count()
    assert other["own_cores"] < 0.2, other
    assert other["other_cores"] >= 0.5 and other["shared"] is (other["other_cores"] >= host_load.SHARED_CORES), other

    outer = time.perf_counter()  # a wall time at least the block's
    with host_load.HostLoad() as load:
        spun = time.thread_time()
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:
            pass
        spun = time.thread_time() - spun  # the CPU the scheduler gave the spin (less than 0.4 s on a busy host)
    outer = time.perf_counter() - outer
    own = load.summary()
    # the spin's CPU time is the benchmark's own, whatever else the host ran (a CI host once gave it half a core)
    assert spun > 0.04 and own["own_cores"] >= spun / outer - 0.02, (spun, outer, own)
    assert own["busy_cores"] >= own["own_cores"] - 0.1, own  # its own time is part of every core's busy time


def test_host_load_lines_mark_a_shared_host_and_say_when_unmeasured():
    quiet = {"cores": 16, "busy_cores": 1.2, "own_cores": 1.1, "other_cores": 0.1, "load_1min": 1.3, "shared": False}
    busy = {**quiet, "busy_cores": 9.0, "other_cores": 7.9, "load_1min": 17.0, "shared": True}
    text = run_all.load_lines(
        [
            {"config": "fusepatch", "host_load": quiet},
            {"config": "hf-fast", "host_load": busy},
            {"config": "liger", "host_load": {"error": "no /proc/stat on this system"}},
            {"config": "eager"},  # a result from before the field: no line
        ]
    )
    lines = text.strip().splitlines()
    assert lines[0].startswith("Host CPU over the synced steps")
    assert lines[1] == ("- fusepatch: 1.2 of 16 cores busy, this process 1.1, other processes 0.1; load average 1.3")
    assert lines[2].endswith("other processes 7.9; load average 17.0 **shared host**")
    assert lines[3] == "- liger: not measured (no /proc/stat on this system)"
    assert len(lines) == 4
    assert run_all.load_lines([{"config": "eager"}]) == ""


def test_step_start_probe_stamps_with_passive_hooks_and_restores_everything():
    """The probe's stamps (benchmarks/studies/step_start.py) come from passive hooks, which fusepatch's fused
    paths do not step aside for (its first H200 runs used plain hooks: a hooked MLP left the residual-in-GEMM path), and from
    wrappers that are gone after the block, as the hooks are."""
    import torch
    from step_start import instrument
    from triton.runtime.jit import JITFunction

    import fusepatch
    from fusepatch.engine.resolve import Dispatch
    from fusepatch.layers.support.hooks import _active
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text")
    fusepatch.apply(model)
    seen: list[str] = []
    originals = (Dispatch.__call__, JITFunction.run, torch.nn.functional.linear)
    with instrument(model, seen.append):
        mlp = model.model.layers[0].mlp
        assert mlp._forward_hooks and not _active(mlp._forward_hooks) and not _active(mlp._forward_pre_hooks)
        ids = torch.randint(0, 100, (1, 9))
        model(input_ids=ids, labels=ids)
    assert seen[0] == "causal_lm >" and "L0.linear_attn >" in seen and "linear" in seen
    assert any(point.startswith("op ") for point in seen)  # the dispatchers (eager choices on CPU) are stamped
    assert (Dispatch.__call__, JITFunction.run, torch.nn.functional.linear) == originals
    assert not model.model.layers[0].mlp._forward_hooks and not model._forward_pre_hooks


def test_sft_rows_are_flattened_documents_with_masked_prompts():
    """``sft_rows.packed_batch``: documents fill the row exactly; positions restart at each; every label of a
    prompt turn and the first of every document are -100, every assistant label is the token; the flash varlen
    arguments and ``seq_idx`` match the documents; the mean length follows ``doc_tokens``."""
    import random
    import statistics

    import sft_rows
    import torch

    batch = sft_rows.packed_batch(4096, 512, 100, random.Random(0), "cpu")
    ids, labels, positions, cu = batch["input_ids"], batch["labels"], batch["position_ids"], batch["cu_seq_lens_q"]
    assert ids.shape == labels.shape == positions.shape == (1, 4096)
    assert cu[0] == 0 and cu[-1] == 4096 and len(cu) == batch["documents"] + 1 > 2
    starts = cu[:-1].tolist()
    assert (positions[0] == 0).nonzero().flatten().tolist() == starts
    assert batch["max_length_q"] == int((cu[1:] - cu[:-1]).max())
    seq_idx = batch["seq_idx"]
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == (1, 4096)
    assert seq_idx[0].bincount().tolist() == (cu[1:] - cu[:-1]).tolist()  # each token's document, in order
    assert bool((seq_idx[0, 1:] >= seq_idx[0, :-1]).all())
    assert all(labels[0, s] == -100 for s in starts)
    kept = labels != -100
    assert torch.equal(labels[kept], ids[kept]) and 0.5 < batch["labelled"] / 4096 < 0.9  # the sample: 26% prompt
    lengths = [sum(t for _, t in d) for d in sft_rows.documents(200_000, 512, random.Random(1))]
    assert abs(statistics.mean(lengths[:-1]) - 512) < 40


def test_sft_lora_steps(tmp_path, monkeypatch):
    """``--sft`` (flattened chat rows) and ``--lora`` in one CPU run, in this process (the harness's own imports
    are most of a subprocess's time): the step trains only the adapters, reports the LoRA linears fusepatch
    found, the sample's shape and the first step's time."""
    import json

    import train_step

    out = tmp_path / "sft-lora.json"
    argv = ["train_step.py", "--config", "fusepatch", "--shape", "tiny", "--device", "cpu", "--seq", "128"]
    argv += ["--steps", "1", "--warmup", "1", "--sft", "--doc-tokens", "48", "--lora", "4", "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert train_step.main() == 0
    result = json.loads(out.read_text())
    assert "error" not in result, result.get("traceback")
    assert result["lora_rank"] == 4 and result["lora"]["linears"] == result["lora"]["fusable"] > 0
    assert 0 < result["trainable"] < result["params"]
    assert result["sft"]["doc_tokens"] == 48 and result["sft"]["conversations"] == 24
    assert result["first_step_s"] > 0 and result["first_step_builds"] == 0


def test_kernel_split_names_gemms_optimizer_and_the_rest():
    from step_diagnostics import kernel_split

    kernels = [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 5.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 3.0),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 2.0),
        ("chunk_gated_delta_rule_fwd_kernel_h", 1.5),
        ("rms_norm_fwd", 0.5),
    ]
    split = kernel_split(kernels)
    assert (split["gemm_ms"], split["optimizer_ms"], split["rest_ms"]) == (8.0, 2.0, 2.0)
    assert [name for name, _ in split["rest_top"]] == ["chunk_gated_delta_rule_fwd_kernel_h", "rms_norm_fwd"]


@pytest.mark.parametrize("setup", ["transformers", "fusepatch", "fusepatch-lora"])
def test_graph_layers_stands_each_layer_in_with_the_arguments_of_a_real_call(monkeypatch, setup):
    """``--graph-layers``: every decoder layer is called as a function of the hidden states and the rotary tables,
    with the rest of its arguments as one real step passed them, and the model's loop still runs over them (the
    layer kinds it reads). Under LoRA the first layer's input needs no gradient (the embedding is frozen), and
    its sample says so. Nothing of the recorded step's autograd graph may be alive when the capture starts
    (a kept node made the H200 capture fail). The capture itself needs CUDA: here it is the identity, so the
    model must compute exactly what it did."""
    import copy
    import gc
    import weakref

    import peft
    import torch
    import train_step

    import fusepatch
    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text").train()
    if setup == "fusepatch-lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear"))
    if setup != "transformers":
        fusepatch.apply(model, verbose=False)
    before = copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 24))
    given, inner = [], []
    stack = model.get_base_model().model if setup == "fusepatch-lora" else model.model
    # a hidden state inside the step's autograd graph: it must be gone when the capture starts
    hook = stack.layers[2].register_forward_pre_hook(lambda module, args: inner.append(weakref.ref(args[0])))

    def graphed(calls, samples):
        gc.collect()
        assert inner and inner[0]() is None, "the step's autograd graph outlived it"
        given.extend(samples)
        return calls

    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()  # the layers' parameters get their AccumulateGrad nodes, as in a training step

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", graphed)
    assert train_step.graph_layers(model, step) == 4
    hook.remove()
    config = model.config
    assert [s[0].shape for s in given] == [(2, 24, config.hidden_size)] * 4
    assert [s[0].requires_grad for s in given] == [setup != "fusepatch-lora", True, True, True]
    assert not any(s[1].requires_grad or s[2].requires_grad for s in given)
    assert [layer.block_type for layer in stack.layers] == config.layer_types
    for run in (before, model):
        run.zero_grad(set_to_none=True)
    want, got = (m(input_ids=ids, labels=ids, use_cache=False) for m in (before, model))
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    grads = {n: p.grad for n, p in before.named_parameters() if p.grad is not None}
    found = {n.replace(".call.layer.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert found.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(found[name], grad, rtol=0, atol=0, msg=name)


def test_render_compares_each_workload_with_hf_fast_of_its_own_run():
    """``render.speed``: every configuration of a workload (shape, LoRA, packed SFT) from its newest run, ``+quick``
    dropped from the labels (it leaves only views out), each ratio against hf-fast of that same run (a row only
    an older run has keeps that run's ratio); a workload without hf-fast gets no ratio rather than an error (it
    raised before)."""
    import render

    def row(config, tok, code, **extra):
        base = dict(benchmark="train_step", shape="2b", layers=24, seq=2048, batch=4, date="2026-12-03", gpu="H200")
        return base | dict(config=config, code=code, tokens_per_s_synced=tok, tokens_per_s_back_to_back=tok,
                           tokens_per_s_trainer_loop=tok, peak_gib=1.0, record="r.jsonl") | extra  # fmt: skip

    rows = [
        row("hf-fast", 100, "old"),
        row("fusepatch", 150, "old"),
        row("liger", 90, "old"),
        row("hf-fast+quick", 200, "new"),
        row("fusepatch", 300, "new"),
        row("fusepatch+compile+quick", 330, "new"),
        row("fusepatch+quick", 120, "new", lora_rank=16),
        row("fusepatch+cudagraphs+quick", 310, "new", peak_reserved_gib=2.5),
    ]
    lines = render.speed(rows)
    plain = [line for line in lines if line.startswith("| 2b (24 layers, seq 2048, batch 4) |")]
    assert [line.split(" | ")[1:4] for line in plain] == [
        ["fusepatch", "300", "1.50x"],
        ["fusepatch+compile", "330", "1.65x"],
        ["fusepatch+cudagraphs", "310", "1.55x"],
        ["hf-fast", "200", "1.00x"],
        ["liger", "90", "0.90x"],
    ]
    graphs = next(line for line in plain if "cudagraphs" in line)
    assert " | 1.0 | 2.5 | " in graphs and " | 1.0 | - | " in plain[0]  # graph pools show in the reserved peak
    lora = [line for line in lines if "LoRA r16" in line]
    assert len(lora) == 1 and " | 120 | - | " in lora[0]


def test_library_graphs_reports_what_apply_captured(monkeypatch, chunked_on_cpu):
    """``--cuda-graphs`` rows say whether the library's graphs were in use: one capture of every layer after three
    steady steps (here with the CPU stand-in for a CUDA graph)."""
    import torch
    import train_step

    import fusepatch
    from fusepatch.layers import layer_graphs
    from fusepatch.tools.tiny import tiny_model

    monkeypatch.setattr(layer_graphs, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(layer_graphs, "GRAPH", layer_graphs._Rerun)
    model = tiny_model("qwen3_5_text").train()
    fusepatch.apply(model, cuda_graphs=True, verbose=False)
    assert train_step.library_graphs(model) == {"captures": 0, "layers": 4, "disabled": False}
    ids = torch.randint(0, 512, (2, 24))
    for _ in range(3):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert train_step.library_graphs(model) == {"captures": 1, "layers": 4, "disabled": False}


def test_fidelity_fp8_projections_run_fusepatchs_fp8_function_on_the_decoder_projections():
    """``fidelity.py``'s ``fp8-projections``: exactly the projections ``apply(precision="fp8")`` trains go through
    the FP8 function (the gates, the LM head and the rest stay), the loss moves by FP8's rounding only, and each
    projection's gradient error is grouped under its name."""
    import fidelity
    import torch

    from fusepatch.tools.tiny import tiny_model

    model = tiny_model("qwen3_5_text").to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids).loss.item()
    count = fidelity.fp8_projections(model)
    patched = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    assert count == len(patched) > 0
    assert {n.rpartition(".")[2] for n in patched} <= {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert not any(n.endswith(("in_proj_a", "in_proj_b", "lm_head")) for n in patched)
    got = model(input_ids=ids, labels=ids).loss.item()
    assert got != want and abs(got - want) <= 0.05 * abs(want)
    errors = {
        "model.layers.0.mlp.up_proj.weight": 0.2,
        "model.layers.1.mlp.up_proj.weight": 0.4,
        "model.layers.2.mlp.up_proj.weight": 0.3,
        "model.norm.weight": 9.0,
        "lm_head.weight": 9.0,
    }
    assert fidelity.projection_medians(errors) == {"up_proj": 0.3}


def test_fidelity_projection_ratios_are_fp8_over_its_bf16_twin():
    import fidelity

    results = {
        "hf-fast": {
            "errors": {"model.layers.0.mlp.up_proj.weight": 0.02, "model.layers.0.self_attn.q_proj.weight": 0.05}
        },
        "fp8-projections": {
            "errors": {"model.layers.0.mlp.up_proj.weight": 0.2, "model.layers.0.self_attn.q_proj.weight": 0.4}
        },
    }
    ratios = fidelity.projection_ratios(results)
    assert ratios == {"fp8-projections": {"base": "hf-fast", "up_proj": 0.2 / 0.02, "q_proj": 0.4 / 0.05}}
    assert "| up_proj | 0.0200 | 0.2000 | 10.0x |" in fidelity.projection_table(results)
    # apply's FP8 against apply in bf16, where both ran: the same kernels but the projections
    results["fusepatch"] = {"errors": {"model.layers.0.mlp.up_proj.weight": 0.04}}
    results["fusepatch-fp8"] = {"errors": {"model.layers.0.mlp.up_proj.weight": 0.2}}
    assert fidelity.projection_ratios(results)["fusepatch-fp8"] == {"base": "fusepatch", "up_proj": 0.2 / 0.04}


def test_fidelity_driver_reads_projection_names_where_fusepatch_is_not_installed(tmp_path):
    """The GPU harness runs ``python benchmarks/studies/fidelity.py`` from the working tree with fusepatch
    importable only there: the driver's projection table must find it (its workers get the tree on their path; the driver too)."""
    import subprocess

    script = REPO / "benchmarks" / "studies" / "fidelity.py"
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()\n"
        "                    and 'editable' not in getattr(f, '__name__', '').lower()]\n"
        f"sys.path[:] = [p for p in sys.path if p and not {str(REPO)!r}.startswith(p)]\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('fidelity', {str(script)!r})\n"
        "fidelity = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(fidelity)\n"
        "print(fidelity.projection('model.layers.0.mlp.down_proj.weight'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["down_proj"]


def test_gemm_bench_fp8_formulations_compute_each_roles_matrix_from_fp8_operands(monkeypatch):
    """``gemm_bench.py --fp8``: every formulation of a role lands within FP8's error of the fp32 product (the op's
    own call first), and the bf16 GEMM beside them within bf16's; the LM head and the gates are not FP8 sites."""
    import torch
    from gemm_bench import FP8_SKIPS, fp8_formulations, fp32_product, relative_error, sites
    from shapes import SHAPES

    skipped = [name for name, *_ in sites(SHAPES["27b"]) if name.startswith(FP8_SKIPS)]
    assert skipped == [
        "gdn in_proj_b / a separate (hf; per GEMM, 2 a layer)",
        "gdn in_proj_b + a joined (fusepatch)",
        "lm_head",
    ]
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in ((64, 32), (48, 32), (64, 48)))
    forms = fp8_formulations(x, w, dy)
    assert list(forms) == ["forward y = x @ W.t()", "input grad dx = dy @ W", "weight grad dW = dy.t() @ x"]
    scaled_mm, accumulation = torch._scaled_mm, []

    def seen(*args, **kwargs):
        accumulation.append(kwargs.get("use_fast_accum", False))
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", seen)
    for role, calls in forms.items():
        expected = fp32_product(role, x, w, dy)
        assert list(calls) == ["fp8 as fusepatch calls it", "fp8 without use_fast_accum", "bf16 mm"]
        errors = {}
        for form, fn in calls.items():
            accumulation.clear()
            errors[form] = relative_error(fn(), expected)
            expected_accumulation = {"fp8 as fusepatch calls it": [True], "fp8 without use_fast_accum": [False]}
            assert accumulation == expected_accumulation.get(form, [])
        assert errors["bf16 mm"] < 1e-2, errors
        assert all(0.005 < e < 0.1 for form, e in errors.items() if form != "bf16 mm"), errors


def test_fast_accum_variant_makes_fast_accumulation_the_default_of_scaled_mm(monkeypatch):
    """``fast_accum.use_fast_accumulation`` (``train_step.py --fast-accum``, ``text_curves.py --fast-accum``): every
    ``torch._scaled_mm`` call gets ``use_fast_accum=True`` unless it passes its own; a second call wraps nothing."""
    import torch
    from fast_accum import use_fast_accumulation
    from run_all import parse_label

    seen = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: seen.append(kwargs.get("use_fast_accum")))
    use_fast_accumulation()
    wrapped = torch._scaled_mm
    use_fast_accumulation()
    assert torch._scaled_mm is wrapped  # once: a second call wraps nothing
    torch._scaled_mm(1, 2, scale_a=3)
    torch._scaled_mm(1, 2, use_fast_accum=False)
    assert seen == [True, False]
    assert parse_label("fusepatch+fp8+fastaccum+quick")[2] == ["--precision", "fp8", "--fast-accum", "--no-diagnostics"]
    import text_curves

    assert text_curves.parse_args(["--precision", "fp8", "--fast-accum"]).fast_accum
    with pytest.raises(SystemExit):  # fast accumulation has no FP8 GEMM to act on in a bf16 run
        text_curves.parse_args(["--fast-accum"])


def test_static_memory_counts_each_part_as_the_precision_keeps_it():
    """``static_memory.py`` on the tiny shape under peft LoRA, against sizes worked out by hand from its config:
    each of the 4 layers has 163,840 projection values in 1,152 rows (Gated DeltaNet: qkv 128x256, z 128x128, out
    128x128; attention: q with its gate 128x256, k and v 128x64, o 128x128; MLP: 3 x 128x256)."""
    from static_memory import build, static_memory

    model = build("tiny", None, lora=4)
    values, rows = 4 * 163_840, 4 * 1_152
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    bf16, fp8, dropped = (static_memory(model, precision)["bytes"] for precision in ("bf16", "fp8", "fp8+drop"))
    assert bf16["projections"] == 2 * values and bf16["projections_fp8"] == 0
    assert bf16["embedding_and_head"] == 2 * 2 * 1024 * 128  # untied: both in bf16
    assert bf16["embedding_and_head"] + bf16["projections"] + bf16["other"] == total
    assert (bf16["gradients"], bf16["optimizer_states"]) == (trainable, 2 * trainable)
    assert fp8["projections_fp8"] == values + 4 * rows and fp8["projections"] == 2 * values
    assert dropped["projections_fp8"] == values + 4 * rows and dropped["projections"] == 0
    full = static_memory(build("tiny", None, lora=0), "fp8+drop")["bytes"]  # trained weights keep no FP8 copy
    assert full["projections"] == 2 * values and full["projections_fp8"] == 0


def test_static_memory_counts_the_fp8_copies_a_patched_model_keeps(monkeypatch):
    """The FP8 copies of the frozen bases, as ``static_memory`` counts them, are the bytes a patched LoRA model
    keeps after a step (FP8 values and fp32 scales in each projection's cache)."""
    import torch
    from helpers import cpu_candidates, lm_batch
    from static_memory import build, static_memory

    import fusepatch
    from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear

    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    with torch.device("cpu"):
        model = build("tiny", None, lora=4).to_empty(device="cpu")
    counted = static_memory(model, "fp8")["bytes"]["projections_fp8"]
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    fusepatch.apply(model, precision="fp8", verbose=False)
    with torch.no_grad():
        model(**lm_batch(model, length=16))
    patched = [m for m in model.modules() if "fp8_linear" in getattr(m.__dict__.get("_fusepatch"), "ops", {})]
    held = [m._fusepatch.ops["fp8_linear"].kept(m.weight) for m in patched]
    kept = [h.handle for h in held if h is not None]
    assert kept and sum(q.nbytes + inverse.nbytes for q, inverse in kept) == counted


def test_host_profile_names_packages_by_where_they_are_not_by_folder_names():
    """A function's package is the installed or imported package its file is in; the folders above a checkout say
    nothing (a clone named ``fusepatch`` or ``torch`` holds tests and examples that are neither)."""
    import step_diagnostics

    import fusepatch

    package = step_diagnostics._package
    assert package(os.path.join(os.path.dirname(fusepatch.__file__), "layers", "causal_lm.py")) == "fusepatch"
    assert package(os.path.join(str(REPO), "benchmarks", "train_step.py")) == "benchmarks"
    assert package("/home/me/fusepatch/tests/benchmarks/test_benchmarks.py") == "other"
    assert package("/srv/torch/fusepatch/examples/sft_ultrachat.py") == "other"
    assert package("/home/me/fusepatch/.venv/lib/python3.12/site-packages/fla/ops/utils.py") == "fla"
    assert package("/opt/site-packages/env/lib/python3.12/site-packages/triton/runtime/jit.py") == "triton"
    assert package("~") == "builtins"


def test_fp8_kept_check_bench_times_each_frozen_projection_of_a_lora_step():
    """``fp8_kernels_bench.py --cases kept`` times the kept copies' check at the weight shapes of an 8-layer 27B
    LoRA step's frozen projections: per decoder layer gate, up, down; per Gated DeltaNet layer (6 of 8) in_proj_qkv,
    in_proj_z, out_proj; per attention layer (2) q (gated: twice the heads), k, v, o."""
    from fp8_kernels_bench import kept_sites

    assert kept_sites("27b", 8) == {
        (17408, 5120): 16,
        (5120, 17408): 8,
        (10240, 5120): 6,
        (6144, 5120): 6,
        (5120, 6144): 8,
        (12288, 5120): 2,
        (1024, 5120): 4,
    }


def test_provenance_names_the_study_as_run_from_the_repository_root():
    """A record's command runs again from the repository root wherever the study was started from; a package
    that is not installed is None by default (looked for, missing) and left out with ``absent=False``."""
    import provenance

    study = REPO / "benchmarks" / "studies" / "static_memory.py"
    assert provenance.command(str(study), ["--shape", "2b"]) == "python benchmarks/studies/static_memory.py --shape 2b"
    found = provenance.versions(("torch", "no-such-distribution"))
    assert found["torch"] and found["no-such-distribution"] is None
    assert provenance.versions(("no-such-distribution",), absent=False) == {}
    assert len(provenance.today()) == 10 and provenance.today()[4] == "-"


def test_depth_fit_records_the_versions_its_probes_ran_with(tmp_path, monkeypatch):
    """The depth search's row names the kernel packages' versions its probes imported (the search itself imports
    none of them), the deepest depth that fit and the first that ran out of memory."""
    import depth_fit
    import run_all

    def run_one(label, step):
        if step.layers > 8:
            return {"config": label, "error": "exit 1: torch.OutOfMemoryError: CUDA out of memory."}
        return {"config": label, "versions": {"fla-core": "0.6.0"}, "tokens_per_s": 1.0, "peak_mem_gib": 2.0}

    monkeypatch.setattr(run_all, "run_one", run_one)
    monkeypatch.setattr(depth_fit, "gpu_name", lambda: "a GPU")  # this machine has none
    out = tmp_path / "fit.jsonl"
    argv = ["depth_fit.py", "--configs", "fusepatch", "--low", "4", "--high", "16", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert depth_fit.main() == 0
    row = json.loads(out.read_text())
    assert row["versions"] == {"fla-core": "0.6.0"}
    assert (row["deepest_fit"], row["first_oom"]) == (8, 12)


def test_depth_fit_bisects_to_the_deepest_depth_that_fits_and_stops_on_other_errors():
    """``studies/depth_fit.py``: a probe per depth, bisected over multiples of 4; an error that is not memory
    stops the search (it says nothing about the depth), and a probe's text is read as run_all returns it."""
    import depth_fit

    limit = 37
    calls = []

    def probe(depth):
        calls.append(depth)
        return "fits" if depth <= limit else "oom"

    fit, over, seen = depth_fit.deepest(probe, 4, 64, 4)
    assert (fit, over) == (36, 40)
    assert len(calls) <= 5 and all(d % 4 == 0 for d in calls) and seen[36] == "fits"
    assert depth_fit.deepest(lambda d: "fits", 4, 64, 4)[:2] == (64, None)
    assert depth_fit.deepest(lambda d: "oom", 4, 64, 4)[:2] == (None, 4)
    assert depth_fit.deepest(lambda d: "error", 4, 64, 4)[:2] == (None, None)
    assert depth_fit.outcome({"config": "x"}) == "fits"
    assert depth_fit.outcome({"error": "exit 1: torch.OutOfMemoryError: CUDA out of memory."}) == "oom"
    assert depth_fit.outcome({"error": "exit 1: ImportError: no fla"}) == "error"


def test_the_sweep_names_the_quantity_nearest_its_bound():
    """``selftest_sweep.worst``: the largest error over bound, a NaN error beyond every bound, unbounded ignored."""
    import math

    from selftest_sweep import worst

    assert worst({"a": 1.0, "b": 3.0, "c": 9.0}, {"a": 2.0, "b": 4.0}) == ("b", 0.75)
    assert worst({"a": 1.0, "b": float("nan")}, {"a": 2.0, "b": 4.0}) == ("b", math.inf)
    assert worst({"a": 1.0, "b": float("inf")}, {"a": 2.0}) == ("b", math.inf)  # unbounded, yet not finite
    assert worst({"a": 1.0}, {}) == (None, 0.0)


# What the train-step harness imports of fusepatch when a process starts. run_all.py's ``+code=REV`` runs it on an
# older commit's package (a before/after pair in one run), which lacks any module added since: a module imported at
# the top of the harness must have been in the package for a while (these were at b4f50c5); a newer one is imported
# inside the option that needs it (train_step.py's --freeze-gc).
HARNESS_IMPORTS = {
    "train_step.py": {"fusepatch.diagnostics.compiles", "fusepatch.diagnostics.profile"},
    "step_diagnostics.py": {"fusepatch.diagnostics.profile"},
}


def test_the_harness_imports_at_start_only_what_older_packages_have():
    import ast

    for name, allowed in HARNESS_IMPORTS.items():
        tree = ast.parse((REPO / "benchmarks" / name).read_text())
        found = {
            node.module
            for node in tree.body  # the module's top level: what every run imports
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusepatch")
        }
        found |= {
            alias.name
            for node in tree.body
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("fusepatch.")
        }
        assert found <= allowed, f"{name} imports {sorted(found - allowed)} at its top (import it where it is used)"


# An H100 run's results as run_all.py wrote them (--out; trimmed to the fields the records take), and the record
# files made of them, which the docs' figures are checked against.
RUN = REPO / "tests" / "benchmarks" / "data" / "run-60f50a4-h100.json"
RECORDED = {
    "8 layers": ("2026-12-05-speed-3-h100.jsonl", []),
    "full depth": ("2026-12-05-full-depth-lora-3-h100.jsonl", ["--checkpointing", "--lora", "16", "--layers", "64"]),
}


@pytest.mark.parametrize("run", sorted(RECORDED))
def test_the_record_writer_gives_the_recorded_rows(tmp_path, run):
    """``run_all.py --record`` (here from the run's saved results, ``--from-json``) writes the rows the record
    holds, field for field: the figures of README and docs read them, so a writer that renamed a field, rounded
    otherwise or named another commit would move them. The ``+code=REV`` row names REV, the others the run's
    commit."""
    import json
    import subprocess

    record, options = RECORDED[run]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(json.loads(RUN.read_text())[run]))
    out = tmp_path / "rows.jsonl"
    script = REPO / "benchmarks" / "run_all.py"
    argv = [sys.executable, str(script), "--from-json", str(results), "--record", str(out), "--commit", "60f50a4"]
    subprocess.run([*argv, "--note", "n", "--command", "c", *options], check=True, cwd=tmp_path)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    recorded = [json.loads(line) for line in (REPO / "benchmarks" / "records" / record).read_text().splitlines()]
    assert [r["config"] for r in written] == [r["config"] for r in recorded]
    for mine, theirs in zip(written, recorded):
        assert {k: v for k, v in mine.items() if k not in ("note", "command")} == {
            k: v for k, v in theirs.items() if k not in ("note", "command")
        }
    assert {r["code"] for r in written} == ({"60f50a4", "b4f50c5"} if run == "8 layers" else {"60f50a4"})


def _record_args(*argv: str):
    """run_all.py's options as its parser reads them: the record takes its shape and settings from them."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vary-seq", type=float, default=0.0)
    parser.add_argument("--checkpointing", action="store_true")
    return argparse.Namespace(steps=8, warmup=2, **vars(parser.parse_args(argv)))


def test_a_failed_configuration_keeps_its_error_and_its_place_in_the_record():
    """A configuration that timed out or exited without results has only its label and error (``run_one``): its
    row still names the shape, depth, sequence, date and GPU of the run, so that it reads as a failure of that
    measurement and not as a row of nothing."""
    ran = json.loads(RUN.read_text())["8 layers"][0]
    failed = {"config": "fusepatch+fp8", "error": "timed out after 400s", "wall_s": 400.0}
    rows = run_all.record_rows([ran, failed], code="abc1234", command="c", args=_record_args("--layers", "8"))
    row = rows[1]
    assert row["error"] == "timed out after 400s" and row["code"] == "abc1234" and "tokens_per_s_synced" not in row
    where = {k: row[k] for k in ("shape", "layers", "seq", "batch", "date", "gpu")}
    assert where == {k: ran[k] for k in where}


def test_the_record_names_every_setting_that_changes_the_step():
    """Packed documents, a masked prompt and varying lengths change what a step computes: a row without them
    would read as the plain step's. A result short of the optional fields (diagnostics off, no CUDA) still
    gives its row."""
    result = {"config": "fusepatch", "shape": "2b", "layers": 24, "seq": 2048, "batch": 4, "tokens_per_s": 1000.4}
    result.update(packed_docs=4, prompt=0.3)
    (row,) = run_all.record_rows([result], code="abc1234", command="c", args=_record_args("--vary-seq", "0.5"))
    assert row["tokens_per_s_synced"] == 1000 and row["median_step_ms"] is None
    assert (row["packed_docs"], row["prompt"], row["vary_seq"]) == (4, 0.3, 0.5)


def test_the_record_keeps_where_the_steps_gpu_time_goes():
    """A target missed is said with the step's profile: the row keeps the profiled step's kernel time as GEMMs, the
    optimizer and the rest, with the rest's largest kernels (``step_diagnostics.kernel_split``)."""
    split = {"gemm_ms": 94.03, "optimizer_ms": 38.56, "rest_ms": 52.09, "rest_top": [["_quantize_columns", 6.87]]}
    result = {"config": "fusepatch+fp8", "shape": "27b", "layers": 8, "seq": 4096, "batch": 1, "tokens_per_s": 2.0}
    (row,) = run_all.record_rows([{**result, "kernel_split": split}], code="abc1234", command="c", args=_record_args())
    assert row["kernel_split"] == split


def test_a_run_cut_off_keeps_the_record_rows_of_what_it_measured(tmp_path, monkeypatch):
    """``gpu_run.sh`` stops run_all.py at its time limit: the rows of the configurations that finished are in
    ``--record`` already, as their results are in ``--out``."""
    done = json.loads(RUN.read_text())["8 layers"]

    def run_one(label, args):
        if label == "fusepatch+fp8":
            raise KeyboardInterrupt  # the time limit's signal, as the run sees it
        return next(r for r in done if r["config"] == label)

    monkeypatch.setattr(run_all, "run_one", run_one)
    record = tmp_path / "rows.jsonl"
    argv = ["run_all.py", "--layers", "8", "--workdir", str(tmp_path), "--record", str(record), "--commit", "abc1234"]
    monkeypatch.setattr(sys, "argv", [*argv, "--configs", "hf-fast,fusepatch,fusepatch+fp8"])
    with pytest.raises(KeyboardInterrupt):
        run_all.main()
    assert [json.loads(line)["config"] for line in record.read_text().splitlines()] == ["hf-fast", "fusepatch"]


@pytest.mark.parametrize("missing", ["--record", "--command"])
def test_from_json_refuses_options_it_cannot_do_without(tmp_path, monkeypatch, capsys, missing):
    """``--from-json`` without ``--record`` would write nothing and say nothing; without ``--command`` its rows
    would name the command that converted the results, not the one that measured them."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(json.loads(RUN.read_text())["8 layers"]))
    options = {"--from-json": str(results), "--record": str(tmp_path / "rows.jsonl"), "--command": "c"}
    monkeypatch.setattr(sys, "argv", ["run_all.py", *(x for k, v in options.items() if k != missing for x in (k, v))])
    with pytest.raises(SystemExit) as stopped:
        run_all.main()
    assert stopped.value.code == 2 and missing in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()


GPU_OUTCOMES = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("a setup that fails")

def test_passes(): pass
def test_fails(): assert False
def test_skips(): pytest.skip("not here")
@pytest.mark.xfail(strict=False)
def test_xfails(): assert False
@pytest.mark.xfail(strict=False)
def test_xpasses(): pass
def test_errors(broken): pass
"""


def test_the_gpu_suite_writes_each_tests_outcome_as_it_ends(tmp_path):
    """``tests/gpu/conftest.py`` appends every test's outcome to ``FUSEPATCH_GPU_REPORT_DIR`` as the test ends (the
    GPU suite's record, kept where a lane is cut off at its time limit) and each failure's traceback; here its hook
    runs over tests of every outcome, in a copy of the folder (one process: the GPU runs' workers write a file
    each, named by the worker)."""
    import json
    import shutil
    import subprocess

    (tmp_path / "gpu").mkdir()
    shutil.copy(REPO / "tests" / "gpu" / "conftest.py", tmp_path / "gpu" / "conftest.py")
    shutil.copy(REPO / "tests" / "helpers.py", tmp_path / "helpers.py")
    (tmp_path / "gpu" / "test_outcomes.py").write_text(GPU_OUTCOMES)
    reports = tmp_path / "reports"
    env = dict(os.environ, FUSEPATCH_GPU_REPORT_DIR=str(reports))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "gpu/test_outcomes.py"]
    subprocess.run([*argv, "-c", os.devnull, "--rootdir", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True)
    rows = [json.loads(line) for path in reports.glob("outcomes-*.jsonl") for line in path.read_text().splitlines()]
    outcomes = {row["test"].split("::")[-1]: row["outcome"] for row in rows}
    assert outcomes == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_xfails": "xfailed",
        "test_xpasses": "xpassed",
        "test_errors": "error",
    }
    assert {row["file"] for row in rows} == {"gpu/test_outcomes.py"}
    failures = "".join(path.read_text() for path in reports.glob("failures-*.txt"))
    assert "test_fails (call)" in failures and "test_errors (setup)" in failures
