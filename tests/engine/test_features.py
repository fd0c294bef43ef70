"""The features of ``apply`` (engine/features/): the pipeline asks each of them at every step, each keeps its
data in its own slots of ``PatchState``, and those travel with the state (copies, pickles, DataParallel replicas)."""

from __future__ import annotations

import copy
import inspect
import pickle

import fusepatch
from fusepatch.engine.features import FEATURES, RUNNERS, SLOTS
from fusepatch.engine.plan import checked
from fusepatch.tools.tiny import tiny_model


def test_checked_takes_applys_keyword_arguments_with_their_defaults():
    """``check_apply_kwargs`` binds against ``checked``: its parameters are apply's keyword arguments."""
    applys = [(p.name, p.default) for p in inspect.signature(fusepatch.apply).parameters.values() if p.name != "model"]
    assert [(p.name, p.default) for p in inspect.signature(checked).parameters.values()] == applys


def test_each_slot_has_one_owner_and_the_runners_come_in_order():
    names = [name for feature in FEATURES for name in feature.slots]
    assert len(names) == len(set(names)) == len(SLOTS)
    assert len({feature.name for feature in FEATURES}) == len(FEATURES)
    runners = [type(runs.__self__).__name__ for runs in RUNNERS]
    assert runners == ["Traceable", "CudaGraphs"]  # a call dynamo traces never replays a graph


def test_slots_travel_with_the_state(monkeypatch):
    """A patched module's state holds every feature's slot, set by the apply that patched it; a deep copy, a
    pickle and a DataParallel replica keep them, each bound to its own module."""
    monkeypatch.setenv("FUSEPATCH_MLP_RECOMPUTE", "1")
    model = tiny_model("qwen3", num_hidden_layers=1)
    fusepatch.apply(model, ops=[], verbose=False)  # every op eager: no self-test to wait for
    mlp = model.model.layers[0].mlp
    assert set(SLOTS) <= set(vars(mlp._fusepatch))
    assert mlp._fusepatch.mlp_recompute is True and mlp._fusepatch.drop_frozen is False
    for other in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp)), mlp._replicate_for_data_parallel()):
        state = other._fusepatch
        assert {name: getattr(state, name) for name in SLOTS} == {n: getattr(mlp._fusepatch, n) for n in SLOTS}
        assert state.owner is other and other.forward.__self__ is other
    fusepatch.revert(model)
    assert "_fusepatch" not in vars(mlp) and "_replicate_for_data_parallel" not in vars(mlp)
