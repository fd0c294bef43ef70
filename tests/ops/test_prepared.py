"""A candidate that prepares its weight (``Candidate.prepare``), added as one ``Candidate`` through
``fusepatch.add_candidate``, as a second FP8 kernel (one built on torchao, say) would be: the dispatcher keeps its
handle per frozen weight, passes it to the candidate, and prepares it again exactly when the weight changed, whatever
wrote it (``ops/prepared.py``); the layers only pass the weight."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fusepatch
from fusepatch.base.env import capture
from fusepatch.base.op import Candidate
from fusepatch.base.requirements import InputRule
from fusepatch.engine.resolve import make_dispatch

TOY = "toy-prepared"


class _Toy:
    """The candidate's parts, counting what the dispatcher asks of them."""

    def __init__(self, refresh: bool) -> None:
        self.prepared: list[torch.Tensor] = []
        self.refreshed = 0
        self.given: list[object] = []
        self.has_refresh = refresh

    def prepare(self, weight: torch.Tensor) -> dict:
        self.prepared.append(weight)
        return {"weight": weight.detach().clone()}

    def refresh(self, weight: torch.Tensor, handle: dict, stale: torch.Tensor) -> None:
        if bool(stale.item()):
            self.refreshed += 1
            handle["weight"].copy_(weight.detach())

    def restore(self, handle: dict) -> torch.Tensor:
        return handle["weight"]

    def linear(self, x, weight, bias=None, *, prepared=None):
        self.given.append(prepared)
        return F.linear(x, weight if prepared is None else prepared["weight"].to(x.dtype), bias)

    def candidate(self) -> Candidate:
        return Candidate(
            TOY,
            "pip",
            (),
            lambda: self.linear,
            inputs=InputRule(devices=("cpu",), dtypes=("float32", "bfloat16")),
            prepare=self.prepare,
            refresh=self.refresh if self.has_refresh else None,
            restore=self.restore,
        )


@pytest.fixture
def toy(request):
    parts = _Toy(refresh=getattr(request, "param", False))
    fusepatch.add_candidate("fp8_linear", parts.candidate())
    return parts


def _dispatch():
    return make_dispatch("fp8_linear", env=capture(), prefer=("pip",), label="test")


def _frozen(rows: int = 32, columns: int = 48) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(columns, rows, bias=False).requires_grad_(False)


def _data_mul(linear):
    linear.weight.data.mul_(2)


def _copy(linear):
    with torch.no_grad():
        linear.weight.copy_(torch.randn_like(linear.weight))


def _storage_alias(linear):
    linear.weight.untyped_storage().copy_((linear.weight.detach() * -3).contiguous().untyped_storage())


def _load_state_dict(linear):
    linear.load_state_dict({"weight": torch.randn_like(linear.weight)})


def _dtype_move(linear):
    linear.to(torch.bfloat16)


WRITES = {
    "data": _data_mul,
    "copy_": _copy,
    "storage-alias": _storage_alias,
    "load_state_dict": _load_state_dict,
    "dtype-move": _dtype_move,
}


@pytest.mark.parametrize("write", list(WRITES))
def test_the_dispatcher_keeps_a_handle_and_prepares_it_again_when_the_weight_changes(toy, write):
    """The handle is made at the first call, passed to the candidate, and kept while the weight is as it was; each
    write (through ``.data``, ``copy_``, another view of its storage, ``load_state_dict``, a dtype move) gives the
    next call a handle of the new values, with a new generation."""
    dispatch, linear = _dispatch(), _frozen()
    x = torch.randn(3, 48)
    out = dispatch(x, linear.weight)
    assert dispatch.choice("cpu", "float32").chosen == TOY
    assert len(toy.prepared) == 1 and toy.given[-1] is not None
    assert torch.equal(out, F.linear(x, linear.weight))
    first = dispatch.generation_of(linear.weight)
    dispatch(x, linear.weight)
    assert len(toy.prepared) == 1 and dispatch.generation_of(linear.weight) == first  # unchanged: kept
    WRITES[write](linear)
    x = x.to(linear.weight.dtype)
    out = dispatch(x, linear.weight)
    assert len(toy.prepared) == 2 and dispatch.generation_of(linear.weight) not in (0, first)
    assert torch.equal(out, F.linear(x, linear.weight))
    dispatch(x, linear.weight)
    assert len(toy.prepared) == 2


@pytest.mark.parametrize("toy", [True], indirect=True)
def test_a_candidate_with_refresh_writes_its_handle_again_in_place(toy):
    """A write that keeps storage and version (``.data``) reaches a candidate with ``refresh`` as a write into the
    handle it has: the same handle, the same generation (a CUDA graph reading it stays valid)."""
    dispatch, linear = _dispatch(), _frozen()
    x = torch.randn(3, 48)
    dispatch(x, linear.weight)
    handle, generation = dispatch.kept(linear.weight).handle, dispatch.generation_of(linear.weight)
    linear.weight.data.mul_(-1)
    assert torch.equal(dispatch(x, linear.weight), F.linear(x, linear.weight))
    assert toy.refreshed == 1 and len(toy.prepared) == 1
    assert dispatch.kept(linear.weight).handle is handle and dispatch.generation_of(linear.weight) == generation


def test_a_trained_weight_is_passed_as_it_is_and_a_freed_one_lets_its_handle_go(toy):
    """A weight that takes a gradient is prepared by nothing (the candidate reads it at every call); a frozen weight
    freed lets its handle go (nothing of it is kept: a CUDA graph that read it holds the weight alive)."""
    dispatch, linear = _dispatch(), _frozen()
    x = torch.randn(3, 48)
    trained = linear.weight.detach().clone().requires_grad_(True)
    dispatch(x, trained)
    assert toy.given[-1] is None and not toy.prepared
    dispatch(x, linear.weight)
    assert dispatch.kept(linear.weight) is not None
    del linear
    assert len(dispatch._prepared) == 0


def test_a_weights_generation_is_its_own_handles(toy):
    """A CUDA graph that read one weight's handle compares that handle's generation (``layers/layer_graphs._reads``):
    another weight's handle made or let go (a copy of the model shares the dispatcher) leaves it as it was; its own
    made anew changes it."""
    dispatch, mine, other = _dispatch(), _frozen(), _frozen()
    x = torch.randn(3, 48)
    dispatch(x, mine.weight)
    assert dispatch.generation_of(mine.weight) != 0 and dispatch.generation_of(other.weight) == 0
    seen = dispatch.generation_of(mine.weight)
    dispatch(x, other.weight)
    del other
    assert dispatch.generation_of(mine.weight) == seen  # two handles of another weight made and let go meanwhile
    mine.weight.data = mine.weight.data.clone()  # new storage: a new handle
    dispatch(x, mine.weight)
    assert dispatch.generation_of(mine.weight) not in (0, seen)


def test_the_reference_takes_only_what_it_computes():
    """The eager fallback never sees a handle: its signature is the op's, ``F.linear``'s."""
    import inspect

    from fusepatch.ops.fp8_linear.reference import fp8_linear_reference

    assert list(inspect.signature(fp8_linear_reference).parameters) == ["x", "weight", "bias"]


def test_a_dropped_weight_holds_the_toys_handle_and_comes_back_from_it(toy):
    """``drop_frozen_weights=True`` over the toy candidate: the weight is dropped once prepared, the model computes
    from the handle the weight holds (deep copies too), and ``revert`` restores the weight from it."""
    from fusepatch.layers.fp8 import DroppedWeight, is_dropped

    torch.manual_seed(0)
    model = fusepatch_tiny().requires_grad_(False)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    fusepatch.apply(model, precision="fp8", drop_frozen_weights=True, verbose=False)
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    dropped = [m for m in model.modules() if is_dropped(m)]
    assert dropped and all(isinstance(m.weight, DroppedWeight) for m in dropped)
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(input_ids=ids).logits, logits)
    fusepatch.revert(model)
    assert not any(is_dropped(m) for m in model.modules())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())  # the toy's handle holds the values


def fusepatch_tiny():
    from fusepatch.tools.tiny import tiny_model

    return tiny_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1)
