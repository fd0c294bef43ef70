"""What fusepatch reaches into a foreign kernel package for (private functions, module layout, compiled-extension
signatures) and the versions that was checked on: one :class:`PrivateNames` table per package in
``fusepatch/backends/``. A name missing from the installed version is a WARNING naming the fallback and the fix,
once per process."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from fusepatch.base.state import current as process_state

logger = logging.getLogger("fusepatch")


def drifted() -> tuple[str, ...]:
    """The drift lines reported so far in this process (what the report lists under ``drift``)."""
    return tuple(process_state().drift)


@dataclass(frozen=True)
class PrivateNames:
    """What fusepatch reaches into one package for, and on which versions that was checked."""

    distribution: str  # the pip distribution that carries the modules
    checked: tuple[str, ...]  # versions every name below was read against (and the GPU tests ran on)
    names: Mapping[str, tuple[str, ...]]  # module -> attributes fusepatch uses ("" = the module itself)
    fix: str  # the install command that gets a checked version

    def installed(self) -> str | None:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def is_checked(self, version: str | None = None) -> bool:
        """Whether ``version`` (default: the installed one) has the release of a checked version."""
        version = version or self.installed()
        if version is None:
            return False
        try:
            release = Version(version).release
        except InvalidVersion:
            return False
        return any(Version(v).release == release for v in self.checked)

    def missing(self) -> list[str]:
        """``module.name`` for every name the installed package lacks (imports the modules: call on a GPU machine
        or where importing them is harmless)."""
        gone: list[str] = []
        for module_name, attributes in self.names.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                gone.append(module_name)
                continue
            gone.extend(f"{module_name}.{a}" for a in attributes if a and not hasattr(module, a))
        return gone

    def drift(self, what: str, fallback: str) -> None:
        """Report, once per ``what``, that the installed package no longer has what fusepatch uses, and what runs
        instead. ``what``: the name or signature found wanting; ``fallback``: what fusepatch does instead."""
        process = process_state()
        if not process.said.first(f"drift {self.distribution}: {what}"):
            return
        version = self.installed() or "?"
        line = (
            f"{self.distribution} {version}: {what} (checked on {', '.join(self.checked)}); {fallback}; fix: {self.fix}"
        )
        process.drift.append(line)
        logger.warning("fusepatch: %s", line)

    def to_dict(self, probe: bool = False) -> dict:
        """For doctor: the table, the installed version, and (``probe``) the names it lacks."""
        version = self.installed()
        out = {
            "distribution": self.distribution,
            "installed": version,
            "checked": list(self.checked),
            "checked_here": self.is_checked(version),
            "names": {m: list(a) for m, a in self.names.items()},
        }
        if probe and version is not None:
            out["missing"] = self.missing()
        return out
