"""The SFT example end to end on the shipped ultrachat-format file, offline, on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, torchrun

ROOT = str(REPO)
EXAMPLE = os.path.join(ROOT, "examples", "sft_ultrachat.py")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")


def _module():
    spec = importlib.util.spec_from_file_location("sft_ultrachat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_is_on_assistant_tokens_only():
    sft = _module()
    rows = sft.load_conversations(sft.DEFAULT_DATA, "train")
    tokenizer = sft.build_tokenizer(rows)
    messages = rows[7]["messages"]  # a three-turn conversation
    item = sft.tokenize(tokenizer, messages, max_length=4096)
    supervised = [t for t in item["labels"] if t != -100]
    text = tokenizer.decode(supervised)
    for message in messages:
        if message["role"] == "assistant":
            assert message["content"] in text
        else:
            assert message["content"] not in text
    # the prefix-rendering fallback (templates without generation markers) finds the same tokens
    mask = sft._assistant_mask_by_prefixes(tokenizer, messages)
    assert [t for t, m in zip(item["input_ids"], mask) if m] == supervised


@pytest.mark.slow
def test_example_runs_offline_with_packing_and_checkpointing(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, EXAMPLE, "--max-steps", "5", "--profile-step", "2", "--output-dir", str(tmp_path / "out")]
    cmd += ["--repeat", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "assistant tokens carry the loss" in out and "repeated 2 times: 48 rows" in out
    metrics = json.loads(out.split("fusepatch metrics: ")[1].splitlines()[0])
    assert metrics["fusepatch/cpu_ops_per_step"] > 0 and metrics["fusepatch/tokens_per_s"] > 0
    assert len(out.split("losses: ")[1].splitlines()[0].split()) == 5
    assert "Warning: fusepatch::" not in result.stderr  # every profiler range closed (checkpoint recompute)
    # the results table the GPU runs are recorded with, from this output (steps 3-5 timed, step 2 profiled)
    sys.path.insert(0, os.path.join(os.path.dirname(EXAMPLE), "..", "benchmarks", "studies"))
    import sft_table

    for name in ("sft-eager.log", "sft-again.log"):
        (tmp_path / name).write_text(out)
    text = sft_table.table([sft_table.parse(str(tmp_path / n)) for n in ("sft-eager.log", "sft-again.log")], 1)
    rows = [line for line in text.splitlines() if line.startswith("| eager") or line.startswith("| again")]
    assert len(rows) == 2 and "| 1.00x |" in rows[1] and "| 3 |" in rows[0], text
    assert "largest relative gap 0.000" in text


@pytest.mark.slow
def test_example_under_torchrun_with_fsdp2(tmp_path):
    """Two CPU processes (gloo), the layers FSDP2-sharded through the Trainer's fsdp arguments (accelerate shards
    only GPU-like devices by itself: the example's ``trainer_fsdp_on_cpu``); the numerics of that path against the
    unsharded model are tests/integrations/test_fsdp2.py's."""
    result = torchrun(
        EXAMPLE,
        "--fsdp",
        "--max-steps",
        "2",
        "--profile-step",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "cache"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("world size 2, FSDP2-sharded layers: True") == 2, result.stdout[-3000:]
    assert "Qwen3_5GatedDeltaNet x3" in result.stderr or "Qwen3_5GatedDeltaNet x3" in result.stdout


@pytest.mark.parametrize("name", ["accelerate_fsdp2.yaml", "accelerate_zero3.yaml"])
def test_the_accelerate_configs_are_what_accelerate_reads(name):
    """Both launch configs load as ``accelerate launch --config_file`` loads them (unknown keys fail there) and say
    what the examples' README says: FSDP2 per Qwen3.5 decoder layer, or DeepSpeed ZeRO-3, in bf16. (A two-process
    CPU run of the ZeRO-3 one takes a minute: examples/README.md gives its command.)"""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(os.path.join(os.path.dirname(EXAMPLE), name))
    assert config.mixed_precision == "bf16" and config.num_processes == 8
    if name == "accelerate_fsdp2.yaml":
        import transformers

        layer = config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
        assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
        assert hasattr(transformers.models.qwen3_5.modeling_qwen3_5, layer)
    else:
        assert config.distributed_type == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == 3


def test_fsdp_in_one_process_says_why_it_runs_unsharded_and_how_to_shard(monkeypatch, capsys):
    sft = _module()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert sft.sharding(True) is False
    said = capsys.readouterr().out
    assert "runs unsharded" in said and "torchrun --nproc-per-node 2 examples/sft_ultrachat.py --fsdp" in said
    assert sft.sharding(False) is False and capsys.readouterr().out == ""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sft.sharding(True) is True and capsys.readouterr().out == ""


def test_fsdp_on_cpu_changes_only_a_cpu_process_group_without_a_plugin():
    """``fsdp_on_cpu`` sets accelerate's state as accelerate sets it on GPUs, and only where accelerate left a CPU
    process group without its plugin: a single process (``NO``) or a kept plugin is left alone."""
    from accelerate.utils import DistributedType

    sft = _module()
    plugin = object()
    state = type("State", (), {"distributed_type": DistributedType.NO, "mixed_precision": "no"})()
    assert sft.fsdp_on_cpu(type("Accelerator", (), {"state": state})(), plugin) is False
    state.distributed_type, state.fsdp_plugin = DistributedType.MULTI_CPU, plugin
    assert sft.fsdp_on_cpu(type("Accelerator", (), {"state": state})(), plugin) is False


def test_shipped_27b_config_builds_the_real_layer_shapes_truncated(tmp_path):
    """``--config`` with the shipped Qwen3.5-27B text config and ``--layers``: the real sizes, fewer layers (built
    on the meta device here: 27B-sized weights are not allocated)."""
    import torch

    sft = _module()
    args = sft.argparse.Namespace(
        model=None, config=os.path.join(ROOT, "examples", "configs", "qwen3_5_27b_text.json"), layers=4, seed=0
    )
    tokenizer = type("Tok", (), {"pad_token_id": 0})()
    with torch.device("meta"):
        model = sft.build_model(args, tokenizer)
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (5120, 17408, 248320)
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.head_dim) == (16, 48, 256)
    assert config.num_hidden_layers == 4 and config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert type(model.model.layers[0].linear_attn).__name__ == "Qwen3_5GatedDeltaNet"


def test_sft_table_reads_two_ranks_lines_run_together(tmp_path):
    """A two-GPU log where rank 1's metrics line ran into its steady-state line (the 2026-11-29 H200 run's run): the table
    takes rank 0's steady state and the first metrics and losses."""
    sys.path.insert(0, os.path.join(os.path.dirname(EXAMPLE), "..", "benchmarks", "studies"))
    import sft_table

    metrics = {"fusepatch/step_time_s": 1.2, "fusepatch/peak_memory_gib": 92.99, "fusepatch/gpu_busy_fraction": 0.7}
    log = (
        "losses: 13.500 6.281 1.430\nlosses: 13.500 6.281 1.430\n"
        f"fusepatch metrics: {json.dumps(metrics)}\n"
        f"fusepatch metrics: {json.dumps(metrics)}steady state (rank 1): "
        '{"steps": 27, "median_step_s": 1.07, "median_tokens_per_s": 3700.0}\n'
        'steady state (rank 0): {"steps": 27, "median_step_s": 1.0588, "median_tokens_per_s": 3715.2}\n'
    )
    (tmp_path / "sft-2gpu-fusepatch.log").write_text(log)
    run = sft_table.parse(str(tmp_path / "sft-2gpu-fusepatch.log"))
    assert run["losses"] == [13.5, 6.281, 1.43]
    assert run["profile"] == metrics
    assert run["steady"]["median_tokens_per_s"] == 3715.2
    assert "3,715" in sft_table.table([run], 2)
