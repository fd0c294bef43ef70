"""The warm-up command: one layer of each kind at real sizes; on a CPU machine it refuses and says where to run."""

from __future__ import annotations

import subprocess
import sys

from helpers import in_process

from fusepatch.tools.tiny import tiny_config
from fusepatch.tools.warmup import OpTiming, cache_locations, warmup, warmup_config


def test_warmup_config_keeps_one_layer_of_each_kind(tmp_path):
    config = warmup_config("qwen3_5_text")
    assert config.num_hidden_layers == 2 and config.layer_types == ["linear_attention", "full_attention"]
    from transformers import AutoConfig

    assert config.hidden_size == AutoConfig.for_model("qwen3_5_text").hidden_size  # real sizes, fewer layers
    tiny_config("qwen3", hidden_size=96).save_pretrained(tmp_path)
    dense = warmup_config(str(tmp_path))
    assert dense.num_hidden_layers == 1 and dense.hidden_size == 96


def test_warmup_times_every_patched_op(tmp_path):
    tiny_config("qwen3_5_text").save_pretrained(tmp_path)
    results = warmup(str(tmp_path), dtype="float32", seq_len=70, device="cpu", packed=True)
    ops = {(r.layer, r.op) for r in results}
    assert ("Qwen3_5GatedDeltaNet", "gated_delta_rule") in ops and ("Qwen3_5GatedDeltaNet", "causal_conv1d") in ops
    assert all(r.kernel == "eager" and r.first_s > 0 and r.second_s > 0 for r in results)
    assert OpTiming("L", "op", "fla", first_s=40.0, second_s=0.01).compiled
    assert not OpTiming("L", "op", "fla", first_s=0.02, second_s=0.01).compiled
    # compiled during apply's self-test at these sizes: the first training call then comes from cache
    assert OpTiming("L", "op", "fla", first_s=0.02, second_s=0.01, ready_s=30.0).compiled
    assert all(r.ready_s >= 0 for r in results)


def _warmup_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fusepatch", "warmup", *args], capture_output=True, text=True, timeout=timeout
    )


def _warmup_main(*args: str) -> subprocess.CompletedProcess:
    """The command in this process (``cli.main``): what one process shows, without a new interpreter each."""
    code, out, err = in_process(["warmup", *args])
    return subprocess.CompletedProcess(["warmup", *args], code, out, err)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m fusepatch warmup: error: ")
    return line


def _needs_no_gpu() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")


def test_warmup_cli_without_gpu_says_where_to_run():
    _needs_no_gpu()
    line = _one_line(_warmup_main("qwen3_5_text"))
    assert "no CUDA device" in line and "TRITON_CACHE_DIR=" in line and "fix: run it where the GPU is" in line
    assert {row[1] for row in cache_locations()} == {"TRITON_CACHE_DIR", "TILELANG_CACHE_DIR"}


def test_warmup_cli_refuses_what_it_cannot_do_in_one_line(tmp_path):
    """A CPU has nothing to warm (every op runs eager there; a full-size model on CPU ran 10 minutes at 11 GB
    without finishing a step), ``--device cuda`` needs a GPU, and a model type without rows has no kernels: each is
    one line with the fix, at once, instead of a traceback or a model built for nothing."""
    from transformers import AutoConfig

    from fusepatch.engine.registry import known_model_types

    line = _one_line(_warmup_cli("qwen3_5_text", "--device", "cpu", timeout=60))
    assert "--device cpu" in line and "nothing to warm" in line and "fix: " in line
    supported = f"supported: {', '.join(known_model_types())}"
    assert supported in _one_line(_warmup_main("llama", "--device", "cuda"))
    AutoConfig.for_model("llama").save_pretrained(tmp_path)
    line = _one_line(_warmup_main(str(tmp_path), "--device", "cuda"))
    assert "'llama'" in line and supported in line
    _needs_no_gpu()
    line = _one_line(_warmup_main("qwen3_5_text", "--device", "cuda"))
    assert "--device cuda: torch " in line and "fix: " in line
