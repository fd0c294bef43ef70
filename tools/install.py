"""Install fusepatch from this clone (``pip install -e .[EXTRAS]``) without replacing a torch it supports.

A CUDA torch took a large download and matches its machine's driver: one in pyproject.toml's range is kept as it
is (pip is held to it). With no torch, or one outside the range, torch 2.13.0 is installed with fusepatch: the
version CI runs every test on, in the build the package index serves. Standard library only: it runs before
anything else is installed.

    python tools/install.py         # fusepatch
    python tools/install.py test    # fusepatch[test]; several extras: python tools/install.py test hub
"""

from __future__ import annotations

import importlib.metadata
import operator
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TORCH = "2.13.0"  # CI's torch, every test (fusepatch/base/versions.py)
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def torch_range(table: dict) -> str:
    """pyproject's torch range (``>=2.11,<2.15``)."""
    for line in table["dependencies"]:
        match = re.fullmatch(r"torch\s*([<>=].*)", line.strip())
        if match:
            return match.group(1).replace(" ", "")
    raise SystemExit("pyproject.toml names no torch requirement")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers: ``2.11.0+cu130`` and ``2.11`` alike give (2, 11)."""
    numbers = [int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group().split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (``>=``, ``>``, ``<=``, ``<``, ``==`` on releases)."""
    for clause in spec.split(","):
        op, bound = re.fullmatch(r"(>=|<=|==|>|<)\s*(\S+)", clause.strip()).groups()
        if not COMPARE[op](_release(version), _release(bound)):
            return False
    return True


def pip_arguments(extras: list[str], installed: str | None, spec: str) -> tuple[list[str], str, str]:
    """What to pass to ``pip install``, the constraint that holds torch (or ""), and what to say about torch."""
    target = f".[{','.join(extras)}]" if extras else "."
    if installed is not None and in_range(installed, spec):
        return ["-e", target], f"torch=={installed}", f"keeping torch {installed} (fusepatch supports torch{spec})"
    why = f"torch {installed} is outside torch{spec}" if installed else "no torch is installed"
    return [f"torch=={DEFAULT_TORCH}", "-e", target], "", f"{why}: installing torch=={DEFAULT_TORCH}"


def installed_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    table = project()
    unknown = sorted(set(argv) - set(table.get("optional-dependencies", {})))
    if unknown:
        choices = ", ".join(table.get("optional-dependencies", {}))
        raise SystemExit(f"unknown extra {', '.join(unknown)}: pass none, or some of {choices}")
    arguments, held, said = pip_arguments(argv, installed_torch(), torch_range(table))
    print(f"fusepatch install: {said}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        if held:
            constraint = pathlib.Path(folder) / "torch.txt"
            constraint.write_text(held + "\n")
            arguments = ["-c", str(constraint), *arguments]
        command = [sys.executable, "-m", "pip", "install", *arguments]
        print("fusepatch install:", " ".join(command), flush=True)
        return subprocess.call(command, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
