"""FSDP2 over NCCL at world size 2 (two GPUs) with ``precision="fp8"``: LoRA's frozen bases keep their FP8 copy
sharded (each rank its rows), gathered in FP8 by torch's all-gather extension, with and without
``drop_frozen_weights``, on the GPU's own kernels (the FP8 quantization kernels, ``torch._scaled_mm``, the device-side
freshness check). The CPU gloo run of the same cases is tests/integrations/test_fsdp2.py's; here the numbers are
within the GPU kernels' run-to-run order rather than bit for bit.

    CUDA_VISIBLE_DEVICES=0,1 python -m pytest -q -m gpu tests/gpu/test_fp8_fsdp2.py
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from conftest import record

pytestmark = pytest.mark.gpu

CASES = ["fp8-lora-keep", "fp8-lora-drop", "fp8-dora-keep"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (world size 2 over NCCL)")
def test_fsdp2_keeps_fp8_bases_sharded_on_two_gpus(tmp_path):
    from helpers import torchrun

    distributed = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations", "distributed"
    )
    spec = importlib.util.spec_from_file_location("fp8_checks", os.path.join(distributed, "fp8_checks.py"))
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)

    out = tmp_path / "result.json"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")
    arguments = ("--cases", ",".join(CASES), "--out", str(out), "--device", "cuda")
    result = torchrun(
        os.path.join(distributed, "fsdp2_cases.py"), *arguments, processes=2, timeout=600, CUDA_VISIBLE_DEVICES=visible
    )
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    problems = []
    for name, case in data["cases"].items():
        record(f"fp8-fsdp2-{name}", {k: case[k] for k in ("losses", "grads", "whole", "layer_most", "ranks")})
        problems += checks.fp8_problems(name, data["world"], case, exact=False)
    assert not problems, "\n".join(problems)
