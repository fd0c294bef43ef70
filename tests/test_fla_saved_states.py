"""fla-saved-states calls fla's delta-rule pieces by keyword: the checked table must cover every call, and an fla
release that changed a piece must fail the load with the fix (the kernels themselves: tests/gpu/test_gdn_ops.py)."""

from __future__ import annotations

import ast
import inspect
import sys
import types

import pytest

from fusepatch.ops import fla_saved_states


def _fla_calls() -> dict[str, set[str]]:
    """Every ``fla.<function>(...)`` call in the module, with the keywords it passes (``**places``: the
    boundaries and the chunk table)."""
    calls: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(inspect.getsource(fla_saved_states))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "fla":
                names = {k.arg for k in node.keywords if k.arg} | (
                    {"cu_seqlens", "chunk_indices"} if any(k.arg is None for k in node.keywords) else set()
                )
                calls.setdefault(node.func.attr, set()).update(names)
    return calls


def test_every_fla_call_is_in_the_checked_table():
    calls = _fla_calls()
    assert set(calls) == set(fla_saved_states.NEEDS)
    for name, keywords in calls.items():
        assert keywords <= fla_saved_states.NEEDS[name], (name, keywords - fla_saved_states.NEEDS[name])


def test_an_fla_without_a_piece_fails_the_load_with_the_fix(monkeypatch):
    """An fla-core whose chunk module lost a function (or a parameter fusepatch passes) is refused at load, so
    the resolver moves on to fla's own function; the message names the versions that work and the skip."""
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    for name in fla_saved_states.NEEDS:
        if name != "chunk_gated_delta_rule_fwd_h":
            params = ", ".join(sorted(fla_saved_states.NEEDS[name]) + ["*args"])
            exec(f"def {name}({params}): pass", chunk.__dict__)
    modules = {
        "fla": types.ModuleType("fla"),
        "fla.ops": types.ModuleType("fla.ops"),
        "fla.ops.gated_delta_rule": types.ModuleType("fla.ops.gated_delta_rule"),
        "fla.ops.gated_delta_rule.chunk": chunk,
        "fla.ops.utils": types.ModuleType("fla.ops.utils"),
        "fla.ops.utils.constant": types.SimpleNamespace(RCP_LN2=1.4426950408889634),
        "fla.ops.utils.index": types.SimpleNamespace(prepare_chunk_indices=None),
    }
    modules["fla.ops.gated_delta_rule"].chunk = chunk
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ImportError) as caught:
        fla_saved_states.load()
    message = str(caught.value)
    assert "chunk_gated_delta_rule_fwd_h" in message and "fla-core>=0.5,<0.7" in message
    assert "FUSEPATCH_SKIP=gated_delta_rule/fla-saved-states" in message
