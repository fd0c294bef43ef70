"""Source builds: compile a kernel package for this machine's torch, CUDA and GPU only, cache and install it.

Never called at import or ``apply`` time; ``python -m fusepatch build causal-conv1d`` runs it. The plan is a
value (:class:`BuildPlan`), so what would be built, with which flags and under which cache key, is testable
without nvcc or a GPU.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from fusepatch.base.env import Environment
from fusepatch.base.versions import SUPPORT
from fusepatch.tools import nvcc_filter

logger = logging.getLogger("fusepatch")


@dataclass(frozen=True)
class SourcePackage:
    """How to build one package from its sdist."""

    distribution: str
    version: str
    import_name: str
    env: dict[str, str] = field(default_factory=dict)  # variables its setup.py reads


SOURCE_PACKAGES: dict[str, SourcePackage] = {
    "causal-conv1d": SourcePackage(
        distribution="causal-conv1d",
        version=SUPPORT["causal-conv1d"].pin,  # the GPU suite's (fusepatch/base/versions.py)
        import_name="causal_conv1d",
        env={"CAUSAL_CONV1D_FORCE_BUILD": "TRUE"},  # skip its attempt to download a prebuilt wheel
    ),
}


class BuildError(RuntimeError):
    """A build that cannot start or failed; the message says which step and what to install."""


@dataclass(frozen=True)
class BuildPlan:
    package: SourcePackage
    sdist: Path
    arch: str  # "90" for sm_90
    cache_key: str
    wheel_dir: Path
    nvcc: str
    env: dict[str, str]
    command: list[str]

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (
            f"build {self.package.distribution} {self.package.version} for sm_{self.arch} only\n"
            f"  sdist:     {self.sdist}\n"
            f"  cache key: {self.cache_key}\n"
            f"  wheel dir: {self.wheel_dir}\n"
            f"  nvcc:      {self.nvcc}\n"
            f"  command:   {env} {shlex.join(self.command)}"
        )


def default_cache_dir() -> Path:
    """``$FUSEPATCH_CACHE/wheels``, else the user's cache folder's (``$XDG_CACHE_HOME/fusepatch`` or
    ``~/.cache/fusepatch`` on Linux)."""
    base = os.environ.get("FUSEPATCH_CACHE") or platformdirs.user_cache_dir("fusepatch", appauthor=False)
    return Path(base) / "wheels"


def find_nvcc() -> str | None:
    """The nvcc the build compiles with: torch's extension builder takes the toolkit at its ``CUDA_HOME`` (the
    ``CUDA_HOME`` or ``CUDA_PATH`` variable, else the one of ``nvcc`` on the PATH, else ``/usr/local/cuda``)."""
    from torch.utils import cpp_extension  # finds the toolkit as it imports: only when a build asks

    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    return nvcc if nvcc and os.path.exists(nvcc) else None


def nvcc_version(nvcc: str) -> str | None:
    try:
        output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", output)
    return match.group(1) if match else None


def plan_build(
    name: str,
    env: Environment,
    *,
    sdist: str | os.PathLike | None = None,
    arch: str | None = None,
    jobs: int | None = None,
    cache_dir: Path | None = None,
    nvcc: str | None = None,
    nvcc_release: str | None = None,
    ninja: bool | None = None,
) -> BuildPlan:
    """What ``build`` would do on this machine, or a BuildError naming the missing piece and its fix."""
    if name not in SOURCE_PACKAGES:
        raise BuildError(f"no source build for {name!r}; known: {', '.join(SOURCE_PACKAGES)}")
    package = SOURCE_PACKAGES[name]
    if env.torch is None:
        raise BuildError("torch is not installed; fix: pip install torch (a CUDA build)")
    if env.torch_cuda is None:
        raise BuildError(
            f"torch {env.torch} is a CPU-only build: a CUDA extension cannot be built against it; "
            "fix: install a CUDA build of torch (from PyTorch's CUDA wheel index for your driver, e.g. its CUDA 13.0 "
            "one, set as pip's index)"
        )
    if arch is None:
        if env.capability is None:
            raise BuildError("no GPU is visible to pick the architecture from; fix: pass --arch, e.g. --arch 9.0")
        arch = f"{env.capability[0]}{env.capability[1]}"
    arch = arch.replace(".", "").replace("sm_", "")
    if not re.fullmatch(r"\d{2,3}a?", arch):
        raise BuildError(f"cannot read architecture {arch!r}; pass it as 9.0, 90 or sm_90")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(
            f"step 'find nvcc' failed: no nvcc on PATH or under CUDA_HOME; fix: install the CUDA toolkit {env.torch_cuda} "
            "(the release torch was built with) and set CUDA_HOME"
        )
    release = nvcc_release or nvcc_version(nvcc)
    if release is None:
        raise BuildError(f"step 'nvcc --version' failed for {nvcc}; fix: check the CUDA toolkit install")
    if release.split(".")[0] != env.torch_cuda.split(".")[0]:
        raise BuildError(
            f"nvcc {release} does not match torch's CUDA {env.torch_cuda}; fix: install the CUDA {env.torch_cuda.split('.')[0]}.x "
            "toolkit and point CUDA_HOME at it, or install a torch built for CUDA " + release
        )
    if ninja is None:
        ninja = shutil.which("ninja") is not None
    if not ninja:
        raise BuildError(
            "ninja is not installed (the arch-limited build needs torch's ninja path); fix: pip install ninja"
        )
    cache_dir = cache_dir or default_cache_dir()
    key = f"{package.distribution}-{package.version}-torch{env.torch}-cu{env.torch_cuda}-sm{arch}-py{''.join(env.python.split('.')[:2])}"
    if sdist is None:
        found = sorted((cache_dir / "sdist").glob(f"{package.import_name}-{package.version}.tar.gz"))
        if not found:
            raise BuildError(
                f"no sdist for {package.distribution} {package.version}; fix: pip download --no-deps --no-binary :all: "
                f"--no-build-isolation {package.distribution}=={package.version} -d {cache_dir / 'sdist'} "
                "(or pass --sdist PATH)"
            )
        sdist = found[0]
    sdist = Path(sdist)
    if not sdist.exists():
        raise BuildError(f"sdist {sdist} does not exist")
    wheel_dir = cache_dir / key
    keep_nvcc = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(nvcc_filter.__file__))} --keep {arch} --nvcc {shlex.quote(nvcc)} --"
    build_env = {
        **package.env,
        "TORCH_CUDA_ARCH_LIST": f"{arch[:-1]}.{arch[-1]}" if arch.isdigit() else arch,
        "MAX_JOBS": str(jobs or os.cpu_count() or 4),
        "PYTORCH_NVCC": keep_nvcc,
    }
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-w",
        str(wheel_dir),
        str(sdist),
    ]
    return BuildPlan(package, sdist, arch, key, wheel_dir, nvcc, build_env, command)


def cached_wheel(plan: BuildPlan) -> Path | None:
    wheels = sorted(plan.wheel_dir.glob(f"{plan.package.import_name}-{plan.package.version}-*.whl"))
    return wheels[0] if wheels else None


def _failure_summary(output: str) -> str:
    errors = [line for line in output.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]
    return "\n".join((errors or output.splitlines())[-8:])


NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")  # ninja's "[done/total] command" lines


def run_build(plan: BuildPlan, *, install: bool = True, echo=print, progress=None) -> Path:
    """Build (or reuse the cached wheel), then install it with pip (no dependencies, no index).

    ``progress(done, total)``, where given, gets ninja's compile steps as they finish (the CLI draws a bar from
    them; a build of causal-conv1d for one GPU takes minutes); other lines of note go to ``echo``."""
    wheel = cached_wheel(plan)
    if wheel is not None:
        echo(f"cached: {wheel}")
    else:
        plan.wheel_dir.mkdir(parents=True, exist_ok=True)
        echo(plan.describe())
        env = dict(os.environ, **plan.env)
        process = subprocess.Popen(plan.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            step = NINJA_STEP.match(line)
            if step is not None and progress is not None:
                progress(int(step[1]), int(step[2]))
            elif line.startswith(("[", "Successfully")) or "Building wheel" in line:
                echo(line.rstrip()[:200])
        if process.wait() != 0:
            raise BuildError(
                f"step 'compile {plan.package.distribution}' failed (exit {process.returncode}):\n"
                f"{_failure_summary(''.join(lines))}\n"
                f"fix: check that nvcc matches torch's CUDA and that torch is a CUDA build; fusepatch keeps using the "
                "other candidates meanwhile"
            )
        wheel = cached_wheel(plan)
        if wheel is None:
            raise BuildError(f"pip reported success but no wheel is in {plan.wheel_dir}")
        echo(f"built: {wheel}")
    if install:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
            check=True,
        )
        echo(f"installed {plan.package.distribution} from {wheel}")
    return wheel
