"""Weights a candidate prepares once for many calls (``Candidate.prepare``: a kernel's quantized copy of a
frozen weight), kept per weight by the op's dispatcher, and certain to hold the weight's values at every call: the
one owner of that rule (``PreparedWeights.handle``).

A weight that trains is prepared by nothing (its kernel reads it afresh at every call). A frozen weight's handle is
made at its first call and kept: a new tensor, new storage, shape, dtype or device, or a new version (an in-place
update) gives a new handle. Writes that move none of these (through ``.data`` as peft's merges and TRL's
reference-model sync write, through another view of the storage, FSDP2 gathering new values at the same address) are
seen by a fingerprint of the weight's contents, checked at every call: on the GPU without a sync
(``kernels/fingerprint.py``), the candidate's ``refresh`` writing the handle's buffers again only when it changed,
so a CUDA graph that captured the check runs it at every replay; elsewhere compared on the host. Inside
``torch.compile`` (traced as a fresh preparation) and under ``torch.inference_mode`` (its tensors cannot serve a
later training step) nothing is kept.

A weight dropped once prepared (``apply(drop_frozen_weights=True)``) carries its handle itself (``Held``, as the
attribute ``HELD``): nothing can write it, nothing is checked, and it copies and pickles with its module. So does
the weight FSDP2 gathers from a frozen projection's sharded copy (``backends/fsdp2.py``): the handle of the rows it
gathered, each rank's own rows checked here as a weight of their own before each gather.

A weight an engine gathers for each call and frees after (DeepSpeed ZeRO-3's partitioned parameters; FSDP2's
where its copy cannot stay sharded, marked ``PER_CALL``) gets no handle: one kept between calls would be a whole
copy on every rank; its kernel quantizes it at each call.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fusepatch.backends import deepspeed
from fusepatch.base.op import Candidate
from fusepatch.kernels.fingerprint_spec import STALE, STATE_WORDS, fingerprint_reference

HELD = "fusepatch_prepared"  # the attribute of a weight that is only its handle (``Held``)
PER_CALL = "fusepatch_per_call"  # the attribute of a weight an engine gathers anew for each call: nothing kept

_generations = itertools.count(1)  # process-wide: a handle let go and one made after never share a number


class Held(NamedTuple):
    """A prepared weight's handle with what made it: the candidate (whose callable alone can read it) and how it
    gives the weight's values back (``Candidate.restore``)."""

    candidate: str
    handle: Any
    restore: Callable[[Any], torch.Tensor] | None


def held_by(weight: Any) -> Held | None:
    """The handle a weight carries in place of its values (a dropped weight), or None."""
    return getattr(weight, HELD, None) if isinstance(weight, torch.Tensor) else None


def fingerprint_weight(weight: torch.Tensor) -> torch.Tensor:
    """What a handle holds to check its weight's contents at each call (``stale``): on CUDA the fingerprint
    kernel's state, holding ``weight``'s fingerprint now; elsewhere the fingerprint itself."""
    if weight.device.type == "cuda":
        from fusepatch.kernels.fingerprint import fingerprint

        state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=weight.device)
        fingerprint(weight, state)
        return state
    return fingerprint_reference(weight)


def stale(weight: torch.Tensor, check: torch.Tensor) -> torch.Tensor | bool:
    """Check ``weight``'s contents against ``check`` (its ``fingerprint_weight``), which then holds their fingerprint
    now. On CUDA the answer stays on the device (int32 ``[1]``, 1: changed), no sync; elsewhere a bool."""
    if weight.device.type == "cuda":
        from fusepatch.kernels.fingerprint import fingerprint

        fingerprint(weight, check)
        return check[STALE : STALE + 1]
    now = fingerprint_reference(weight)
    changed = not torch.equal(now, check)
    if changed:
        check.copy_(now)
    return changed


@dataclass
class _Entry:
    key: tuple  # where and what the weight was when prepared: device, storage, version, shape, dtype
    weight: weakref.ref
    held: Held
    check: torch.Tensor  # its contents' fingerprint (``fingerprint_weight``)
    generation: int = 0  # a process-wide number, new each time this weight's handle is made anew


def _key(weight: torch.Tensor) -> tuple:
    return (weight.device, weight.data_ptr(), weight._version, weight.shape, weight.dtype)


class PreparedWeights:
    """The handles one dispatcher keeps, one per weight (by identity, let go with the weight), each with its
    generation: a new number each time it is made anew, which a CUDA graph that read the old one's memory compares
    before a replay (``generation_of``, ``layers/layer_graphs.py``)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def kept(self, weight: torch.Tensor) -> Held | None:
        """What is held for ``weight`` now, as the last call left it (nothing made or checked): its own (a dropped
        weight's) or the one kept here."""
        carried = held_by(weight)
        if carried is not None:
            return carried
        entry = self._entries.get(id(weight))
        return entry.held if entry is not None and entry.weight() is weight else None

    def all_held(self) -> list[Held]:
        """Every handle kept here for a weight still alive (what they hold is memory the weights' own does not
        count: a per-rank memory account reads it)."""
        return [entry.held for entry in self._entries.values() if entry.weight() is not None]

    def handle(self, candidate: Candidate, weight: torch.Tensor) -> Any | None:
        """``candidate``'s handle of ``weight`` for this call, holding the weight's values now; None where nothing
        is prepared: a candidate that prepares nothing, a weight that trains, inside ``torch.compile``, under
        ``torch.inference_mode``, a weight an engine gathers for each call."""
        held = self.held(candidate, weight)
        return None if held is None else held.handle

    def held(self, candidate: Candidate, weight: torch.Tensor, *, once: bool = False) -> Held | None:
        """``handle`` with what made it. ``once``: the weight is dropped right after (``Held`` is all that will be
        left of it): the handle is made and given, not kept or checked."""
        carried = held_by(weight)
        if carried is not None:
            if carried.candidate != candidate.name:
                raise RuntimeError(
                    f"fusepatch: this weight is kept only as what candidate {carried.candidate!r} prepared, which "
                    f"{candidate.name!r} (chosen for this call) cannot read; fix: run it where {carried.candidate!r} "
                    "is chosen, or fusepatch.revert(model) for a weight of values again"
                )
            return carried
        if candidate.prepare is None or weight.requires_grad:
            return None
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return None
        if deepspeed.partitioned(weight) or getattr(weight, PER_CALL, False):
            return None  # gathered anew at each call: a copy kept would be whole on every rank
        if once:
            return Held(candidate.name, candidate.prepare(weight.detach()), candidate.restore)
        key = _key(weight)
        entry = self._entries.get(id(weight))
        if (
            entry is not None
            and entry.key == key
            and entry.held.candidate == candidate.name
            and entry.weight() is weight
        ):
            changed = stale(weight, entry.check)
            if candidate.refresh is not None:
                if changed is not False:  # on the device: the candidate reads the flag there
                    candidate.refresh(weight, entry.held.handle, changed if changed is not True else _ONE)
                return entry.held
            if not isinstance(changed, bool):
                changed = bool(changed.item())  # a sync: only a candidate without ``refresh`` needs it
            if not changed:
                return entry.held
        held = Held(candidate.name, candidate.prepare(weight.detach()), candidate.restore)
        self._keep(weight, _Entry(key, self._watch(weight), held, fingerprint_weight(weight)))
        return held

    def generation_of(self, weight: torch.Tensor | None) -> int:
        """The generation of ``weight``'s handle kept here (0: none): what a CUDA graph that read this weight's
        handle compares, untouched by the handles of other weights (another model's, a copy's) this dispatcher
        keeps."""
        entry = self._entries.get(id(weight)) if weight is not None else None
        return entry.generation if entry is not None and entry.weight() is weight else 0

    def _keep(self, weight: torch.Tensor, entry: _Entry) -> None:
        entry.generation = next(_generations)
        self._entries[id(weight)] = entry

    def _watch(self, weight: torch.Tensor) -> weakref.ref:
        entries, ident = weakref.ref(self), id(weight)

        def gone(ref: weakref.ref) -> None:  # the weight was freed: its handle goes with it
            owner = entries()
            if owner is not None and (entry := owner._entries.get(ident)) is not None and entry.weight is ref:
                del owner._entries[ident]

        return weakref.ref(weight, gone)


_ONE = torch.ones(1, dtype=torch.int32)  # a host check's "changed", as the device's flag says it
