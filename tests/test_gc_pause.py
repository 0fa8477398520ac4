"""``GcPause``: the cyclic garbage collector off while an engine starts, back to its former state after; with
``freeze`` the start-up's own garbage collected first and the survivors moved to the permanent generation."""

from __future__ import annotations

import gc
import weakref

import pytest

from plinth.core.gc_pause import GcPause


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle no one holds (garbage for the cyclic collector only); a weak reference to one end."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_pause_turns_the_collector_off_and_back_on(restore_gc):
    gc.enable()
    with GcPause() as pause:
        assert not gc.isenabled()
        garbage = cycle()
        for _ in range(3 * gc.get_threshold()[0]):   # allocations that would trigger collections
            Node()
        assert garbage() is not None                 # nothing collected it
        pause.end()
        assert gc.isenabled()
        pause.end()                                  # idempotent
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None


def test_pause_keeps_a_collector_that_was_off_off(restore_gc):
    gc.disable()
    with GcPause(), GcPause():                       # nested: each restores what it found
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_freeze_collects_the_start_ups_garbage_then_freezes_the_rest(restore_gc):
    gc.enable()
    gc.unfreeze()
    gc.collect()
    with GcPause(freeze=True):
        garbage = cycle()
        alive = Node()
        alive.other = Node()
    assert gc.isenabled()
    assert garbage() is None                         # collected before the freeze, not frozen
    assert gc.get_freeze_count() >= 2                # at least the two live nodes
    assert alive.other is not None
