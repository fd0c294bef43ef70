"""Python's garbage collections counted by generation, and the long-lived objects frozen out of later walks."""

from __future__ import annotations

import gc
import weakref

import pytest

from fusepatch.diagnostics.collector import CollectorPauses, LongLivedFreeze


@pytest.fixture
def nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_collections_are_counted_by_generation_while_installed():
    pauses = CollectorPauses()
    pauses.install()
    pauses.install()  # once only
    try:
        gc.collect(2)
        gc.collect(2)
        gc.collect(0)
    finally:
        pauses.remove()
    gc.collect(2)  # removed: not counted
    assert pauses.counts[2] == 2 and pauses.counts[0] >= 1
    assert pauses.seconds[2] > 0 and not pauses.active
    assert pauses.describe().startswith("2 of generation 2 (")


def test_a_freeze_leaves_garbage_out_and_thaws_what_it_froze(nothing_frozen):
    alive = [[] for _ in range(1000)]
    dead = weakref.ref(_Cyclic())  # a cycle no one refers to: collected, not frozen
    freeze = LongLivedFreeze()
    assert freeze.freeze() >= len(alive) and dead() is None
    assert 0 < gc.get_freeze_count() <= freeze.frozen  # (those freed by their counts since leave it)
    assert all(o is not alive for o in gc.get_objects())  # out of the walks
    freeze.thaw()
    assert any(o is alive for o in gc.get_objects())
    assert gc.get_freeze_count() == 0


def test_objects_the_program_froze_stay_frozen(nothing_frozen):
    gc.freeze()
    before = gc.get_freeze_count()
    freeze = LongLivedFreeze()
    freeze.freeze()
    freeze.thaw()
    assert gc.get_freeze_count() >= before > 0


class _Cyclic:
    def __init__(self):
        self.me = self


def test_collections_since_a_point_name_the_oldest_generation():
    pauses = CollectorPauses()
    pauses.install()
    try:
        before = pauses.total()
        gc.collect(1)
        gc.collect(1)
        middle = pauses.total()
        gc.collect(2)
        end = pauses.since(middle)
    finally:
        pauses.remove()
    first = pauses.since(before)
    assert first.by_generation.get(1, 0) >= 2 and first.oldest == 2 and first.seconds > 0
    assert end.by_generation == {2: 1} and end.count == 1 and end.oldest == 2
    assert pauses.since(pauses.total()).oldest == -1


def test_a_freeze_never_thawed_is_thawed_by_the_next_and_only_once(nothing_frozen):
    """A training that raised leaves its freeze in effect: ``thaw_abandoned`` unfreezes it, and not the program's."""
    LongLivedFreeze().freeze()  # never thawed
    assert LongLivedFreeze.thaw_abandoned() > 0 and gc.get_freeze_count() == 0
    assert LongLivedFreeze.thaw_abandoned() == 0
    gc.freeze()  # the program's own
    assert LongLivedFreeze.thaw_abandoned() == 0 and gc.get_freeze_count() > 0


def test_reset_counts_from_zero():
    pauses = CollectorPauses()
    pauses.install()
    try:
        gc.collect(2)
        pauses.reset()
        gc.collect(1)
    finally:
        pauses.remove()
    assert pauses.counts[2] == 0 and pauses.counts[1] >= 1
