"""Stall detection under load (issue 22): an upstream that delivers is not stalled because, at every tick, some
other partition is one step ahead elsewhere. A stall is judged per partition, and only while the upstream delivers
nothing of the origin site: the same partition held behind for ``stall_ms`` by an upstream that moved nothing.

Before, "behind since" was kept per (upstream, origin site): a produce spread over thousands of partitions keeps
some partition briefly behind at every tick, so the preferred upstream was declared stalled after ``stall_ms``
and every link's wants changed, reopening its stream, and again when the stall was lifted.
"""

from __future__ import annotations

from georep.replication.links import LinkManager
from offsets.coordinates import Origin
from tests.support.topologies import diamond
from topology.ids import SiteId

D = Origin(SiteId("d"), 1)
PARTITIONS = 50
STALL_MS = 1_000
TICK_MS = 100
DIAMOND = diamond()


def site_a() -> LinkManager:
    """Site a pulls d's records from b (the routed upstream: tie on cost, lowest id); c is the fallback."""
    m = LinkManager(DIAMOND, "a", stall_ms=STALL_MS)
    m.topic("t", PARTITIONS)
    for src in ("b", "c"):
        m.link_up(src, 0)
    assert m.upstream_for("t", "d") == "b"
    return m


def deliver(m: LinkManager, key: tuple[str, int], seq: int) -> None:
    """b sends ``key`` up to ``seq`` and a applies it."""
    m.upstream_vector("b", key, {D: seq})
    m.local_vector(key, {D: seq})


def test_a_produce_over_many_partitions_does_not_stall_the_upstream_that_delivers_them() -> None:
    m = site_a()
    for tick in range(3 * STALL_MS // TICK_MS):  # three stall windows
        now = tick * TICK_MS
        key = ("t", tick % PARTITIONS)
        m.upstream_vector("c", key, {D: 1})  # c heard of d's new record of this partition first ...
        m.tick(now)
        assert not m.stalled, f"b declared stalled at {now} ms while it delivers every partition within a tick"
        deliver(m, key, 1)  # ... and b delivers it before the next tick
    assert m.upstream_for("t", "d") == "b"


def test_a_hot_partition_that_b_keeps_delivering_does_not_stall_b_though_c_stays_ahead() -> None:
    m = site_a()
    key = ("t", 0)
    for tick in range(3 * STALL_MS // TICK_MS):
        m.upstream_vector("c", key, {D: tick + 1})  # c is always one record ahead ...
        m.tick(tick * TICK_MS)
        assert not m.stalled, f"b declared stalled at {tick * TICK_MS} ms while it moves the partition every tick"
        deliver(m, key, tick + 1)  # ... and b moves the partition every tick


def test_one_partition_held_behind_stalls_its_upstream_once_the_others_stop_flowing() -> None:
    m = site_a()
    stuck = ("t", 0)
    m.upstream_vector("c", stuck, {D: 5})  # b never sends partition 0 ...
    ticks = 3 * STALL_MS // TICK_MS
    for tick in range(ticks):
        deliver(m, ("t", 1 + tick % (PARTITIONS - 1)), tick + 1)  # ... while it delivers every other one
        m.tick(tick * TICK_MS)
    assert not m.stalled  # a link that delivers is slow, not stalled: partition 0 waits for the writes to stop
    for tick in range(ticks, ticks + STALL_MS // TICK_MS + 1):
        m.tick(tick * TICK_MS)  # writes stopped: b moves nothing more of d
    assert ("b", "d") in m.stalled
    assert m.upstream_for("t", "d") == "c"


def test_an_upstream_slower_than_the_stall_window_at_each_partition_is_not_stalled_while_it_delivers() -> None:
    """A busy source serves each partition less often than stall_ms, but always serves some partition."""
    m = site_a()
    for p in range(PARTITIONS):
        m.upstream_vector("c", ("t", p), {D: 1})  # c has d's record of every partition
    for tick in range(PARTITIONS):
        deliver(m, ("t", tick), 1)  # b delivers one partition per tick: the last waits 5 s, > stall_ms
        m.tick(tick * TICK_MS)
        assert not m.stalled, f"b declared stalled at {tick * TICK_MS} ms while it delivers a partition every tick"
