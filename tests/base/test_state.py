"""The process's state in one object (``fusepatch/base/state.py``): what one model's apply leaves for the next
(self-test verdicts, reasons said, drift, rows and candidates users added) lives there and nowhere else, and a test
or an application can run with a state of its own."""

from __future__ import annotations

import ast
import pathlib

import fusepatch
from fusepatch.backends import kernels_hub
from fusepatch.base.state import ProcessState, current, fresh
from fusepatch.ops import OPS

ROOT = pathlib.Path(fusepatch.__file__).parent


def test_added_candidates_and_rows_live_in_the_state_not_in_the_op_table():
    """``add_candidate`` rewrote the shared ``OPS`` table, behind every later model's back; now it is the state's."""
    before = OPS["swiglu"]
    candidate = kernels_hub.hub_candidate(kernels_hub.HubKernel("acme/swiglu", "swiglu"))
    with fresh() as state:
        fusepatch.add_candidate("swiglu", candidate)
        assert OPS["swiglu"] is before
        assert state.user_candidates["swiglu"][0] == (candidate,)
        from fusepatch.engine.registry import op_with_user_candidates

        assert op_with_user_candidates("swiglu").candidates[0] is candidate
    from fusepatch.engine.registry import op_with_user_candidates

    assert op_with_user_candidates("swiglu") is before  # the state it was added to is gone


def test_what_apply_remembers_goes_to_the_current_state(caplog):
    from fusepatch.tools.tiny import tiny_model

    outer = current()
    with fresh(ProcessState()) as state:
        fusepatch.apply(tiny_model("qwen3"))
        assert state.environment is not None and state.said._said  # the environment, the reasons said
        assert current() is state
    assert current() is outer


STATE_HOLDERS = {"fusepatch/base/state.py"}
# Module-level objects that are caches of pure functions, locks, thread-local routing of the current call or
# constants in a mutable type: state of a call or of the machine, not of what the process has decided.
ALLOWED = {
    "fusepatch/layers/support/bindings.py": {"_lock", "_local"},  # _local: the calling thread's patched layer
    "fusepatch/layers/support/packing.py": {"_memo", "_memo_lock", "_traced_plain"},  # _traced_plain: the traced call
    "fusepatch/layers/support/positions.py": {"_aranges"},
    "fusepatch/layers/support/labelled_rows.py": {"_pinned"},
    "fusepatch/layers/support/signature.py": {"_PARAMETERS"},
    "fusepatch/layers/decoder.py": {"_CHECKPOINTS_IN_FORWARD"},
    "fusepatch/kernels/scale.py": {"_SMS"},
    # FP8 rows of the tensors in flight (a frame's, a gradient's), gone with their call or their tensor
    "fusepatch/kernels/fp8_rows.py": {"_LOCAL", "_GRADIENTS", "_GRADIENTS_LOCK"},
    "fusepatch/ops/gated_delta_rule/reference.py": {"_first_solve", "_solved_once"},
    "fusepatch/backends/fsdp2.py": {"_index"},  # FSDP2's parameters by module: a cache of torch's state
}


def _mutable_globals(path: pathlib.Path) -> set[str]:
    """Module-level names bound to an empty container, a lock, a thread-local, or rebound with ``global``."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(
            value, "elts", getattr(value, "keys", None)
        )
        called = isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) in {
            "set",
            "dict",
            "list",
            "defaultdict",
            "Lock",
            "RLock",
            "local",
            "WeakSet",
            "WeakKeyDictionary",
        }
        if called and (value.args or value.keywords):  # a constant table built with dict(...)
            called = False
        if empty or called:
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    found.update(name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names)
    return found


def test_no_decision_state_outside_the_state_object():
    """The reasons said, self-test verdicts, drift, user rows and the environment were module globals in six
    modules; a new one must go to ``ProcessState`` (or, if it is a cache or a lock, to ALLOWED with why)."""
    wrong = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).as_posix()
        if relative in STATE_HOLDERS:
            continue
        extra = _mutable_globals(path) - ALLOWED.get(relative, set())
        if extra:
            wrong[relative] = sorted(extra)
    assert not wrong, wrong
