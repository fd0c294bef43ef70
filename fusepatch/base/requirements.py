"""Rules that decide whether a kernel candidate may run: each checks one fact and says why not.

A ``Requirement`` reads an :class:`~fusepatch.base.env.Environment` (static facts) and returns a ``Verdict``.
Per-call facts (the tensors' device and dtype) are checked by :class:`Inputs` rules, since a model can be
moved between devices after ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from fusepatch.base.env import Environment
from fusepatch.base.known_issues import KNOWN_ISSUES, matching_issues
from fusepatch.base.versions import version_in


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: ``ok``, or a reason a person can act on and the fix."""

    ok: bool
    reason: str = ""
    fix: str = ""
    # each failed check's (reason, fix) when several are joined above, so the report can group equal reasons
    parts: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return self.ok


OK = Verdict(True)


def reject(reason: str, fix: str = "") -> Verdict:
    return Verdict(False, reason, fix)


class Requirement(Protocol):
    def check(self, env: Environment) -> Verdict: ...

    def describe(self) -> str: ...


def _within(name: str, version: str | None, spec: str, fix: str, why: str = "") -> Verdict:
    """``name`` installed (``version``) within ``spec`` ("": any), else why not with ``fix``."""
    if version is None:
        return reject(f"{name} is not installed", fix)
    if spec and not version_in(version, spec):
        because = f" ({why})" if why else ""
        return reject(f"{name} {version} is installed, {spec} is needed{because}", fix)
    return OK


@dataclass(frozen=True)
class DistributionVersion:
    """An installed distribution within a version range (read from package metadata, never imported)."""

    distribution: str
    spec: str = ""
    fix: str = ""
    why: str = ""

    def check(self, env: Environment) -> Verdict:
        fix = self.fix or f'pip install "{self.distribution}{self.spec}"'
        return _within(self.distribution, env.version(self.distribution), self.spec, fix, self.why)

    def describe(self) -> str:
        return f"{self.distribution}{self.spec}"


@dataclass(frozen=True)
class Importable:
    """A module imports in this process. An installed package that fails to import says the real error."""

    module: str
    distribution: str
    fix: str = ""

    def check(self, env: Environment) -> Verdict:
        fix = self.fix or f"pip install {self.distribution}"
        if self.module not in env.imports:
            return reject(f"import {self.module} was not tried", fix)
        error = env.imports[self.module]
        if error is None:
            return OK
        version = env.version(self.distribution)
        if version is None and ("No module named" in error):
            return reject(f"{self.distribution} is not installed", fix)
        installed = f"{self.distribution} {version} is installed but" if version else f"{self.module}"
        return reject(
            f"{installed} import {self.module} fails: {error}",
            f"reinstall it for this torch/CUDA: pip install --force-reinstall --no-deps {self.distribution}"
            if version
            else fix,
        )

    def describe(self) -> str:
        return f"import {self.module}"

    @property
    def probes(self) -> tuple[str, ...]:
        return (self.module,)


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA GPU is visible to torch."""

    fix: str = "run on a machine with an NVIDIA GPU and a CUDA build of torch (pip install torch)"

    def check(self, env: Environment) -> Verdict:
        if env.torch is None:
            return reject("torch is not installed", "pip install torch")
        if env.torch_cuda is None:
            return reject(f"torch {env.torch} is a CPU-only build (no CUDA device)", self.fix)
        if not env.cuda_available or not env.gpus:
            return reject("no CUDA device is visible", "check nvidia-smi and CUDA_VISIBLE_DEVICES")
        return OK

    def describe(self) -> str:
        return "a CUDA GPU"


@dataclass(frozen=True)
class MinCapability:
    """The GPU's compute capability is at least ``minimum`` (e.g. (8, 0) for Ampere)."""

    minimum: tuple[int, int]
    kernel: str = "this kernel"

    def check(self, env: Environment) -> Verdict:
        cap = env.capability
        if cap is None:
            return reject("no CUDA device is visible", "run on an NVIDIA GPU")
        if tuple(cap) < tuple(self.minimum):
            need = f"sm_{self.minimum[0]}{self.minimum[1]}"
            return reject(
                f"{env.gpus[0].name} is {env.gpus[0].arch}; {self.kernel} needs {need} or newer",
                f"use a GPU with compute capability >= {self.minimum[0]}.{self.minimum[1]}",
            )
        return OK

    def describe(self) -> str:
        return f"GPU >= sm_{self.minimum[0]}{self.minimum[1]}"


@dataclass(frozen=True)
class TorchVersion:
    spec: str

    def check(self, env: Environment) -> Verdict:  # the torch this process runs, not the metadata's
        return _within("torch", env.torch, self.spec, f'pip install "torch{self.spec}"')

    def describe(self) -> str:
        return f"torch{self.spec}"


@dataclass(frozen=True)
class NoKnownIssue:
    """No entry of the known-issues table matches this stack for ``package`` (see ``base/known_issues.py``)."""

    package: str

    def check(self, env: Environment) -> Verdict:
        for issue in matching_issues(self.package, env):
            return reject(issue.summary(env), issue.fix)
        return OK

    def describe(self) -> str:
        return f"no known-bad {self.package} stack"

    @property
    def probes(self) -> tuple[str, ...]:
        return tuple(i.unless_importable for i in KNOWN_ISSUES if i.package == self.package and i.unless_importable)


@dataclass(frozen=True)
class Inputs:
    """Per-call facts about the tensors an op is called with."""

    device_type: str
    dtype: str  # "bfloat16", "float16", "float32", ...


@dataclass(frozen=True)
class InputRule:
    """Which devices and dtypes a candidate accepts, with the fix for each refusal."""

    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    kernel: str = "the kernel"
    notes: dict[str, str] = field(default_factory=dict)  # dtype -> the fix, when refused
    why: dict[str, str] = field(default_factory=dict)  # dtype -> why it is refused (a measured reason)

    def check(self, inputs: Inputs) -> Verdict:
        if inputs.device_type not in self.devices:
            where = " or ".join(self.devices)
            return reject(
                f"tensors are on {inputs.device_type}; {self.kernel} runs on {where} only",
                f"move the model to a GPU (model.to('{self.devices[0]}')) to use {self.kernel}",
            )
        if inputs.dtype not in self.dtypes:
            allowed = "/".join(self.dtypes)
            why = f": {self.why[inputs.dtype]}" if inputs.dtype in self.why else ""
            return reject(
                f"{inputs.dtype} inputs; {self.kernel} takes {allowed}{why}",
                self.notes.get(
                    inputs.dtype, f"load the model in {self.dtypes[0]} (torch_dtype=torch.{self.dtypes[0]})"
                ),
            )
        return OK
