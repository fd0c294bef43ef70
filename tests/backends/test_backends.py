"""The foreign packages' private names: one table each, and a name that moved is a WARNING with the fallback."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
import tomllib
import types

import pytest
from helpers import REPO

from fusepatch import backends
from fusepatch.backends import PrivateNames, kernels_hub
from fusepatch.backends import causal_conv1d as conv_backend
from fusepatch.backends import fla as fla_backend
from fusepatch.base.env import TRANSFORMERS_REQUIREMENT

ROOT = REPO


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "fusepatch"]


def test_drift_is_one_warning_with_the_fallback_and_the_fix(caplog):
    table = PrivateNames("fusepatch-test-package", ("1.0.0",), {"json": ("dumps", "no_such_name")}, "pip install x")
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        table.drift("json.no_such_name is missing", "the slow path runs")
        table.drift("json.no_such_name is missing", "the slow path runs")
        assert table.missing() == ["json.no_such_name"]  # the probe's own report of it is the same line, said once
    lines = _warnings(caplog)
    assert len(lines) == 1
    assert "fusepatch-test-package ?: json.no_such_name is missing (checked on 1.0.0); the slow path runs" in lines[0]
    assert lines[0].endswith("fix: pip install x")
    assert any("json.no_such_name" in line for line in backends.drifted())


class _Anything(types.ModuleType):
    """A module that has every attribute: the installed package as the table expects it."""

    def __getattr__(self, name: str) -> object:
        return object()


def _probe_imports(monkeypatch, raising: dict[str, Exception]) -> None:
    """``importlib.import_module`` as the probe sees it: ``raising`` modules raise, every other one has it all."""

    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        if name in raising:
            raise raising[name]
        return _Anything(name)

    monkeypatch.setattr(importlib, "import_module", import_module)


def test_a_probe_whose_import_raises_anything_is_a_warning_not_a_crash(monkeypatch, caplog):
    """fla-core 0.5.2 under Triton 3.9 raises ValueError at import: doctor reports it instead of crashing."""
    _probe_imports(monkeypatch, {"fakefla.ops": ValueError("Triton 3.9 is not supported\nmore")})
    table = PrivateNames(
        "fusepatch-probe-a", ("1.0.0",), {"fakefla.ops": ("chunk",), "fakefla": ("x",)}, "pip install y"
    )
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert table.missing() == ["fakefla.ops"]
    (line,) = _warnings(caplog)
    assert "fakefla.ops cannot be imported (ValueError: Triton 3.9 is not supported)" in line
    assert "falls back" in line and line.endswith("fix: pip install y")


def test_names_of_an_optional_backend_are_probed_only_where_it_is_installed(monkeypatch, caplog):
    tilelang_module = "fla.ops.common.backends.tilelang.chunk_bwd"
    assert fla_backend.NAMES.optional == {tilelang_module: "tilelang"}
    _probe_imports(monkeypatch, {tilelang_module: ModuleNotFoundError("No module named 'tilelang'", name="tilelang")})
    version = importlib.metadata.version

    def without_tilelang(name: str) -> str:
        if name == "tilelang":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_tilelang)
    assert fla_backend.NAMES.missing() == []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.15" if name == "tilelang" else version(name))
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert fla_backend.NAMES.missing() == [tilelang_module]  # installed, and fla's module will not import


def test_doctor_probes_where_importing_is_harmless_and_says_why_not_elsewhere(monkeypatch):
    from fusepatch.tools.doctor import render

    _probe_imports(monkeypatch, {})
    harmless = PrivateNames("packaging", ("1",), {"json": ("dumps",)}, "pip install packaging")
    needs_gpu = PrivateNames("packaging", ("1",), {"json": ("dumps",)}, "x", import_needs_gpu="it loads CUDA")
    assert harmless.to_dict(probe=True, gpu=False)["missing"] == []  # probed on a CPU machine too
    assert needs_gpu.to_dict(probe=True, gpu=True)["missing"] == []
    cpu = needs_gpu.to_dict(probe=True, gpu=False)
    assert "missing" not in cpu and cpu["not_probed"] == "no GPU here, and it loads CUDA"
    assert harmless.to_dict(probe=False)["not_probed"] == "--static imports nothing"
    assert {t.distribution: bool(t.import_needs_gpu) for t in backends.tables()} == {
        "fla-core": True,
        "causal-conv1d": True,
        "kernels": False,
        "accelerate": False,
    }
    report = {
        "environment": {"gpus": [], "python": "3", "torch": "2", "torch_cuda": None, "triton": None},
        "fusepatch": "x",
        "target": {"device": "cpu", "dtype": "float32"},
        "known_issues": [],
        "private_names": [cpu, harmless.to_dict(probe=True, gpu=False)],
        "ops": {},
        "families": {},
        "recommended": [],
    }
    report["environment"].update(transformers=None, distributions={})
    text = render(report)
    assert "1 names: not probed (no GPU here, and it loads CUDA)" in text and "1 names: all present" in text


def test_the_tables_cover_the_names_the_ops_call():
    chunk = set(fla_backend.NAMES.names[fla_backend.CHUNK])
    assert set(fla_backend.DELTA_RULE_STAGES) <= chunk
    assert fla_backend.DQKWG_BUILDER in fla_backend.NAMES.names["fla.ops.common.backends.tilelang.chunk_bwd"]
    assert set(conv_backend.ARITIES) == set(conv_backend.NAMES.names[conv_backend.EXTENSION])
    names = {t.distribution for t in backends.tables()}
    assert names == {"fla-core", "causal-conv1d", "kernels", "accelerate"}
    # every module fusepatch imports from fla is in the table
    imported = set()
    for path in (ROOT / "fusepatch").rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] == ["from"] and words[1].startswith("fla.") and "import" in words:
                imported.add(words[1])
                imported.update(f"{words[1]}.{w.strip(',()')}" for w in words[words.index("import") + 1 :])
    listed = set(fla_backend.NAMES.names) | {f"{m}.{a}" for m, attrs in fla_backend.NAMES.names.items() for a in attrs}
    public = {"fla.ops.gated_delta_rule", "fla.modules.activations", "fla.modules.norm.layernorm"}
    public |= {"fla.modules.norm.fused_norm_gate", "fla.modules.causal_conv1d.ops", "fla.modules.fused_cross_entropy"}
    unlisted = {
        name
        for name in imported
        if name not in listed
        and not any(entry.startswith(name + ".") for entry in listed)
        and name.rsplit(".", 1)[0] not in public
    }
    unlisted -= public
    assert not unlisted, f"fla names used but not in backends/fla.py: {sorted(unlisted)}"


def test_pins_equal_what_the_code_requires():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert TRANSFORMERS_REQUIREMENT in project["dependencies"]
    extras = project["optional-dependencies"]
    assert f"kernels{kernels_hub.REQUIRED}" in extras["hub"]
    fla_pin = next(p for p in extras["cuda"] if p.startswith("flash-linear-attention"))
    assert fla_pin == "flash-linear-attention[cuda]>=0.6,<0.7", fla_pin
    assert fla_backend.REQUIRED == ">=0.6"
    for table in backends.tables():  # each checked version satisfies the extra's bound
        assert table.checked


def test_causal_conv1d_extension_with_other_arities_warns_and_uses_the_package(monkeypatch, caplog):
    from fusepatch.ops import causal_conv1d

    ext = types.ModuleType(conv_backend.EXTENSION)
    ext.causal_conv1d_fwd = types.SimpleNamespace(__doc__="causal_conv1d_fwd(arg0: Tensor, arg1: Tensor) -> None")
    ext.causal_conv1d_bwd = types.SimpleNamespace(__doc__="causal_conv1d_bwd(arg0: Tensor) -> None")
    monkeypatch.setitem(sys.modules, conv_backend.EXTENSION, ext)
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert causal_conv1d._direct_conv() is None
    (line,) = _warnings(caplog)
    assert "causal_conv1d_cuda's functions take 2/1 arguments (1.7's: 8/12)" in line
    assert "causal_conv1d_fn is called" in line and "fix: python -m fusepatch build causal-conv1d" in line


def _fake_fla(monkeypatch, modules: dict[str, dict]) -> None:
    for name in ("fla", "fla.ops", "fla.ops.common", *modules):
        module = types.ModuleType(name)
        module.__path__ = []
        for attr, value in modules.get(name, {}).items():
            setattr(module, attr, value)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            monkeypatch.setattr(sys.modules[parent], child, module, raising=False)


def test_fla_without_the_beta_sigmoid_launcher_warns(monkeypatch, caplog):
    from fusepatch.ops.gated_delta_rule import fla_direct

    _fake_fla(monkeypatch, {"fla.ops.common.gate": {}})
    exported = object()
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert fla_direct.beta_sigmoid(exported) is exported
    (line,) = _warnings(caplog)
    assert "fla.ops.common.gate.fused_beta_sigmoid_fwd is missing" in line and "fla's autograd function" in line


@pytest.mark.parametrize("builder", ["missing", "other keywords"])
def test_fla_dqkwg_builder_that_moved_warns(monkeypatch, caplog, builder):
    from fusepatch.ops.gated_delta_rule import dqkwg

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "tilelang" else found(n, *a))
    tilelang = {} if builder == "missing" else {fla_backend.DQKWG_BUILDER: lambda B, H, K: None}
    _fake_fla(
        monkeypatch,
        {
            "fla.ops.common.backends": {"CommonTileLangBackend": object},
            "fla.ops.common.backends.tilelang": {},
            "fla.ops.common.backends.tilelang.chunk_bwd": tilelang,
        },
    )
    fla_own = object()
    with caplog.at_level(logging.WARNING, logger="fusepatch"):
        assert dqkwg.load(fla_own) is fla_own
    (line,) = _warnings(caplog)
    assert "fla's own tiling" in line and fla_backend.FIX in line
    assert ("cannot be loaded" if builder == "missing" else "lacks the keywords") in line
