"""``python -m fusepatch doctor``'s distributed section: torch.distributed and its backends, the launcher's
variables, FSDP2, the engines' packages, and what fusepatch does under each engine (text and ``--json``)."""

from __future__ import annotations

import json
from importlib import metadata

from helpers import in_process

from fusepatch.layers.layer_graphs import FIXES
from fusepatch.tools.doctor import LAUNCH_VARIABLES, distributed, distributed_lines


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_distributed_reports_backends_launch_variables_fsdp2_and_engines():
    info = distributed({"WORLD_SIZE": "4", "RANK": "3", "PATH": "/bin"})
    assert info["available"] and info["backends"]["gloo"] is True  # every CPU build of torch has gloo
    assert set(info["backends"]) == {"nccl", "gloo", "mpi"}
    assert info["fully_shard"] == "torch.distributed.fsdp.fully_shard"
    assert info["launch"] == {"WORLD_SIZE": "4", "RANK": "3"}  # the launcher's variables only, as set
    assert info["packages"] == {"accelerate": _installed("accelerate"), "deepspeed": _installed("deepspeed")}
    assert any(FIXES["sharded"] in line for line in info["under"]["fsdp2"])  # the graphs' own reason and fix
    assert any("FP8 copy sharded like its weight" in line for line in info["under"]["fsdp2"])
    assert any("keeping no copy" in line for line in info["under"]["deepspeed"])
    text = "\n".join(distributed_lines(info))
    assert "backends: nccl " in text and "gloo yes" in text and "this process: WORLD_SIZE=4 RANK=3" in text
    assert "under FSDP2:" in text and "under DeepSpeed ZeRO-3:" in text
    alone = "\n".join(distributed_lines(distributed({})))
    assert "this process: not launched as a rank" in alone


def test_doctor_text_and_json_carry_the_distributed_section(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    code, out, _ = in_process(["doctor", "--static", "--model-type", "qwen3", "--json"])
    assert code == 0
    data = json.loads(out)["distributed"]
    assert data["launch"] == {"LOCAL_RANK": "1"} and data["backends"]["gloo"] is True
    assert data["packages"]["accelerate"] == _installed("accelerate")
    code, out, _ = in_process(["doctor", "--static", "--model-type", "qwen3", "--wide"])
    assert code == 0
    section = out.split("\nDistributed\n")[1].split("\n\n")[0]
    assert "FSDP2: torch.distributed.fsdp.fully_shard" in section and "LOCAL_RANK=1" in section
    assert f"accelerate {_installed('accelerate') or 'not installed'}" in section
    assert "cuda_graphs=True steps aside" in section
