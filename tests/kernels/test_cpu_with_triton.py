"""transformers picks fla at import time, blind to the device; fusepatch's forwards choose per call.

On a CPU-only machine with triton and fla installed, transformers' Qwen3.5 forward (up to 5.24) calls fla and
crashes ("0 active drivers"). The test stands a stand-in ``fla`` package on the path that fails exactly that way
when called, and shows the unpatched model crash and the patched one train.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FAKE_FLA = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": textwrap.dedent(
        """
        def _no_gpu(*args, **kwargs):
            raise RuntimeError("0 active drivers ([]). There should only be one.")

        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
            _no_gpu()

        fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
        """
    ),
}

SCRIPT = textwrap.dedent(
    """
    import torch, fusepatch
    from fusepatch.tools.tiny import tiny_model
    model = tiny_model("qwen3_5_text")
    ids = torch.randint(0, 512, (2, 40))
    try:
        model(input_ids=ids, labels=ids, use_cache=False)
        print("UNPATCHED-RAN")
    except RuntimeError as exc:
        print("UNPATCHED-CRASHED:", exc)
    fusepatch.apply(model)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    print("PATCHED-LOSS", float(out.loss))
    """
)


@pytest.mark.slow
def test_patched_model_trains_on_cpu_where_transformers_picked_fla(tmp_path):
    for name, text in FAKE_FLA.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # transformers 5.25 asks for the tensors' device before it calls fla (its kernel-with-fallback wrapper), and
    # runs its torch path on the CPU; the releases before call fla there and crash
    import transformers
    from packaging.version import Version

    checks_device = Version(transformers.__version__) >= Version("5.25")
    assert ("UNPATCHED-RAN" if checks_device else "UNPATCHED-CRASHED: 0 active drivers") in result.stdout
    assert "PATCHED-LOSS" in result.stdout
