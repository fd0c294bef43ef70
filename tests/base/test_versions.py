"""One table of version facts (fusepatch/base/versions.py): pyproject, the README, doctor, CI and the private-name
tables all agree with it, and every lower bound is a version a test ran on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import tomllib

import pytest
from helpers import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from fusepatch import backends
from fusepatch.backends import causal_conv1d as conv_backend
from fusepatch.backends import fla as fla_backend
from fusepatch.backends import kernels_hub
from fusepatch.base.env import TRANSFORMERS_REQUIREMENT
from fusepatch.base.versions import SUPPORT, spec_in, support, version_in
from fusepatch.tools import build, doctor

ROOT = REPO
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _release(version: str) -> tuple[int, ...]:
    """``2.11`` and ``2.11.0`` alike: the release without trailing zeros."""
    release = list(Version(version).release)
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return tuple(release)


def _lowest(spec: str) -> str:
    return next(s.version for s in SpecifierSet(spec) if s.operator in (">=", "=="))


def _requirements() -> dict[str, list[tuple[str, Requirement]]]:
    """Every requirement in pyproject, by name: (where: "" or the extra, the requirement)."""
    project = PYPROJECT["project"]
    found: dict[str, list[tuple[str, Requirement]]] = {}
    for where, lines in [("", project["dependencies"]), *project["optional-dependencies"].items()]:
        for line in lines:
            requirement = Requirement(line)
            found.setdefault(requirement.name, []).append((where, requirement))
    return found


def test_pyproject_bounds_are_the_table():
    project = PYPROJECT["project"]
    assert SpecifierSet(project["requires-python"]) == SpecifierSet(SUPPORT["python"].spec)
    lowest_python = Version(SUPPORT["python"].lowest)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{lowest_python.major}{lowest_python.minor}"
    found = _requirements()
    for name, entries in found.items():
        if name == "fusepatch":
            continue
        entry = support(name)
        for where, requirement in entries:
            expected = SpecifierSet(spec_in(entry.name, where))
            assert requirement.specifier == expected, (name, where, str(requirement.specifier), str(expected))
    for entry in SUPPORT.values():
        if not entry.spec or entry.name == "python":
            continue
        places = {where for where, _ in found.get(entry.name, [])}
        assert places == (set(entry.extras) or {""}), (entry.name, places)
    assert TRANSFORMERS_REQUIREMENT == "transformers" + SUPPORT["transformers"].spec


def test_every_lower_bound_was_tested_and_every_tested_version_is_in_range():
    for entry in SUPPORT.values():
        assert entry.tested and entry.ran_on, entry.name
        for version in entry.tested:
            assert not entry.spec or version_in(version, entry.spec), (entry.name, version)
        if entry.lowest:
            assert _release(entry.lowest) in {_release(v)[: len(_release(entry.lowest))] for v in entry.tested}
            assert any(_release(v)[: len(_release(entry.lowest))] == _release(entry.lowest) for v in entry.tested)
        if entry.pin:
            assert entry.pin in entry.tested, entry.name
        for extra in entry.extras:  # an extra's raised lower bound (spec_in) was tested too
            lowest = _release(_lowest(spec_in(entry.name, extra)))
            assert any(_release(v)[: len(lowest)] == lowest for v in entry.tested), (entry.name, extra)


def test_each_extra_installs_at_its_lower_bounds():
    """Every package of the core and of each extra at pyproject's lower bound, together: what each one's lowest
    version requires of the others (SUPPORT's ``requires``, from their metadata) takes in their lower bounds."""
    found = _requirements()
    core = {name: requirement for name, entries in found.items() for where, requirement in entries if not where}
    for extra in ("", *PYPROJECT["project"]["optional-dependencies"]):
        beside = core | {name: r for name, entries in found.items() for where, r in entries if where == extra}
        for name, requirement in beside.items():
            if name == "fusepatch":
                continue
            lowest = _lowest(str(requirement.specifier))
            for versions, line in support(name).requires:
                needed = Requirement(line)
                if version_in(lowest, versions) and needed.name in beside:
                    floor = _lowest(str(beside[needed.name].specifier))
                    assert needed.specifier.contains(floor), f"[{extra}]: {name} {lowest} needs {line}, not {floor}"


def _declared(distribution: str) -> dict[str, SpecifierSet]:
    """What the installed ``distribution`` requires of the other packages of SUPPORT (its extras left out)."""
    names = {canonicalize_name(n) for e in SUPPORT.values() if e.spec for n in (e.name, *e.also)}
    declared = {}
    for line in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(requirement.name) in names - {canonicalize_name(distribution)}:
            declared[canonicalize_name(requirement.name)] = requirement.specifier
    return declared


def test_recorded_requirements_are_the_installed_metadata():
    """SUPPORT's ``requires`` are what the installed packages declare; and where an installed package is at its
    lower bound (TRL 1.16.0 in CI), or is transformers (each release of its range has its own requirements),
    every requirement it declares that leaves out another package's lower bound is recorded."""
    checked = 0
    for entry in SUPPORT.values():
        try:
            installed = importlib.metadata.version(entry.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        declared = _declared(entry.name)
        recorded = {
            canonicalize_name(Requirement(line).name): Requirement(line).specifier
            for versions, line in entry.requires
            if version_in(installed, versions)
        }
        for name, specifier in recorded.items():
            assert declared.get(name) == specifier, (entry.name, installed, name, str(declared.get(name)))
        if entry.name != "transformers" and _release(installed) != _release(entry.lowest):
            continue
        checked += 1
        for name, specifier in declared.items():
            if not specifier.contains(support(name).lowest, prereleases=True):
                assert name in recorded, f"{entry.name} {installed} requires {name}{specifier}: record it"
    assert checked, "no package installed at its lower bound, nor transformers"


def test_doctor_and_build_pin_the_table():
    assert doctor.TESTED_VERSIONS == {
        "flash-linear-attention": SUPPORT["flash-linear-attention"].pin,
        "causal-conv1d": SUPPORT["causal-conv1d"].pin,
        "tilelang": SUPPORT["tilelang"].pin,
        "kernels": SUPPORT["kernels"].pin,
    }
    assert build.SOURCE_PACKAGES["causal-conv1d"].version == SUPPORT["causal-conv1d"].pin


def test_private_names_were_checked_on_tested_versions_in_range():
    for table in backends.tables():
        entry = support(table.distribution)
        assert set(table.checked) <= set(entry.tested), (table.distribution, table.checked, entry.tested)
        assert all(version_in(v, entry.spec) for v in table.checked)
    assert SUPPORT["flash-linear-attention"].spec in fla_backend.FIX
    assert version_in(SUPPORT["flash-linear-attention"].lowest, fla_backend.REQUIRED)
    assert SUPPORT["causal-conv1d"].spec in conv_backend.NAMES.fix
    assert kernels_hub.REQUIRED == SUPPORT["kernels"].spec


def _readme_range(spec: str) -> str:
    """How the README's support table writes a range: ``0.6.x``, ``2.11 to 2.14``, ``>= 1.16``."""
    lower = upper = None
    for s in SpecifierSet(spec):
        if s.operator == ">=":
            lower = Version(s.version)
        elif s.operator == "<":
            upper = Version(s.version)
    assert lower is not None, spec
    if upper is None:
        return f">= {lower}"
    if (upper.major, upper.minor) == (lower.major, lower.minor + 1):
        return f"{lower.major}.{lower.minor}.x"
    return f"{lower} to {upper.major}.{upper.minor - 1}"


README_ROWS = {
    "Python": ("python",),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "flash-linear-attention": ("flash-linear-attention",),
    "causal-conv1d": ("causal-conv1d",),
    "kernels (Kernel Hub)": ("kernels",),
    "TRL, PEFT": ("trl", "peft"),
}


def test_readme_support_table_is_the_table():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Support") :]
    rows = {}
    for line in section.splitlines()[2:]:
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    for label, names in README_ROWS.items():
        supported, tested = rows[label]
        for name in names:
            entry = SUPPORT[name]
            assert _readme_range(entry.spec) in supported, (label, supported, _readme_range(entry.spec))
            for version in entry.tested:
                minor = ".".join(version.split(".")[:2])
                assert minor in tested, (label, version, tested)


def test_ci_installs_only_tested_versions():
    text = (ROOT / ".ci" / "run").read_text()
    pins = re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.+]*)"', text)
    assert ("transformers", "5.17.0") in pins and ("torch", "2.14.1") in pins
    for name, version in pins:
        assert version in support(name).tested, (name, version)


def _install_script():
    """tools/install.py, the quick start's installer (a script beside the package, not in it)."""
    spec = importlib.util.spec_from_file_location("install", ROOT / "tools" / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quick_start() -> list[str]:
    """The README's quick-start commands, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    return re.findall(r"```bash\n(.+?)\n```", section[: section.index("\n## ")], re.DOTALL)


def test_quick_start_keeps_a_supported_torch_and_ci_runs_its_test_command():
    """A torch pin in the quick start would replace the user's CUDA torch (a large download, built for their
    driver) whenever theirs is another supported version; CI runs the test command as the README writes it."""
    demo, tests = _quick_start()
    for command in (demo, tests):
        assert "torch==" not in command and " python tools/install.py" in command, command
    assert demo.endswith("&& python -m fusepatch demo") and tests.endswith("&& python -m pytest")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_install_script_keeps_a_supported_torch_else_installs_cis():
    install = _install_script()
    spec = install.torch_range(PYPROJECT["project"])
    assert SpecifierSet(spec) == SpecifierSet(SUPPORT["torch"].spec)
    assert install.DEFAULT_TORCH in SUPPORT["torch"].tested and version_in(install.DEFAULT_TORCH, spec)
    for version in ("2.10.2", "2.11", "2.11.0+cu130", "2.14.0a0", "2.14.1", "2.15.0", "2.15.0.dev20261201", "3.0"):
        assert install.in_range(version, spec) == version_in(version, spec), version
    for kept in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1"):  # pip is held to it by a constraint
        assert install.pip_arguments(["test"], kept, spec)[:2] == (["-e", ".[test]"], f"torch=={kept}")
    for replaced in (None, "2.10.2", "2.15.0"):
        arguments, held, said = install.pip_arguments([], replaced, spec)
        assert arguments == ["torch==2.13.0", "-e", "."] and not held and said.endswith("installing torch==2.13.0")


# pip's index option is spelled in two pieces so that this file does not match itself
INDEX_ADDRESS = re.compile(r"https?://[a-z.]*pytorch\.org|index" r"-url|pypi\.org|download\.pytorch", re.IGNORECASE)


def test_no_package_index_address_in_the_repository():
    """The user's pip configuration says where an index is; the repository names indexes in words."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in listed.splitlines():
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if INDEX_ADDRESS.search(line)]
    assert not hits, "\n".join(hits)
