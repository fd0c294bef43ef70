"""The package's shape: no import cycles among module-level imports, kernels that import only each other, a light
``import fusepatch``, and public names that resolve to what they document."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import fusepatch

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fusepatch"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The fusepatch modules ``path`` imports when it is imported (module level; TYPE_CHECKING blocks left out)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fusepatch":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "fusepatch")
    return {m for m in out if m in modules}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_module_imports_alone():
    """Each module imported first, into an interpreter that holds no fusepatch module yet (torch and transformers
    stay loaded between modules: they are not what an import order could break)."""
    names = sorted(name for name in _modules() if not name.endswith("__main__"))  # __main__ runs the CLI
    code = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'fusepatch' or m.startswith('fusepatch.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed) or 'ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stdout + result.stderr[-2000:]


def test_ops_and_backends_import_nothing_above_them():
    """The ops and the foreign-package backends sit below the forwards, the patching and the tools
    (docs/design.md): nothing they import at module level comes from there."""
    above = (
        "fusepatch.layers",
        "fusepatch.models",
        "fusepatch.tools",
        "fusepatch.integrations",
        "fusepatch.engine.patch",
    )
    modules = _modules()
    for name, path in modules.items():
        if name.startswith(("fusepatch.ops", "fusepatch.backends")):
            wrong = {m for m in _imports(path, modules) if m.startswith(above)}
            assert not wrong, f"{name} imports {wrong}"


def test_kernels_import_only_kernels():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("fusepatch.kernels."):
            outside = {m for m in _imports(path, modules) if not m.startswith("fusepatch.kernels")}
            assert not outside, f"{name} imports {outside}"


def test_import_is_light_and_public_names_resolve():
    code = "import sys, fusepatch; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr[-2000:]
    for name in fusepatch.__all__:
        assert getattr(fusepatch, name) is not None
    __import__("fusepatch.engine.reporting")  # a submodule import must not shadow a public function
    assert callable(fusepatch.report) and fusepatch.report.__module__ == "fusepatch.engine.patch"
