"""The package's shape: layers that import only downwards and no import cycle at any import level, kernels that
import only each other, a light ``import fusepatch``, and public names that resolve to what they document."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
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


# The layers, lowest first (docs/design.md): a module imports only from its own layer or the ones below, at any
# import level (module, function or class body, type-checking blocks too).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fusepatch.base",),
    ("fusepatch.kernels", "fusepatch.backends"),
    ("fusepatch.ops",),
    ("fusepatch.layers",),
    ("fusepatch.models",),
    ("fusepatch.engine",),
    ("fusepatch.diagnostics",),
    ("fusepatch.integrations", "fusepatch.tools"),
    ("fusepatch", "fusepatch.__main__"),
)


def _layer(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if name in prefixes or any(name.startswith(f"{p}.") for p in prefixes if p != "fusepatch"):
            return index
    raise AssertionError(f"{name} is in no layer of LAYERS")


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The fusepatch modules ``path`` imports, at any level (module, function or class body)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fusepatch":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "fusepatch")
    return {m for m in out if m in modules}


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def test_no_import_cycles_at_any_level():
    """Function-level imports included: none of them hides a cycle."""
    graph = _graph()
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


def test_layers_import_only_downwards():
    wrong = [
        f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
        for name, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_base_imports_nothing_of_fusepatch_above_it():
    graph = _graph()
    outside = {n: d for n, d in graph.items() if n.startswith("fusepatch.base") and any(_layer(x) for x in d)}
    assert not outside, outside


def test_the_release_version_is_pyprojects():
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert project.get("version", fusepatch.__version__) == fusepatch.__version__


def test_the_license_file_is_pyprojects():
    """pyproject's SPDX license is the text the wheel ships (``license-files``): Apache 2.0 in full, with its
    copyright line filled in."""
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT.parent / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and text.count("\n") == 202
    assert "Copyright 2026 the fusepatch authors" in text and "[yyyy]" not in text


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


def test_readme_states_applys_whole_signature():
    """The README's ``apply(model, ...)`` is the real signature, every keyword explained in the list after it."""
    import inspect

    text = (ROOT.parent / "README.md").read_text()
    match = re.search(r"`(apply\(model[^`]*\))`", text)
    parts = []
    for p in inspect.signature(fusepatch.apply).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    assert " ".join(match.group(1).split()) == f"apply({', '.join(parts)})"
    explained = text[match.end() :].split("\n\n")[1]  # the list after it
    for name in inspect.signature(fusepatch.apply).parameters:
        assert name == "model" or f"`{name}" in explained, name


def test_readme_fits_its_budget():
    """The README is the first hour's read: under 15,000 characters; the detail lives in docs/."""
    assert len((ROOT.parent / "README.md").read_text()) < 15_000


def test_apply_is_a_short_pipeline():
    """``apply`` reads as its steps (check, plan, resolve and self-test, bind, report, finish): its body, the
    docstring left out, within 40 lines."""
    import ast

    tree = ast.parse((ROOT / "engine" / "patch.py").read_text())
    apply = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply")
    body = apply.body[1:] if isinstance(apply.body[0], ast.Expr) else apply.body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 40


def test_tests_mirror_the_package():
    """Each folder of tests/ is a package of fusepatch (ops/<op>: one of its ops), or the GPU tier (gpu) or the
    benchmark harness's (benchmarks); only this file, about the whole package, sits at the top."""
    tests = pathlib.Path(__file__).resolve().parent
    at_top = sorted(p.name for p in tests.glob("test_*.py"))
    assert at_top == ["test_layout.py"], at_top
    for path in tests.rglob("test_*.py"):
        folder = path.parent.relative_to(tests)
        if folder.parts and folder.parts[0] in ("gpu", "benchmarks"):
            continue
        if folder.parts:
            assert (ROOT / folder).is_dir(), f"{path.relative_to(tests)}: fusepatch/{folder} does not exist"


# Records say when, the code says why: a dated run (YYYY-MM-DD) belongs in benchmarks/records/ and the docs that
# cite them, not in the package.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_no_dated_runs_in_the_package():
    found = []
    for path in sorted(ROOT.rglob("*")):
        if not path.is_file() or path.suffix == ".pyc":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DATE.search(line):
                found.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
    assert not found, "dated runs in package files (cite benchmarks/records/ from the docs instead):\n" + "\n".join(
        found
    )


# The calls whose strings reach the user: logging, warnings, fusepatch's drift notes, known issues.
_MESSAGE_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "drift", "KnownIssue"}


def _message_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` that a log call, a warning, a drift note, a known issue or a raised
    exception carries, with the module-level string constants such a message names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = [node.value]

    def strings(root: ast.AST, seen: set[str]) -> list[tuple[int, str]]:
        out = []
        for node in ast.walk(root):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append((node.lineno, node.value))
            elif isinstance(node, ast.Name) and node.id in constants and node.id not in seen:
                seen.add(node.id)
                for value in constants[node.id]:
                    out += strings(value, seen)
        return out

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            found += strings(node.exc, set())
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _MESSAGE_CALLS:
                found += strings(node, set())
    return found


REPOSITORY_PATH = re.compile(r"(?<![\w./])(benchmarks|docs)/")  # not a URL's /docs/


def test_messages_name_no_repository_paths():
    """A pip install has no benchmarks/ or docs/ folder: a message names the fix, not the repository's scripts,
    records or doc files."""
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {text[:100]!r}"
        for path in sorted(ROOT.rglob("*.py"))
        for line, text in _message_strings(path)
        if REPOSITORY_PATH.search(text)
    ]
    assert not found, "messages naming repository paths:\n" + "\n".join(found)


def test_no_test_module_imports_another():
    """Shared test code lives in helpers.py (on the path from conftest.py): a test module importing another one
    works in the whole run and fails when its folder runs alone (CI runs single files)."""
    tests = pathlib.Path(__file__).resolve().parent
    wrong = []
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(tests)}: {n}" for n in names if n.startswith("test_")]
    assert not wrong, wrong


def test_family_lists_come_from_the_one_table():
    """A test lists families through helpers.py (FAMILIES, HYBRID, MOE, ONE_OF_EACH: fusepatch/tools/tiny.py's
    table), so adding a family touches its row file, its tiny config and no test; a literal list of three or more
    family names is refused (a pair picked for its cost may stay)."""
    from fusepatch.tools.tiny import FAMILIES

    tests = pathlib.Path(__file__).resolve().parent
    wrong = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in FAMILIES]
                if len(named) >= 3:
                    wrong.append(f"{path.relative_to(tests)}:{node.lineno}: {named}")
    assert not wrong, wrong


BENCHMARKS = ROOT.parent / "benchmarks"


def test_benchmarks_top_level_is_the_harness_and_docs_name_every_study():
    """benchmarks/ holds at most 12 scripts, the harness users and CI run (docs/benchmarks.md lists them); one-off
    studies go to benchmarks/studies/, and docs/benchmarks.md names each one by its path, so none sits unexplained."""
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= 12, f"{len(scripts)} scripts at the top of benchmarks/ (move studies): {scripts}"
    docs = (ROOT.parent / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    studies = sorted(p.name for p in (BENCHMARKS / "studies").glob("*.py"))
    assert studies, "benchmarks/studies/ holds no study"
    unnamed = [name for name in studies if f"benchmarks/studies/{name}" not in docs]
    assert not unnamed, f"studies docs/benchmarks.md does not name (as benchmarks/studies/NAME.py): {unnamed}"


def test_bindings_are_installed_by_apply_not_held_from_forwards():
    """Foreign names are declared by rows and installed by ``apply`` (``layers/support/bindings.py``): no layer
    calls a ``hold(``, and nothing keeps them with finalizers or the garbage collector (``weakref.finalize``, ``gc``).
    Only ``diagnostics/collector.py`` imports ``gc``: it times the collector's pauses and freezes long-lived objects
    for the Trainer callback, and keeps nothing of its own with it."""
    wrong = []
    for path in ROOT.rglob("*.py"):
        where = path.relative_to(ROOT.parent)
        if path == ROOT / "diagnostics" / "collector.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wrong += [f"{where}: import {a.name}" for a in node.names if a.name == "gc"]
            elif isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                if node.module == "gc" or (node.module == "weakref" and "finalize" in names):
                    wrong.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "finalize"
                and getattr(node.value, "id", "") == "weakref"
            ):
                wrong.append(f"{where}:{node.lineno}: weakref.finalize")
            elif isinstance(node, ast.Call) and path.is_relative_to(ROOT / "layers"):
                called = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if called == "hold":
                    wrong.append(f"{where}:{node.lineno}: hold(...) from a layer")
    assert not wrong, wrong


def _functions() -> tuple[dict[str, dict[str, ast.FunctionDef]], dict[str, dict[str, str]], dict[str, list]]:
    """Per module: its functions (methods as ``Class.name``) and what its imported names stand for; and every
    function of the package by its bare name (for calls on an object: ``feature.bind(...)``)."""
    functions: dict[str, dict[str, ast.FunctionDef]] = {}
    imported: dict[str, dict[str, str]] = {}
    by_name: dict[str, list] = {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        functions[module], imported[module] = {}, {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fusepatch"):
                for alias in node.names:
                    imported[module][alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in tree.body:
            members = [(node.name, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            if isinstance(node, ast.ClassDef):
                members = [(f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, ast.FunctionDef)]
            for qualname, function in members:
                functions[module][qualname] = function
                by_name.setdefault(function.name, []).append((module, qualname))
    return functions, imported, by_name


def _model_reach() -> set[str]:
    """The functions of fusepatch/ that ``apply``'s ``model`` reaches (see the test below)."""
    functions, imported, by_name = _functions()

    def callees(module: str, call: ast.Call) -> list[tuple[str, str, int]]:
        """The package's functions a call may run, each with how many of its parameters the call fills before its
        first argument (1 for a method called on an object: its ``self``)."""
        func = call.func
        if isinstance(func, ast.Name):
            target = imported[module].get(func.id, f"{module}.{func.id}")
            owner, _, name = target.rpartition(".")
            return [(owner, name, 0)] if name in functions.get(owner, {}) else []
        if isinstance(func, ast.Attribute):
            held = imported[module].get(func.value.id, "") if isinstance(func.value, ast.Name) else ""
            if held in functions:  # a module's function: ``layer_graphs.drop(model)``
                return [(held, func.attr, 0)] if func.attr in functions[held] else []
            return [(m, q, 1) for m, q in by_name.get(func.attr, []) if "." in q]  # a method, by its name
        return []

    reached: set[str] = set()
    pending = [("fusepatch.engine.patch", "apply", "model")]
    while pending:
        module, qualname, parameter = pending.pop()
        key = f"{module}:{qualname}"
        if key in reached:
            continue
        reached.add(key)
        for call in (n for n in ast.walk(functions[module][qualname]) if isinstance(n, ast.Call)):
            given = [(i, a) for i, a in enumerate(call.args)] + [(k.arg, k.value) for k in call.keywords]
            for where, value in given:
                if not (isinstance(value, ast.Name) and value.id == parameter) and not (
                    isinstance(value, ast.Attribute) and value.attr == "model"
                ):
                    continue
                for owner, name, skipped in callees(module, call):
                    callee = functions[owner][name]
                    names = [a.arg for a in (*callee.args.posonlyargs, *callee.args.args, *callee.args.kwonlyargs)]
                    if isinstance(where, int):
                        index = where + skipped
                        if index < len(callee.args.posonlyargs) + len(callee.args.args):
                            pending.append((owner, name, names[index]))
                    elif where in names:
                        pending.append((owner, name, where))
    return reached


def test_applys_model_reaches_few_functions():
    """Where ``apply``'s ``model`` goes is where a change to what fusepatch patches must look: at most 14 places.

    The measure: from ``apply`` (engine/patch.py), each call whose argument is the model (the parameter that holds
    it, or a ``.model`` attribute: ``Plan.model``) is followed into the package's function it names (a module's
    function by its import; a method called on an object to every method of that name), whose parameter then
    holds it; the functions so reached, ``apply`` included, are counted. A value built from the model (its
    modules, a plan) is not followed."""
    reached = _model_reach()
    assert len(reached) <= 14, f"{len(reached)} functions receive apply's model:\n" + "\n".join(sorted(reached))


def test_the_engine_holds_the_pipeline_and_features_hold_the_rest():
    """engine/patch.py is the pipeline (apply, revert, report and their steps, PatchState): within 350 lines, and
    it imports no ``fusepatch.layers`` module; what a layer is reaches it through ``Row.role`` and the features
    (``engine/features/``), which name layers."""
    patch = ROOT / "engine" / "patch.py"
    assert len(patch.read_text().splitlines()) <= 350
    layers = sorted(m for m in _graph()["fusepatch.engine.patch"] if m.startswith("fusepatch.layers"))
    assert not layers, f"engine/patch.py imports {layers}"


# FP8's own places: its op folders (the projections', the LM head's), its kernels (kernels/: its quantization, and the producers that write their
# output's FP8 rows in the same pass), its layer and its feature module
FP8_HOMES = ("ops/fp8_linear/", "ops/fp8_linear_cross_entropy/", "kernels/", "layers/fp8.py", "engine/features/fp8.py")
# the others that may name it: the option's values, the feature and op tables, the rows, apply's docstring, the
# demo's switch, and the decoder and shared projections that hand producers' FP8 rows on; a ninth is a sign FP8
# leaks past its op again
FP8_NAMED_AT_MOST = 8


def test_fp8_stays_behind_its_op():
    """Outside its op folder, kernels, layer and feature module, at most ``FP8_NAMED_AT_MOST`` modules name FP8 (in
    code, strings or comments): a second precision or a second FP8 kernel is added there, not across the engine."""
    named = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if not str(path.relative_to(ROOT)).startswith(FP8_HOMES) and "fp8" in path.read_text().lower()
    )
    assert len(named) <= FP8_NAMED_AT_MOST, f"{len(named)} modules name FP8: {named}"


def test_the_engine_tells_layers_apart_by_role_not_by_forward():
    """No engine module compares a row's forward with a layer's function (``row.forward in HEAD_FORWARDS``,
    ``state.row.forward is swiglu_mlp_forward``): a row says its part as ``Row.role``, which a user's row with a
    forward of its own can say too."""
    wrong = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = (node.left, *node.comparators)
            forwards = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "forward"]
            others = [s for s in sides if s not in forwards]
            if forwards and not all(isinstance(s, ast.Constant) and s.value is None for s in others):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")  # ``row.forward is None`` is fine
    assert not wrong, "compares a forward: " + ", ".join(wrong)


DESIGN = ROOT.parent / "docs" / "design.md"


def test_design_names_every_feature_module():
    """docs/design.md names each module of engine/features/ as ``NAME.py``: a feature added is a feature explained."""
    text = DESIGN.read_text(encoding="utf-8")
    modules = sorted(p.name for p in (ROOT / "engine" / "features").glob("*.py") if p.name != "__init__.py")
    unnamed = [name for name in modules if name not in text]
    assert modules and not unnamed, f"feature modules docs/design.md does not name: {unnamed}"


def test_design_names_every_op_folder_and_op():
    """docs/design.md lists each folder of ops/ (as ``NAME/``) and each op of ``OPS`` by its whole name."""
    from fusepatch.ops import OPS

    text = DESIGN.read_text(encoding="utf-8")
    folders = sorted(p.parent.name for p in (ROOT / "ops").glob("*/__init__.py"))
    missing = [name for name in folders if f"`{name}/`" not in text]
    assert len(folders) > 1 and not missing, f"op folders docs/design.md does not list (as `NAME/`): {missing}"
    unnamed = [op for op in OPS if not re.search(rf"(?<!\w){re.escape(op)}(?!\w)", text)]
    assert not unnamed, f"ops docs/design.md does not name: {unnamed}"
