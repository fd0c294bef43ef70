"""What fusepatch reaches into a foreign kernel package for (private functions, module layout, compiled-extension
signatures) and the versions that was checked on: one :class:`PrivateNames` table per package in
``fusepatch/backends/``. A name missing from the installed version is a WARNING naming the fallback and the fix,
once per process."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from fusepatch.base.state import current as process_state

logger = logging.getLogger("fusepatch")

# what a name found missing by a probe (doctor) costs: the ops that use it say which kernel runs instead
PROBE_FALLBACK = "what uses it falls back (python -m fusepatch doctor lists each op's kernel)"


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
    # module -> the optional distribution it needs (fla's TileLang backend: tilelang); probed only where installed
    optional: Mapping[str, str] = field(default_factory=dict)
    # why importing the modules needs a GPU ("" = importing them is harmless anywhere): not probed without one
    import_needs_gpu: str = ""

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

    def absent_backends(self) -> dict[str, str]:
        """Module -> the optional distribution it needs that is not installed (its names are not probed)."""
        out = {}
        for module_name, needs in self.optional.items():
            try:
                importlib.metadata.version(needs)
            except importlib.metadata.PackageNotFoundError:
                out[module_name] = needs
        return out

    def missing(self) -> list[str]:
        """``module.name`` for every name the installed package lacks, each reported once as drift (a WARNING).
        A module whose import raises anything counts as missing with its error; the modules of an optional
        backend that is not installed are skipped. Imports the modules: see ``import_needs_gpu``."""
        gone: list[str] = []
        skipped = self.absent_backends()
        for module_name, attributes in self.names.items():
            if module_name in skipped:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # fla-core 0.5.2 under Triton 3.9 raises ValueError at import, not ImportError
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                gone.append(module_name)
                self.drift(f"{module_name} cannot be imported ({type(exc).__name__}: {first})", PROBE_FALLBACK)
                continue
            for name in (f"{module_name}.{a}" for a in attributes if a and not hasattr(module, a)):
                gone.append(name)
                self.drift(f"{name} is missing", PROBE_FALLBACK)
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

    def to_dict(self, probe: bool = False, gpu: bool = False) -> dict:
        """For doctor: the table, the installed version, and (``probe``) the names it lacks, or why they were
        not probed. ``gpu``: a GPU is visible, so modules whose import needs one can be imported."""
        version = self.installed()
        out = {
            "distribution": self.distribution,
            "installed": version,
            "checked": list(self.checked),
            "checked_here": self.is_checked(version),
            "names": {m: list(a) for m, a in self.names.items()},
        }
        if version is None:
            return out
        if not probe:
            out["not_probed"] = "--static imports nothing"
        elif self.import_needs_gpu and not gpu:
            out["not_probed"] = f"no GPU here, and {self.import_needs_gpu}"
        else:
            out["missing"] = self.missing()
            out["skipped"] = {m: f"{d} is not installed" for m, d in self.absent_backends().items()}
        return out
