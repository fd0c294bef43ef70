"""A snapshot of the facts every compatibility rule reads.

The snapshot is a plain value: tests build one by hand (``Environment(torch="2.11.0", ...)``) so that
every rule can be checked without the hardware or packages it talks about.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from fusepatch.base.state import current as process_state
from fusepatch.base.versions import SUPPORT

# Distributions whose versions decide what can run. Versions come from importlib.metadata, never from
# importing the package, so a broken install still shows its version.
TRACKED_DISTRIBUTIONS: tuple[str, ...] = (
    "torch",
    "triton",
    "transformers",
    "flash-linear-attention",
    "fla-core",
    "causal-conv1d",
    "tilelang",
    "kernels",
    "liger-kernel",
    "accelerate",
    "datasets",
)

OFFLINE_VARIABLES: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


TRANSFORMERS_REQUIREMENT = SUPPORT["transformers"].requirement()


class MissingDependency(ImportError):
    """A package fusepatch needs for this call is not installed: the message names the install command."""


def require_transformers():
    """``transformers``, or one clear error naming the install command (the models fusepatch patches are its)."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise
        raise MissingDependency(
            f"fusepatch needs transformers to build or patch Qwen models, and it is not installed; "
            f"fix: pip install '{TRANSFORMERS_REQUIREMENT}'"
        ) from None
    return transformers


def flag_set(*names: str) -> bool:
    """Whether any of these environment variables is switched on (1/true/yes/on, any case)."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on") for name in names)


def offline_mode() -> bool:
    """Hugging Face offline mode: the Hub is read from the local cache only."""
    return flag_set(*OFFLINE_VARIABLES)


@dataclass(frozen=True)
class GPU:
    """One visible accelerator."""

    name: str
    capability: tuple[int, int]

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def _frozen(mapping: Mapping[str, str | None] | None) -> Mapping[str, str | None]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Environment:
    """What this process can run: versions, devices, import results, offline flags.

    Args:
        python: Python version, e.g. ``"3.12.3"``.
        torch: torch version or ``None`` when torch is missing.
        torch_cuda: CUDA version torch was built with (``torch.version.cuda``), ``None`` for a CPU build.
        cuda_available: whether ``torch.cuda.is_available()``.
        gpus: visible GPUs, in device order.
        distributions: distribution name -> installed version (missing ones absent).
        imports: import name -> ``None`` when ``import`` worked, else the error text. Only modules that
            were probed appear; a module absent here counts as "not probed".
        offline: whether Hugging Face offline mode is set.
    """

    python: str = "3.12.0"
    platform: str = "linux"
    torch: str | None = None
    torch_cuda: str | None = None
    cuda_available: bool = False
    gpus: tuple[GPU, ...] = ()
    distributions: Mapping[str, str] = field(default_factory=dict)
    imports: Mapping[str, str | None] = field(default_factory=dict)
    offline: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "distributions", _frozen(self.distributions))
        object.__setattr__(self, "imports", _frozen(self.imports))

    @property
    def triton(self) -> str | None:
        return self.distributions.get("triton")

    @property
    def transformers(self) -> str | None:
        return self.distributions.get("transformers")

    @property
    def capability(self) -> tuple[int, int] | None:
        """Compute capability of the first GPU (the one ``cuda`` means by default)."""
        return self.gpus[0].capability if self.gpus else None

    def version(self, distribution: str) -> str | None:
        return self.distributions.get(distribution)

    def import_error(self, module: str) -> str | None:
        """The error importing ``module`` raised, ``None`` when it imported (or was not probed)."""
        return self.imports.get(module)

    def imported(self, module: str) -> bool:
        return module in self.imports and self.imports[module] is None

    def with_imports(self, modules: Iterable[str]) -> Environment:
        """This snapshot plus import probes of ``modules`` not probed yet (imports really happen)."""
        missing = [m for m in modules if m not in self.imports]
        if not missing:
            return self
        imports = dict(self.imports)
        imports.update({m: probe_import(m) for m in missing})
        return replace(self, imports=imports)

    def with_distributions(self, names: Iterable[str]) -> Environment:
        """This snapshot plus the installed versions of ``names`` it does not list yet (a user's own kernel
        package, say): read from package metadata, nothing imported."""
        missing = [n for n in names if n not in self.distributions]
        found = _distribution_versions(missing)
        if not found:
            return self
        return replace(self, distributions={**self.distributions, **found})

    def to_dict(self) -> dict:
        return {
            "python": self.python,
            "platform": self.platform,
            "torch": self.torch,
            "torch_cuda": self.torch_cuda,
            "cuda_available": self.cuda_available,
            "gpus": [{"name": g.name, "capability": list(g.capability), "arch": g.arch} for g in self.gpus],
            "triton": self.triton,
            "transformers": self.transformers,
            "distributions": dict(self.distributions),
            "imports": dict(self.imports),
            "offline": self.offline,
        }


def probe_import(module: str) -> str | None:
    """Import ``module``; return ``None`` on success, else ``"ExcType: message"`` (first line)."""
    try:
        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - an ABI error can be any exception type
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return None


def _distribution_versions(names: Iterable[str]) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _gpus() -> tuple[GPU, ...]:
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        gpus.append(GPU(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))))
    return tuple(gpus)


def capture(*, refresh: bool = False, probe: Iterable[str] = ()) -> Environment:
    """Snapshot this process's environment (cached per process; ``refresh`` re-reads it).

    Args:
        refresh: read versions and devices again instead of using the cached snapshot.
        probe: import names to try importing now (results go to ``Environment.imports``).

    Returns:
        The snapshot. Example::

            >>> env = capture()
            >>> env.torch is not None
            True
    """
    process = process_state()
    if process.environment is None or refresh:
        try:
            import torch

            torch_version = torch.__version__.split("+")[0]
            torch_cuda = torch.version.cuda
            cuda_available = bool(torch.cuda.is_available())
        except ImportError:
            torch_version, torch_cuda, cuda_available = None, None, False
        offline = offline_mode()
        process.environment = Environment(
            python=platform.python_version(),
            platform=sys.platform,
            torch=torch_version,
            torch_cuda=torch_cuda,
            cuda_available=cuda_available,
            gpus=_gpus(),
            distributions=_distribution_versions(TRACKED_DISTRIBUTIONS),
            offline=offline,
        )
    if probe:
        process.environment = process.environment.with_imports(probe)
    return process.environment
