"""The one table of version facts: what fusepatch supports, which versions a test ran on, and what doctor pins.

``pyproject.toml``'s bounds, the README's support table, ``doctor``'s pins and the versions each private-name
table in ``fusepatch/backends/`` was checked on are all checked against :data:`SUPPORT` by
``tests/base/test_versions.py``, so a range cannot be widened here or there without a test run on its new end.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


def version_in(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (local labels such as ``+cu130`` ignored; pre-releases allowed)."""
    try:
        parsed = Version(version.split("+")[0])
        return SpecifierSet(spec).contains(parsed, prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False


@dataclass(frozen=True)
class Support:
    """One package's supported range, the versions a test ran on (the range's lower bound is one of them), and
    the version ``doctor`` recommends installing (the one the GPU tests and benchmarks ran with)."""

    name: str  # the pip distribution ("python" for the interpreter)
    spec: str  # the range pyproject.toml allows ("" = not a dependency of fusepatch: doctor's pin only)
    tested: tuple[str, ...]  # every version a test ran on; where: ``ran_on``
    ran_on: str  # which tests ran on which version
    extras: tuple[str, ...] = ()  # the pyproject extras that carry it (() = a core dependency, or none)
    pin: str = ""  # what doctor recommends: the GPU tests' version
    also: tuple[str, ...] = ()  # distributions released with it at the same version (fla-core: fla's kernels)
    # (which of its versions, a requirement they declare on another package of this table) from their metadata,
    # where it leaves out that package's lower bound: TRL 1.16 needs accelerate >= 1.10.1, so the extra that
    # carries both starts accelerate there (spec_in), and transformers 5.25 needs kernels >= 0.19.1
    requires: tuple[tuple[str, str], ...] = ()

    @property
    def lowest(self) -> str:
        """The spec's lower bound (``>=`` or ``==``), or ``""``."""
        for spec in SpecifierSet(self.spec):
            if spec.operator in (">=", "==", "~="):
                return spec.version
        return ""

    def requirement(self) -> str:
        """The requirement string as pyproject.toml writes it."""
        return f"{self.name}{self.spec}"


# Each entry's ``tested`` must contain a version at its lower bound (tests/base/test_versions.py checks it).
SUPPORT: dict[str, Support] = {
    s.name: s
    for s in (
        Support("python", ">=3.11", ("3.11.7", "3.12"), "3.11: CI; 3.12: the GPU suite"),
        Support(
            "torch",
            ">=2.11,<2.15",
            ("2.11.0", "2.13.0", "2.14.1"),
            "2.11 + CUDA 13: the GPU suite; 2.13 CPU: CI, every test; 2.14.1 CUDA build without a GPU: CI, the "
            "tests of device and build detection and a patched training step",
        ),
        Support(
            "transformers",
            ">=5.17,<5.26",
            ("5.17.0", "5.25.0"),
            "5.25: CI, every test; 5.17: CI, the tests its modeling code reaches, and the GPU suite",
            requires=((">=5.25", "kernels>=0.19.1,<0.20"),),  # a core dependency from 5.25 on; none before
        ),
        Support("packaging", ">=23", ("23.0", "26.4"), "23.0: the version tests; 26.4: CI"),
        Support("numpy", ">=1.26", ("1.26.4", "2.4.6"), "1.26: the packing tests; 2.4: CI"),
        Support("platformdirs", ">=4", ("4.0.0", "4.14.9"), "4.0: the build tests; 4.14: CI"),
        Support(
            "flash-linear-attention",
            ">=0.6,<0.7",
            ("0.6.0",),
            "the GPU suite",
            extras=("cuda",),
            pin="0.6.0",
            also=("fla-core",),
        ),
        Support("causal-conv1d", ">=1.7,<1.8", ("1.7.0",), "the GPU suite", extras=("cuda",), pin="1.7.0"),
        Support("tilelang", "", ("0.1.15",), "the GPU suite (fla's Hopper backward)", pin="0.1.15"),
        Support(
            "kernels",
            ">=0.17,<0.20",
            ("0.17.2", "0.19.1"),
            "0.17.2: the GPU suite; 0.19.1: CI, the hub tests",
            extras=("hub", "test"),
            pin="0.17.2",
        ),
        Support(
            "datasets",
            ">=3",
            ("3.0.0", "4.7.0", "5.2.0"),
            "3.0: the example's tests; 4.7.0, the test extra's lower bound (TRL 1.16's): the TRL and example tests, "
            "on transformers 5.17 (datasets before 5.1 need huggingface-hub < 2, transformers 5.25 needs 2); 5.2: CI",
            extras=("data", "test"),
        ),
        Support(
            "accelerate",
            ">=1.3",
            ("1.3.0", "1.10.1", "1.16.0"),
            "1.3.0: the Trainer tests (transformers 5.25's Trainer passes unwrap_model a keyword 1.2.1 lacks); "
            "1.10.1, the test extra's lower bound (TRL 1.16's): the Trainer and TRL tests; 1.16: CI",
            extras=("train", "test"),
        ),
        Support("pytest", ">=8", ("8.0.0", "9.2.0"), "8.0: the CPU suite; 9.2: CI", extras=("test",)),
        Support(
            "pytest-xdist",
            ">=3.2",
            ("3.2.0", "3.8.0"),
            "3.2: the first with --dist worksteal (pyproject's addopts); 3.8: CI",
            extras=("test",),
        ),
        Support(
            "ruff",
            ">=0.13",
            ("0.13.0", "0.17.6"),
            "ruff check and ruff format --check: 0.13.0 is the first that passes (0.12 has UP038); 0.17.6: CI",
            extras=("test",),
        ),
        Support(
            "trl",
            ">=1.16",
            ("1.16.0",),
            "CI and the GPU suite",
            extras=("test",),
            requires=(("==1.16.0", "accelerate>=1.10.1"), ("==1.16.0", "datasets>=4.7.0")),
        ),
        Support("peft", ">=0.21", ("0.21.2",), "CI", extras=("test",)),
        Support(
            "deepspeed",
            ">=0.19,<0.20",
            ("0.19.8",),
            "CI: the ZeRO-2/3 tests on DeepSpeed's CPU accelerator (tests/integrations/test_deepspeed.py)",
            extras=("deepspeed", "test"),
        ),
        Support("triton", ">=3.6", ("3.6.0", "3.9.0"), "3.6: the GPU suite; 3.9: CI", extras=("test",)),
    )
}


def spec_in(name: str, extra: str = "") -> str:
    """The range pyproject writes for ``name`` in ``extra`` ("" = the core dependencies): its SUPPORT range, the lower
    bound raised to what the lowest version of a package beside it there requires (``requires``), so that the extra
    installs with every package at its lower bound."""
    entry = SUPPORT[name]
    floor = Version(entry.lowest)
    for other in SUPPORT.values():
        if not other.spec or other.name == "python" or (other.extras and extra not in other.extras):
            continue
        for versions, line in other.requires:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) != name or not version_in(other.lowest, versions):
                continue
            floor = max([floor, *(Version(s.version) for s in requirement.specifier if s.operator == ">=")])
    if floor == Version(entry.lowest):
        return entry.spec
    return ",".join([f">={floor}", *(str(s) for s in SpecifierSet(entry.spec) if s.operator not in (">=", "=="))])


def support(distribution: str) -> Support:
    """The entry for ``distribution``, also under a name it is released with (``fla-core``)."""
    for entry in SUPPORT.values():
        if distribution == entry.name or distribution in entry.also:
            return entry
    raise KeyError(f"{distribution} is not in fusepatch.base.versions.SUPPORT")
