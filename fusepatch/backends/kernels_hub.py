"""Kernels from the Hugging Face Kernel Hub, through the ``kernels`` package, and the table of its private names.

Resolution uses ``kernels`` itself, in this order: a local kernel directory (``LOCAL_KERNELS=repo=path``, for
offline and air-gapped use), a lock file (``FUSEPATCH_KERNELS_LOCK=kernels.lock``: the pinned commit, from the
local cache only, never downloaded), else the Hub (``HF_HUB_OFFLINE=1``: the local cache only). Publishers
other than ``kernels-community`` are refused unless the user opts in with ``FUSEPATCH_TRUST_KERNELS``. When no
build variant fits this machine, the reason carries ``kernels``' accept/reject trace of every variant.

Of ``kernels``, fusepatch uses the public ``get_kernel``, ``get_local_kernel`` and ``load_kernel`` and two internals,
the lock-file parser and the build-variant resolver: ``NAMES`` lists them with the versions they were checked on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from fusepatch.base.env import Environment, offline_mode
from fusepatch.base.op import Candidate
from fusepatch.base.options import kernels_lock, trusted_kernels
from fusepatch.base.private_names import PrivateNames
from fusepatch.base.requirements import OK, DistributionVersion, Importable, InputRule, Verdict, reject
from fusepatch.base.versions import SUPPORT

DISTRIBUTION = "kernels"
REQUIRED = SUPPORT[DISTRIBUTION].spec  # fusepatch/base/versions.py
FIX = f'pip install "{DISTRIBUTION}{REQUIRED}"'  # fusepatch's [hub] extra, for a clone: pip install -e ".[hub]"


def _variants_module() -> str:
    """Where ``kernels`` keeps its build-variant resolver: ``kernels.variants`` up to 0.18, then
    ``kernels._internals.variants`` (0.19 moved it). Read from the installed version, without importing it."""
    try:
        version = Version(importlib.metadata.version(DISTRIBUTION))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return "kernels.variants"
    return "kernels._internals.variants" if version >= Version("0.19") else "kernels.variants"


VARIANTS = _variants_module()  # read once: the installed version does not change under a running process

NAMES = PrivateNames(
    distribution=DISTRIBUTION,
    # 0.17.2: the GPU machine's; 0.19.1: read against, and the hub tests run on it (the CPU suite installs it)
    checked=("0.17.2", "0.19.1"),
    names={
        "kernels": ("get_kernel", "get_local_kernel", "load_kernel"),
        "kernels._rust": ("KernelLocks",),
        VARIANTS: ("VariantAccepted", "get_variants_local", "resolve_variants"),
    },
    fix=FIX,
)


TRUSTED_PUBLISHERS: tuple[str, ...] = ("kernels-community",)


def local_overrides() -> dict[str, Path]:
    """``LOCAL_KERNELS``, parsed as ``kernels`` does: ``repo_a=path_a:repo_b=path_b``."""
    text = os.environ.get("LOCAL_KERNELS", "")
    found = {}
    for entry in filter(None, text.split(":")):
        if "=" in entry:
            repo, path = entry.split("=", 1)
            found[repo] = Path(path)
    return found


def lock_file() -> Path | None:
    """``FUSEPATCH_KERNELS_LOCK`` (a path that is no file raises, naming it)."""
    path = kernels_lock()
    return Path(path) if path else None


def locked_commit(repo_id: str, lockfile: Path) -> str | None:
    """The commit ``lockfile`` pins ``repo_id`` to (read with ``kernels``' own parser), or None."""
    from kernels._rust import KernelLocks

    locks = KernelLocks.from_json(lockfile.read_text())
    for dependency, lock in locks.items():
        if dependency.repo_id == repo_id:
            return str(lock.commit)  # a str up to 0.18, a git object id (``Oid``) from 0.19
    return None


class KernelNotCached(RuntimeError):
    """A Hub kernel that offline mode cannot fetch; ``fix`` says how to get it there."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def trusted(repo_id: str) -> bool:
    allowed = trusted_kernels()
    if allowed == ("*",):
        return True
    return repo_id.split("/", 1)[0] in TRUSTED_PUBLISHERS or repo_id in allowed or repo_id.split("/", 1)[0] in allowed


def variant_trace(path: Path) -> list[str]:
    """``kernels``' accept/reject decision for every build variant in a local kernel directory (empty, said once
    as drift, where the installed ``kernels`` has no resolver where fusepatch looks)."""
    try:
        variants_module = importlib.import_module(VARIANTS)
        accepted = variants_module.VariantAccepted
        variants = variants_module.get_variants_local(path / "build") or variants_module.get_variants_local(path)
        _, decisions = variants_module.resolve_variants(variants)
    except (ImportError, AttributeError) as exc:
        NAMES.drift(f"{VARIANTS}'s variant resolver ({exc})", "the rejection names no build variants")
        return []
    return [f"{d.variant.variant_str}: " + ("compatible" if isinstance(d, accepted) else d.reason) for d in decisions]


@dataclass(frozen=True)
class TrustedPublisher:
    """A Hub repo from a trusted publisher, or one the user opted into. Local directories and lock-pinned
    commits are the user's own choice and need no opt-in."""

    repo_id: str

    def check(self, env: Environment) -> Verdict:
        if self.repo_id in local_overrides() or lock_file() is not None or trusted(self.repo_id):
            return OK
        publisher = self.repo_id.split("/", 1)[0]
        return reject(
            f"publisher {publisher!r} is not a trusted kernel publisher ({', '.join(TRUSTED_PUBLISHERS)})",
            f"opt in: FUSEPATCH_TRUST_KERNELS={self.repo_id}",
        )

    def describe(self) -> str:
        return f"trusted publisher of {self.repo_id}"


@dataclass(frozen=True)
class HubKernel:
    """Where a Hub kernel lives and which function of it implements the op.

    Args:
        repo_id: ``"kernels-community/activation"``.
        function: the attribute of the loaded kernel module to call.
        version: the kernel's major version (``kernels``' ``version=``), or
        revision: a branch, tag or commit.
        adapter: turns the kernel's function into the op's signature (default: used as it is).
    """

    repo_id: str
    function: str
    version: int | None = 1
    revision: str | None = None
    adapter: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None

    def load_module(self):
        import kernels

        overrides = local_overrides()
        if self.repo_id in overrides:
            path = overrides[self.repo_id]
            try:
                return kernels.get_local_kernel(path)
            except FileNotFoundError as exc:
                trace = "; ".join(variant_trace(path)) or "no build variants"
                raise RuntimeError(f"no build variant of {self.repo_id} fits this machine ({trace})") from exc
        lockfile = lock_file()
        if lockfile is not None:
            commit = locked_commit(self.repo_id, lockfile)
            if commit is None:
                raise RuntimeError(f"{self.repo_id} is not pinned in {lockfile}; lock it with `kernels lock`")
            return kernels.load_kernel(self.repo_id, lockfile=lockfile)
        try:
            return kernels.get_kernel(
                self.repo_id, version=self.version, revision=self.revision, trust_remote_code=trusted(self.repo_id)
            )
        except Exception as exc:
            if not offline_mode():
                raise
            pin = f"revision={self.revision!r}" if self.revision else f"version={self.version}"
            raise KernelNotCached(
                f"{self.repo_id} ({pin}) is not in the local Hugging Face cache and offline mode is set "
                f"({type(exc).__name__})",
                fix=(
                    f'download it once where there is network: python -c "import kernels; '
                    f"kernels.get_kernel('{self.repo_id}', {pin})\" (then copy ~/.cache/huggingface), "
                    f"or LOCAL_KERNELS={self.repo_id}=/path/to/kernel"
                ),
            ) from exc

    def load(self) -> Callable[..., Any]:
        module = self.load_module()
        if not hasattr(module, self.function):
            raise AttributeError(f"{self.repo_id} has no function {self.function!r}")
        fn = getattr(module, self.function)
        return self.adapter(fn) if self.adapter else fn

    def where(self) -> str:
        overrides = local_overrides()
        if self.repo_id in overrides:
            return f"local {overrides[self.repo_id]}"
        lockfile = lock_file()
        if lockfile is not None:
            return f"locked {locked_commit(self.repo_id, lockfile) or '?'} ({lockfile})"
        pin = f"revision {self.revision}" if self.revision else f"version {self.version}"
        return f"hub {pin}"


def hub_candidate(
    kernel: HubKernel,
    *,
    name: str | None = None,
    inputs: InputRule | None = None,
    requirements: tuple = (),
) -> Candidate:
    """A ``source="hub"`` candidate for an op. Add it with :func:`fusepatch.add_candidate`.

    Example::

        >>> kernel = fusepatch.HubKernel("kernels-community/activation", "silu_and_mul", version=1, adapter=my_adapter)
        >>> fusepatch.add_candidate("swiglu", fusepatch.hub_candidate(kernel))  # doctest: +SKIP
    """
    return Candidate(
        name=name or f"hub:{kernel.repo_id}",
        source="hub",
        requirements=(
            *requirements,
            DistributionVersion(DISTRIBUTION, REQUIRED, FIX),
            Importable("kernels", DISTRIBUTION, FIX),
            TrustedPublisher(kernel.repo_id),
        ),
        load=kernel.load,
        inputs=inputs or InputRule(),
        provides=f"{kernel.repo_id}:{kernel.function}",
        where=kernel.where,  # at choice time: LOCAL_KERNELS or a lock file set after import count
    )
