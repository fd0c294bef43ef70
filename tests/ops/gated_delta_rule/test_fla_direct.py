"""fla's functions past its backend dispatch only where no other backend could take the call: the wrappers peeled
are fla's dispatch and guard and torch's compiler-disable frame, read from stand-ins laid out as fla-core 0.6
lays them out (``fla/backends.py``, ``fla/utils/decorators.py``); anything else, a live backend or a registry
that cannot be read keeps the function as fla exports it."""

from __future__ import annotations

import functools
import importlib.util
import sys
import textwrap

import pytest

from fusepatch.ops.gated_delta_rule import fla_direct

BACKENDS = """
import functools
import torch


class Backend:
    def __init__(self, name, available=True, enabled=True, implements=("f",)):
        self.backend_type, self.available, self.enabled, self.implements = name, available, enabled, implements

    def is_available(self):
        return self.available

    def is_enabled(self):
        return self.enabled

    def get_implementation(self, name):
        return (lambda *a, **k: ("backend", self.backend_type)) if name in self.implements else None


class Registry:
    def __init__(self, backends):
        self.backends = backends

    def _get_sorted_backends(self):
        return list(self.backends)

    def dispatch(self, default_function):
        @functools.wraps(default_function)
        def wrapper(*args, **kwargs):
            for backend in self._get_sorted_backends():
                if backend.is_available() and backend.is_enabled():
                    found = backend.get_implementation(default_function.__name__)
                    if found is not None:
                        return found(*args, **kwargs)
            return default_function(*args, **kwargs)

        return torch.compiler.disable(wrapper)


def without_registry(default_function):
    @functools.wraps(default_function)
    def wrapper(*args, **kwargs):
        return default_function(*args, **kwargs)

    return wrapper
"""

DECORATORS = """
import functools


def input_guard(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*(a.contiguous() if hasattr(a, "contiguous") else a for a in args), **kwargs)

    return wrapper
"""


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """The two fla files whose wrappers are peeled, under a directory named ``fla``, imported by path."""
    (tmp_path / "fla" / "utils").mkdir(parents=True)
    (tmp_path / "fla" / "backends.py").write_text(textwrap.dedent(BACKENDS))
    (tmp_path / "fla" / "utils" / "decorators.py").write_text(textwrap.dedent(DECORATORS))
    backends = _load(tmp_path / "fla" / "backends.py", "_fake_fla_backends")
    decorators = _load(tmp_path / "fla" / "utils" / "decorators.py", "_fake_fla_decorators")
    yield backends, decorators
    for name in ("_fake_fla_backends", "_fake_fla_decorators"):
        sys.modules.pop(name, None)


def f(x):
    return ("own", x)


def test_no_live_backend_calls_the_function_itself(fake_fla):
    backends, decorators = fake_fla
    idle = [backends.Backend("off", enabled=False), backends.Backend("absent", available=False)]
    idle.append(backends.Backend("other", implements=("g",)))  # live, but not for this function
    exported = decorators.input_guard(backends.Registry(idle).dispatch(f))
    found, why = fla_direct.unwrap(exported, "f")
    assert (found, why) == (f, "direct")
    assert exported(1) == found(1) == ("own", 1)


def test_a_live_backend_keeps_fla_dispatch(fake_fla):
    backends, _ = fake_fla
    exported = backends.Registry([backends.Backend("off", enabled=False), backends.Backend("tilelang")]).dispatch(f)
    found, why = fla_direct.unwrap(exported, "f")
    assert found is exported and why == "backend tilelang could take it"
    assert found(1) == ("backend", "tilelang")


def test_unknown_wrappers_and_registries_are_kept(fake_fla):
    backends, _ = fake_fla
    cached = functools.lru_cache(backends.Registry([]).dispatch(f))  # a wrapper fusepatch does not know, outside
    assert fla_direct.unwrap(cached, "f") == (cached, "no backend dispatch")
    unreadable = backends.without_registry(f)  # fla's dispatch file, no registry in the closure
    assert fla_direct.unwrap(unreadable, "f") == (unreadable, "fla's backend registry unreadable")
    assert fla_direct.unwrap(f, "f") == (f, "no backend dispatch")


def test_direct_builds_the_namespace(fake_fla):
    backends, _ = fake_fla
    module = type(sys)("chunk")
    module.f = backends.Registry([]).dispatch(f)
    module.h = backends.Registry([backends.Backend("live", implements=("h",))]).dispatch(f)
    calls = fla_direct.direct(module, ["f", "h"])
    assert calls.f is f and calls.h is module.h
