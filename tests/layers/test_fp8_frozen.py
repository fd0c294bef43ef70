"""A frozen FP8 projection's copy (the candidate's ``prepare``, kept by the op's dispatcher: ``ops/prepared.py``) never
computes with values its weight no longer holds. A kept copy (the weight kept too) is checked against the weight's contents at every call, so writes that
leave the weight's storage and version as they were (``.data``, another view of its storage, a load, a move) are
seen; a dropped weight (``drop_frozen_weights=True``) has no values to write, and every writer refuses with the
fix, while its metadata answers as the weight's did. On the CPU the FP8 function runs as the op's kernel
(``cpu_candidates``), the path a GPU takes; each result is compared, exactly, with a copy of the model quantized
afresh."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import cpu_candidates, lm_batch

import fusepatch
from fusepatch.layers.fp8 import DroppedWeight
from fusepatch.ops.fp8_linear.scaled_mm import fp8_linear
from fusepatch.tools.tiny import tiny_model


def _fp8_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "fp8_linear" in getattr(m.__dict__.get("_fusepatch"), "ops", {})]


def _frozen_fp8(monkeypatch, **apply_kwargs) -> torch.nn.Module:
    """A tiny bf16 model, every parameter frozen (a reference model, or LoRA's bases), its projections in FP8."""
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    model.requires_grad_(False)
    fusepatch.apply(model, precision="fp8", verbose=False, **apply_kwargs)
    return model


def _kept(module):
    return module._fusepatch.ops["fp8_linear"].kept(module.weight)


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.float()


def _afresh(model, batch) -> torch.Tensor:
    """The logits of a copy of ``model`` whose FP8 copies are all made anew (a copy keeps none)."""
    return _logits(copy.deepcopy(model), batch)


def _weights(model) -> list[torch.nn.Parameter]:
    return [m.weight for m in _fp8_modules(model)]


def _by_data(model, run):
    for weight in _weights(model):
        weight.data.mul_(-1.5)


def _by_data_copy(model, run):
    for weight in _weights(model):
        weight.data.copy_(weight.detach().flip(0))


def _by_storage(model, run):
    for weight in _weights(model):
        values = (weight.detach() * 2).contiguous()
        weight.untyped_storage().copy_(values.untyped_storage())


def _by_a_view_made_before(model, run):
    views = [weight.data.view(-1) for weight in _weights(model)]  # ``.data``: a version counter of its own
    run()
    for view in views:
        view.add_(0.25)


def _by_the_vector_of_vector_to_parameters(model, run):
    weights = _weights(model)
    flat = torch.nn.utils.parameters_to_vector(weights)
    torch.nn.utils.vector_to_parameters(flat, weights)  # each weight now a view of ``flat``: new storage, seen
    run()
    flat.mul_(0.5)  # written through the vector: the weights' own version counters do not move


WRITES = {
    "data-mul": _by_data,
    "data-copy": _by_data_copy,
    "untyped-storage-copy": _by_storage,
    "view-made-before": _by_a_view_made_before,
    "vector-to-parameters": _by_the_vector_of_vector_to_parameters,
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_that_keeps_storage_and_version_is_seen(monkeypatch, write):
    """Writes that change neither the weight's storage nor its version (TRL's reference-model sync through
    ``.data``, a storage copy, a view made before, the vector behind ``vector_to_parameters``): the next call
    computes what a copy quantized afresh computes, exactly."""
    model = _frozen_fp8(monkeypatch)
    batch = lm_batch(model, length=16)
    before = _logits(model, batch)
    assert all(_kept(m) is not None for m in _fp8_modules(model))  # kept: the case a write could miss
    WRITES[write](model, lambda: _logits(model, batch))
    after = _logits(model, batch)
    assert torch.equal(after, _afresh(model, batch))
    assert not torch.equal(after, before)  # the write mattered


def _load(model, run):
    model.load_state_dict({name: value * 0.5 for name, value in model.state_dict().items()})


def _load_assigned(model, run):
    state = {name: (value * 0.5).clone() for name, value in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _there_and_back(model, run):
    model.to(torch.float32)
    run()
    for weight in _weights(model):
        weight.data.mul_(0.75)  # changed in fp32, then cast back into storage that may sit where the first did
    model.to(torch.bfloat16)


def _there_and_back_to_the_same_address(model, run):
    """A move to fp32 and back whose bf16 storage lands where the first was, as a caching allocator's may (and
    ``model.to``'s did in some runs of the case above): the weight's storage pointer and version as before."""
    weights = _weights(model)
    kept = [weight.data for weight in weights]  # the bf16 storages, held here so that they come back
    for weight in weights:
        weight.data = weight.data.float()
    for weight, storage in zip(weights, kept):
        weight.data.mul_(0.75)
        storage.copy_(weight.data)
        weight.data = storage


MOVES = {
    "load-state-dict": _load,
    "load-state-dict-assign": _load_assigned,
    "dtype-round-trip": _there_and_back,
    "dtype-round-trip-same-address": _there_and_back_to_the_same_address,
}


@pytest.mark.parametrize("move", list(MOVES))
def test_a_load_or_a_move_is_seen(monkeypatch, move):
    """``load_state_dict`` (in place, and ``assign=True``) and a move to another dtype and back: the next call
    computes what a copy quantized afresh computes, exactly."""
    model = _frozen_fp8(monkeypatch)
    batch = lm_batch(model, length=16)
    before = _logits(model, batch)
    MOVES[move](model, lambda: _logits(model, batch))
    after = _logits(model, batch)
    assert torch.equal(after, _afresh(model, batch))
    assert not torch.equal(after, before)


def _dropped_fp8(monkeypatch) -> tuple[torch.nn.Module, dict]:
    """``_frozen_fp8`` with ``drop_frozen_weights=True``, after the call that drops the weights; and a batch."""
    model = _frozen_fp8(monkeypatch, drop_frozen_weights=True)
    batch = lm_batch(model, length=16)
    _logits(model, batch)
    assert all(isinstance(weight, DroppedWeight) for weight in _weights(model))
    return model, batch


def _values(weight) -> torch.Tensor:
    return torch.randn(tuple(weight.shape)).to(weight.dtype)


DROPPED_WRITES = {
    "data-copy": lambda model, w: w.data.copy_(_values(w)),
    "data-mul": lambda model, w: w.data.mul_(2),
    "data-set": lambda model, w: setattr(w, "data", _values(w)),
    "copy": lambda model, w: w.copy_(_values(w)),
    "init": lambda model, w: torch.nn.init.normal_(w),
    "untyped-storage": lambda model, w: w.untyped_storage().fill_(0),
    "vector-to-parameters": lambda model, w: torch.nn.utils.vector_to_parameters(_values(w).reshape(-1), [w]),
    "load-state-dict": lambda model, w: model.load_state_dict(
        {n: _values(v) if v.is_meta else v.clone() for n, v in model.state_dict().items()}
    ),
}


@pytest.mark.parametrize("write", list(DROPPED_WRITES))
def test_every_write_to_a_dropped_weight_refuses_with_the_fix(monkeypatch, write):
    """A dropped weight has no values, so a write could only be lost: each writer raises the drop's message with its
    fix, and the model still computes what it did."""
    model, batch = _dropped_fp8(monkeypatch)
    before = _logits(model, batch)
    with torch.no_grad(), pytest.raises(RuntimeError, match="drop_frozen_weights.*revert"):
        DROPPED_WRITES[write](model, _weights(model)[0])
    assert torch.equal(_logits(model, batch), before)


def test_a_dropped_weight_loaded_by_assignment_is_quantized_from_the_loaded_values(monkeypatch):
    """``load_state_dict(assign=True)`` puts new parameters in the dropped weights' place: the next call quantizes
    them (and drops them again), computing what the loaded model computes afresh."""
    model, batch = _dropped_fp8(monkeypatch)
    loaded = tiny_model("qwen3", hidden_size=128, intermediate_size=256, seed=1).to(torch.bfloat16)
    model.load_state_dict({n: v.clone() for n, v in loaded.state_dict().items()}, assign=True)
    model.requires_grad_(False)
    assert not any(isinstance(weight, DroppedWeight) for weight in _weights(model))
    want = _afresh(model, batch)
    assert torch.equal(_logits(model, batch), want)
    assert all(isinstance(weight, DroppedWeight) for weight in _weights(model))


METADATA = {
    "torch.numel": torch.numel,
    "numel": lambda w: w.numel(),
    "stride": lambda w: w.stride(),
    "is_contiguous": lambda w: w.is_contiguous(),
    "shape": lambda w: w.shape,
    "dtype": lambda w: w.dtype,
    "device": lambda w: w.device,
    "size": lambda w: w.size(),
    "size(1)": lambda w: w.size(1),
    "dim": lambda w: w.dim(),
    "requires_grad": lambda w: w.requires_grad,
}


def test_a_dropped_weight_answers_its_metadata_as_the_weight_did(monkeypatch):
    """Only reading values refuses: shape, size, stride, contiguity, element count, dtype and device answer as
    the weight's own did, including a weight that was not contiguous."""
    cpu_candidates(monkeypatch, {"fp8_linear": fp8_linear})
    model = tiny_model("qwen3", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    model.requires_grad_(False)
    transposed = model.model.layers[0].mlp.up_proj
    transposed.weight = torch.nn.Parameter(transposed.weight.detach().t().contiguous().t(), requires_grad=False)
    fusepatch.apply(model, precision="fp8", verbose=False, drop_frozen_weights=True)
    weights = _weights(model)
    want = [{name: ask(weight) for name, ask in METADATA.items()} for weight in weights]
    assert not want[next(i for i, w in enumerate(weights) if w is transposed.weight)]["is_contiguous"]
    _logits(model, lm_batch(model, length=16))
    dropped = _weights(model)
    for weight, answers in zip(dropped, want):
        assert isinstance(weight, DroppedWeight)
        assert {name: ask(weight) for name, ask in METADATA.items()} == answers
    with pytest.raises(RuntimeError, match="drop_frozen_weights.*revert"):
        dropped[0].sum()
