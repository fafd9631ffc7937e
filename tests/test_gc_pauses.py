"""A node's garbage collection pauses (georep/node/gc_pauses.py): measured, and the long-lived objects frozen out of
full collections, so that a full collection walks what was allocated since the last one (issue 25: at 100,000
topics a full collection stopped a node for about a second, in the middle of a new subscription)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from georep.node import gc_pauses
from georep.node.gc_pauses import GcPauses


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[GcPauses]:
    monkeypatch.setattr(gc_pauses, "CHECK_S", 0.01)
    w = GcPauses()
    w.install()
    yield w
    w.uninstall()
    gc.unfreeze()


async def run_for(w: GcPauses, seconds: float) -> None:
    task = asyncio.create_task(w.run())
    await asyncio.sleep(seconds)
    task.cancel()


def test_a_full_collection_after_the_freeze_walks_only_what_came_since(watch: GcPauses) -> None:
    """200,000 long-lived objects are frozen once the node serves; those made after are frozen after the next full
    collection. Planted: no freeze, and the oldest generation holds them all (every full collection walks them)."""
    old = [[i] for i in range(200_000)]
    asyncio.run(run_for(watch, 0.05))  # the node serves: everything alive is frozen
    assert gc.get_freeze_count() >= len(old)
    assert len(gc.get_objects(generation=2)) < 50_000
    newer = [[i] for i in range(100_000)]
    gc.collect()
    assert watch.counts[2] >= 1 and watch.seconds[2] > 0 and watch.longest > 0
    asyncio.run(run_for(watch, 0.05))
    assert gc.get_freeze_count() >= len(old) + len(newer)
    assert len(gc.get_objects(generation=2)) < 50_000


def test_the_freeze_is_undone_every_unfreeze_s_so_old_cycles_are_reclaimed(
    watch: GcPauses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: a node that never unfreezes keeps a frozen cycle that became garbage for good."""

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    cycle = Cycle()
    ref = weakref.ref(cycle)
    asyncio.run(run_for(watch, 0.05))
    assert gc.get_freeze_count() > 0
    del cycle  # garbage, but frozen: no collection reclaims it ...
    gc.collect()
    assert ref() is not None
    monkeypatch.setattr(gc_pauses, "UNFREEZE_S", 0.02)
    asyncio.run(run_for(watch, 0.1))  # ... until the node unfreezes
    gc.collect()
    assert ref() is None


def test_without_the_freeze_nothing_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    w = GcPauses(freeze=False)
    asyncio.run(run_for(w, 0.05))
    assert gc.get_freeze_count() == 0
