"""Every compatibility rule, on hand-built environments (no hardware or packages needed)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
from helpers import A100, H200, T4, cpu_env, gpu_env

from fusepatch.base.known_issues import KNOWN_ISSUES, matching_issues
from fusepatch.base.requirements import (
    CudaDevice,
    DistributionVersion,
    Importable,
    InputRule,
    Inputs,
    MinCapability,
    NoKnownIssue,
    TorchVersion,
    version_in,
)


def test_version_in_ignores_local_labels_and_allows_prereleases():
    assert version_in("2.11.0+cu130", ">=2.7")
    assert version_in("3.7.1rc1", ">=3.7.1rc0")
    assert not version_in("0.4.2", ">=0.5")
    assert not version_in("not-a-version", ">=1")


def test_cuda_device_cpu_build():
    verdict = CudaDevice().check(cpu_env())
    assert not verdict.ok and "CPU-only build" in verdict.reason and "CUDA" in verdict.fix


def test_cuda_device_cuda_build_without_gpu():
    verdict = CudaDevice().check(gpu_env(cuda_available=False, gpus=()))
    assert not verdict.ok and "no CUDA device is visible" in verdict.reason


def test_cuda_device_ok():
    assert CudaDevice().check(gpu_env()).ok


def test_min_capability():
    rule = MinCapability((8, 0), "fla")
    assert rule.check(gpu_env(H200)).ok and rule.check(gpu_env(A100)).ok
    verdict = rule.check(gpu_env(T4))
    assert not verdict.ok and "sm_75" in verdict.reason and "sm_80" in verdict.reason


def test_distribution_missing_names_the_pip_command():
    verdict = DistributionVersion("fla-core", ">=0.5", 'pip install "flash-linear-attention[cuda]"').check(cpu_env())
    assert not verdict.ok
    assert verdict.reason == "fla-core is not installed"
    assert verdict.fix == 'pip install "flash-linear-attention[cuda]"'


def test_distribution_too_old_says_why():
    env = gpu_env(distributions={"fla-core": "0.4.2"})
    verdict = DistributionVersion("fla-core", ">=0.5", "x", why="older fla needs q/k repeated").check(env)
    assert not verdict.ok and "0.4.2" in verdict.reason and ">=0.5" in verdict.reason and "repeated" in verdict.reason


def test_importable_reports_the_real_import_error_of_an_installed_package():
    error = "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory"
    env = gpu_env(imports={"causal_conv1d": error})
    verdict = Importable("causal_conv1d", "causal-conv1d").check(env)
    assert not verdict.ok
    assert "causal-conv1d 1.7.0 is installed but import causal_conv1d fails" in verdict.reason
    assert "libcudart.so.12" in verdict.reason
    assert "not installed" not in verdict.reason
    assert "--force-reinstall" in verdict.fix


def test_importable_not_installed():
    env = cpu_env(imports={"causal_conv1d": "ModuleNotFoundError: No module named 'causal_conv1d'"})
    verdict = Importable("causal_conv1d", "causal-conv1d", "pip install causal-conv1d").check(env)
    assert verdict.reason == "causal-conv1d is not installed" and verdict.fix == "pip install causal-conv1d"


def test_importable_ok():
    assert Importable("causal_conv1d", "causal-conv1d").check(gpu_env()).ok


def test_torch_version():
    assert TorchVersion(">=2.7").check(gpu_env()).ok
    assert not TorchVersion(">=2.12").check(gpu_env()).ok


@pytest.mark.parametrize(
    "gpu, triton, tilelang_error, affected",
    [
        (H200, "3.6.0", "ModuleNotFoundError: No module named 'tilelang'", True),
        (H200, "3.4.0", "ModuleNotFoundError: No module named 'tilelang'", True),
        (H200, "3.6.0", None, False),  # tilelang importable: fla routes the kernel around the bug
        (H200, "3.7.1", "ModuleNotFoundError: No module named 'tilelang'", False),
        (H200, "3.3.1", "ModuleNotFoundError: No module named 'tilelang'", False),
        (A100, "3.6.0", "ModuleNotFoundError: No module named 'tilelang'", False),
    ],
)
def test_fla_hopper_triton_known_issue(gpu, triton, tilelang_error, affected):
    env = gpu_env(gpu, distributions={"triton": triton}, imports={"tilelang": tilelang_error})
    verdict = NoKnownIssue("fla-core").check(env)
    assert verdict.ok is (not affected)
    assert bool(matching_issues("fla-core", env)) is affected
    if affected:
        assert "#640" in verdict.reason or "issues/640" in verdict.reason
        assert "pip install tilelang" in verdict.fix and "3.7.1" in verdict.fix


@pytest.mark.parametrize(
    "gpu, transformers, triton, affected",
    [
        (H200, "5.17.0", "3.6.0", True),
        (A100, "5.25.0", "3.5.1", True),  # any GPU: the Triton fault was reported off Hopper too
        (None, "5.17.0", "3.6.0", False),  # the CPU: inductor's CPU code is right (benchmarks/studies/trace_check.py)
        (H200, "5.17.0", "3.4.0", False),
    ],
)
def test_compiled_qwen3_5_rotary_known_issue(gpu, transformers, triton, affected):
    """The doctor's row for inductor's wrong Qwen3.5 rotary tables: any GPU with an affected Triton, never the CPU;
    its fix is fusepatch itself."""
    versions = {"triton": triton, "transformers": transformers}
    env = gpu_env(gpu, distributions=versions) if gpu else cpu_env(distributions={"torch": "2.13.0", **versions})
    found = matching_issues("transformers", env)
    assert bool(found) is affected
    if affected:
        assert "wrong cos/sin tables" in found[0].what and "fusepatch.apply(model)" in found[0].fix


def test_known_issue_needs_the_package():
    env = gpu_env()
    assert matching_issues("fla-core", env)
    assert not matching_issues("fla-core", replace(env, distributions={"triton": "3.6.0"}))


def test_known_issues_table_is_data():
    for issue in KNOWN_ISSUES:
        data = issue.to_dict()
        assert data["link"].startswith("https://") and data["fix"]


def test_input_rule_cpu_tensors():
    verdict = InputRule(kernel="fla").check(Inputs("cpu", "bfloat16"))
    assert not verdict.ok and "tensors are on cpu" in verdict.reason and "model.to('cuda')" in verdict.fix


def test_input_rule_dtype():
    rule = InputRule(kernel="causal-conv1d (bf16-only build)", dtypes=("bfloat16",))
    verdict = rule.check(Inputs("cuda", "float32"))
    assert not verdict.ok and "float32" in verdict.reason and "bfloat16" in verdict.fix
    assert rule.check(Inputs("cuda", "bfloat16")).ok


def test_environment_is_a_value():
    env = gpu_env()
    assert env.capability == (9, 0) and env.triton == "3.6.0" and env.gpus[0].arch == "sm_90"
    assert env == gpu_env()
    assert env.to_dict()["gpus"][0]["arch"] == "sm_90"
    with pytest.raises(FrozenInstanceError):
        env.torch = "x"


def test_doctor_recommendations_for_the_h200_stack():
    from fusepatch.tools.doctor import recommendations

    bare = gpu_env(H200, distributions={"fla-core": None})
    bare = replace(
        bare, distributions={k: v for k, v in bare.distributions.items() if k not in ("fla-core", "causal-conv1d")}
    )
    text = "\n".join(recommendations(bare))
    assert "flash-linear-attention[cuda]==0.6.0" in text and "fusepatch build causal-conv1d" in text
    assert "tilelang==0.1.15" in text and "fusepatch warmup" in text
    with_tilelang = gpu_env(H200, distributions={"tilelang": "0.1.15"}, imports={"tilelang": None})
    assert not any("tilelang" in r for r in recommendations(with_tilelang))
    assert not any("tilelang" in r for r in recommendations(gpu_env(A100)))
    assert "runs eager" in recommendations(cpu_env())[0]


@pytest.mark.parametrize("name", ["fla-saved-states", "fla-saved-states-grouped", "fla", "fla-gate-outside"])
def test_fla_delta_rule_refuses_fp32_with_the_measured_reason(name):
    """fp32 through fla's delta rule was measured 4-30% off in the decay gradients on the H200 (tests/gpu checks
    it still is); the checker refuses it before loading anything and names the dtype that works."""
    from fusepatch.base.requirements import OK
    from fusepatch.engine.resolve import evaluate
    from fusepatch.ops import OPS

    op = OPS["gated_delta_rule"]
    candidate = next(c for c in op.candidates if c.name == name)
    verdict, fn = evaluate(op, candidate, OK, "cuda", "float32")
    assert not verdict.ok and fn is None
    assert "float32 inputs" in verdict.reason and "fp32 reference" in verdict.reason and "eager" in verdict.reason
    assert "bf16" in verdict.fix and "MixedPrecisionPolicy" in verdict.fix
    assert candidate.inputs.check(Inputs("cuda", "bfloat16")).ok
