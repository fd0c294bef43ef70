"""Source-build planning (arch flags, cache key, refusals) and the nvcc arch filter, without nvcc or a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import A100, H200, cpu_env, gpu_env

from fusepatch.tools.build import BuildError, plan_build, run_build
from fusepatch.tools.nvcc_filter import filter_gencodes


@pytest.fixture
def sdist(tmp_path):
    path = tmp_path / "causal_conv1d-1.7.0.tar.gz"
    path.write_bytes(b"not really a tarball")
    return path


def _plan(env, sdist, tmp_path, **kwargs):
    kwargs.setdefault("nvcc", "/usr/local/cuda/bin/nvcc")
    kwargs.setdefault("nvcc_release", "13.0")
    kwargs.setdefault("ninja", True)
    return plan_build("causal-conv1d", env, sdist=sdist, cache_dir=tmp_path / "cache", **kwargs)


def test_plan_targets_the_visible_gpu_only(sdist, tmp_path):
    plan = _plan(gpu_env(H200, python="3.12.3"), sdist, tmp_path, jobs=16)
    assert plan.arch == "90"
    assert plan.cache_key == "causal-conv1d-1.7.0-torch2.11.0-cu13.0-sm90-py312"
    assert plan.wheel_dir == tmp_path / "cache" / plan.cache_key
    assert plan.env["CAUSAL_CONV1D_FORCE_BUILD"] == "TRUE" and plan.env["MAX_JOBS"] == "16"
    assert plan.env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert "--keep 90" in plan.env["PYTORCH_NVCC"] and "tools/nvcc_filter.py" in plan.env["PYTORCH_NVCC"]
    assert plan.command[-1] == str(sdist) and "--no-build-isolation" in plan.command
    assert "sm_90 only" in plan.describe()
    assert _plan(gpu_env(A100), sdist, tmp_path).arch == "80"
    assert _plan(cpu_env(torch_cuda="13.0"), sdist, tmp_path, arch="8.6").arch == "86"


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        (cpu_env(), {}, "CPU-only build"),
        (gpu_env(gpus=(), cuda_available=False), {}, "pass --arch"),
        (gpu_env(), {"nvcc_release": "12.8"}, "does not match torch's CUDA 13.0"),
        (gpu_env(), {"ninja": False}, "pip install ninja"),
    ],
)
def test_plan_refuses_with_the_fix(env, kwargs, message, sdist, tmp_path):
    with pytest.raises(BuildError, match=message):
        _plan(env, sdist, tmp_path, **kwargs)


def test_plan_refuses_without_nvcc(sdist, tmp_path, monkeypatch):
    monkeypatch.setattr("fusepatch.tools.build.find_nvcc", lambda: None)
    with pytest.raises(BuildError, match="step 'find nvcc' failed.*CUDA toolkit 13.0"):
        plan_build("causal-conv1d", gpu_env(), sdist=sdist, cache_dir=tmp_path, nvcc_release="13.0", ninja=True)


def test_plan_needs_an_sdist(tmp_path):
    with pytest.raises(BuildError, match="pip download --no-deps --no-binary :all:"):
        plan_build("causal-conv1d", gpu_env(), cache_dir=tmp_path, nvcc="nvcc", nvcc_release="13.0", ninja=True)
    with pytest.raises(BuildError, match="no source build for 'flash-attn'"):
        plan_build("flash-attn", gpu_env())


def test_cached_wheel_is_reused(sdist, tmp_path):
    plan = _plan(gpu_env(), sdist, tmp_path)
    plan.wheel_dir.mkdir(parents=True)
    wheel = plan.wheel_dir / "causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(b"")
    messages = []
    assert run_build(plan, install=False, echo=messages.append) == wheel
    assert messages == [f"cached: {wheel}"]


def test_compile_steps_reach_the_progress_callback(sdist, tmp_path):
    """ninja's ``[done/total]`` lines go to ``progress`` (the CLI's tqdm bar), the other lines of note to ``echo``,
    and the wheel the command leaves in the cache is what the build returns."""
    import dataclasses

    plan = _plan(gpu_env(H200), sdist, tmp_path)
    plan.wheel_dir.mkdir(parents=True)
    wheel = plan.wheel_dir / "causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl"
    script = (
        "import sys\n"
        "for i in (1, 2, 3): print(f'[{i}/3] nvcc -c file{i}.cu', flush=True)\n"
        "print('Building wheel for causal-conv1d')\n"
        f"open({str(wheel)!r}, 'wb').close()\n"
    )
    fake = dataclasses.replace(plan, command=[sys.executable, "-c", script])
    steps, messages = [], []
    assert run_build(fake, install=False, echo=messages.append, progress=lambda *s: steps.append(s)) == wheel
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert any("Building wheel" in m for m in messages) and not any(m.startswith("[") for m in messages)


def test_failed_build_says_which_step(sdist, tmp_path):
    plan = _plan(gpu_env(), sdist, tmp_path)
    failing = plan.__class__(
        **{
            **plan.__dict__,
            "command": [sys.executable, "-c", "import sys; print('nvcc fatal error: bad flag'); sys.exit(3)"],
        }
    )
    with pytest.raises(BuildError, match=r"step 'compile causal-conv1d' failed \(exit 3\)[\s\S]*nvcc fatal error"):
        run_build(failing, install=False, echo=lambda _: None)


def test_nvcc_filter_keeps_only_the_chosen_arch():
    args = [
        "-O3",
        "-gencode",
        "arch=compute_75,code=sm_75",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode",
        "arch=compute_120,code=sm_120",
        "-c",
        "x.cu",
    ]
    assert filter_gencodes(args, {"90"}) == ["-O3", "-gencode=arch=compute_90,code=sm_90", "-c", "x.cu"]
    assert filter_gencodes(["-c", "x.cu"], {"90"}) == ["-c", "x.cu", "-gencode", "arch=compute_90,code=sm_90"]


def test_nvcc_filter_runs_the_real_compiler_with_the_filtered_flags(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusepatch.tools.nvcc_filter",
            "--keep",
            "90",
            "--nvcc",
            str(fake),
            "--",
            "-gencode",
            "arch=compute_80,code=sm_80",
            "-gencode",
            "arch=compute_90,code=sm_90",
            "-c",
            "a.cu",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "-gencode arch=compute_90,code=sm_90 -c a.cu"


def test_build_cli_dry_run_refuses_on_a_cpu_machine():
    result = subprocess.run(
        [sys.executable, "-m", "fusepatch", "build", "causal-conv1d", "--dry-run"], capture_output=True, text=True
    )
    assert result.returncode == 1 and "fusepatch build:" in result.stderr


def test_the_wheel_cache_follows_the_users_cache_folder(monkeypatch, tmp_path):
    """``$FUSEPATCH_CACHE`` first, else the platform's user cache folder (``$XDG_CACHE_HOME`` on Linux), which the
    cache ignored for ``~/.cache``."""
    from fusepatch.tools.build import default_cache_dir

    monkeypatch.delenv("FUSEPATCH_CACHE", raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fusepatch" / "wheels"
    monkeypatch.setenv("FUSEPATCH_CACHE", str(tmp_path / "own"))
    assert default_cache_dir() == tmp_path / "own" / "wheels"


def test_nvcc_is_the_one_torch_builds_extensions_with(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from fusepatch.tools.build import find_nvcc

    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda"))
    assert find_nvcc() == str(nvcc)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert find_nvcc() is None
