"""The delta rule's stage faults that the H200 saw pass are refused, and the unfaulted kernels pass at the seeds
where they were once refused, on the CPU in Triton's interpreter (tests/stage_faults_interpreter.py). Minutes long
and needs fla-core, which CI does not install: it runs only with ``FUSEPATCH_INTERPRETER_STAGES=1`` (fla-core on the
path), skipped otherwise at no cost."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HARNESS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "stage_faults_interpreter.py"
)


@pytest.mark.skipif(os.environ.get("FUSEPATCH_INTERPRETER_STAGES") != "1", reason="set FUSEPATCH_INTERPRETER_STAGES=1")
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")
def test_the_listed_stage_faults_are_refused_in_the_interpreter():
    """``x1.02`` on each listed stage output, and the WY decay gradient (below that resolution, ``RESOLUTION`` in
    tests/gpu/test_gpu_stage_faults.py) at ``x1.05``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    fine = ["chunk_gated_delta_rule_fwd_intra:0", "recompute_w_u_fwd:0", "prepare_wy_repr_bwd:0"]
    fine += ["gdn_gate_bwd:1", "gdn_gate_bwd:2"]
    for faults, outputs in (("x1.02", fine), ("x1.05", ["prepare_wy_repr_bwd:3"])):
        run = subprocess.run(
            [sys.executable, HARNESS, "--candidates", "fla-saved-states", "--clean", "none", "--faults", faults]
            + ["--outputs", *outputs],
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.skipif(os.environ.get("FUSEPATCH_INTERPRETER_STAGES") != "1", reason="set FUSEPATCH_INTERPRETER_STAGES=1")
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")
def test_the_unfaulted_kernels_pass_where_the_gate_gradient_was_noisiest():
    """Seeds 3 and 8, packed: with the op's floor on the gate's gradient, the unfaulted fla-saved-states was refused
    there (one-chunk's gate gradient at 1.05 and 1.6 times its bound); its own floors (``GATE_FLOORS``,
    ``ONE_CHUNK_FLOORS`` in ops/gated_delta_rule) accept it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, HARNESS, "--candidates", "fla-saved-states", "--seeds", "3", "8", "--packed", "1"]
        + ["--clean", "only"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
