"""LinkManager's tick costs what lags, not the partition count (issue 22), and decides exactly what the full walk
decided: stalls begin and end at the same ticks (a reference that walks every partition every tick, as main did,
is run side by side on random feeds)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from georep.replication.links import BehindEntry, LinkManager
from offsets.coordinates import Origin
from tests.support.topologies import DIAMOND_TOML, diamond
from topology.ids import SiteId
from topology.interest import Interests
from topology.model import parse_topology

D = Origin(SiteId("d"), 1)
D2 = Origin(SiteId("d"), 2)
PARTITIONS = 2_000
DIAMOND = diamond()


class FullWalk(LinkManager):
    """main's tick: every partition with a vector, every tick; a stall's lift walks every partition held (the
    per-partition judgement, _behind_at and _mark_stalls, is shared: this checks what the tick looks at)."""

    def tick(self, now_ms: int) -> None:
        behind: dict[BehindEntry, int] = {}
        keys = self.local.keys() | {key for link in self.links.values() for key in link.vectors}
        for key in sorted(keys):
            self._behind_at(key, behind)
        self._mark_stalls(behind, now_ms)
        pairs = {(src, origin_site) for src, origin_site, _key in behind}
        for pair in sorted(self.stalled):
            if pair not in pairs and self._walked_caught_up(*pair):
                del self.stalled[pair]
                self._wants.clear()

    def _walked_caught_up(self, src: SiteId, origin_site: SiteId) -> bool:
        vectors = self.links[src].vectors
        for key, mine in self.local.items():
            for origin, seq in mine.items():
                if origin.site == origin_site and vectors.get(key, {}).get(origin, 0) < seq:
                    return False
        return True


def counting(calls: list[Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any) -> Any:
        calls.append(args)
        return fn(*args)

    return counted


class CountedDict(dict[tuple[str, int], dict[Origin, int]]):
    """This site's vectors, counting the walks over all of them."""

    walks = 0

    def items(self) -> Any:
        CountedDict.walks += 1
        return super().items()

    def __iter__(self) -> Any:
        CountedDict.walks += 1
        return super().__iter__()


def idle_site() -> LinkManager:
    """Site a, holding all of d's records of every partition, as both upstreams do: nothing lags."""
    m = LinkManager(DIAMOND, "a", stall_ms=1_000)
    m.topic("t", PARTITIONS)
    for src in ("b", "c"):
        m.link_up(src, 0)
    for p in range(PARTITIONS):
        m.local_vector(("t", p), {D: 10})
        for src in ("b", "c"):
            m.upstream_vector(src, ("t", p), {D: 10})
    return m


def test_an_idle_tick_looks_at_no_partition() -> None:
    m = idle_site()
    looked: list[Any] = []
    m._best_vector = counting(looked, m._best_vector)  # type: ignore[method-assign]
    for now in range(0, 2_000, 200):
        m.tick(now)
    assert looked == []  # main: every partition, every tick (20,000 looks here)
    assert not m.stalled


def test_a_lasting_stall_is_lifted_without_walking_every_partition_each_tick() -> None:
    m = idle_site()
    lagging = ("t", 7)
    m.upstream_vector("c", lagging, {D: 12})  # b stays at 10: behind c, for the origin d
    looked: list[Any] = []
    m._best_vector = counting(looked, m._best_vector)  # type: ignore[method-assign]
    m.local = CountedDict(m.local)
    m.tick(0)
    m.tick(1_000)
    assert ("b", "d") in m.stalled and m.upstream_for("t", "d") == "c"
    m.local_vector(lagging, {D: 12})  # c delivered; b still short of it: the stall lasts
    CountedDict.walks = 0
    for now in range(1_200, 5_000, 200):
        m.tick(now)
    assert ("b", "d") in m.stalled
    assert CountedDict.walks == 0  # main walked every partition for the lift check, every tick
    assert {args[0] for args in looked} <= {lagging}  # and the tick looked at the one that lagged only
    m.upstream_vector("b", lagging, {D: 12})  # b caught up
    m.tick(5_200)
    assert not m.stalled and m.upstream_for("t", "d") == "b"


def test_a_stalled_upstream_whose_link_drops_is_not_taken_back_for_what_it_said_before() -> None:
    m = idle_site()
    lagging = ("t", 7)
    m.upstream_vector("c", lagging, {D: 12})
    m.tick(0)
    m.tick(1_000)
    m.local_vector(lagging, {D: 12})
    assert ("b", "d") in m.stalled
    m.upstream_vector("b", lagging, {D: 12})  # b caught up ...
    m.link_down("b", 1_100, "gone")  # ... and dropped before the tick: what it said counts no more
    m.tick(1_200)
    assert ("b", "d") in m.stalled  # as main's full walk decides: b holds nothing it is known to hold


def feed(m: LinkManager, op: float, src: str, key: tuple[str, int], vector: dict[Origin, int], now: int) -> None:
    """One event of a random feed, picked by ``op`` in [0, 1)."""
    if op < 0.4:
        m.upstream_vector(src, key, vector)
    elif op < 0.6:
        m.local_vector(key, vector)
    elif op < 0.65:
        m.link_down(src, now, "gone")
    elif op < 0.75:
        m.link_up(src, now)
    else:
        m.tick(now)


@pytest.mark.parametrize("seed", range(12))
def test_the_incremental_tick_decides_what_the_full_walk_decided(seed: int) -> None:
    rng = random.Random(seed)
    fast, full = LinkManager(DIAMOND, "a", stall_ms=500), FullWalk(DIAMOND, "a", stall_ms=500)
    keys = [("t", p) for p in range(6)]
    for m in (fast, full):
        m.topic("t", len(keys))
    now = 0
    stalls = 0
    for _ in range(600):
        op, src, key = rng.random(), rng.choice(["b", "c"]), rng.choice(keys)
        vector = {o: rng.randint(0, 6) for o in rng.sample([D, D2], rng.randint(0, 2))}
        for m in (fast, full):
            feed(m, op, src, key, vector, now)
        now += rng.randint(0, 300)
        assert fast.stalled == full.stalled, (seed, now)
        assert fast.wants("b") == full.wants("b") and fast.wants("c") == full.wants("c")
        stalls += bool(full.stalled)
    assert stalls  # the run exercised stalls, not only the quiet path


class NoCache(LinkManager):
    """wants() as main computed it before topics were added to the answers kept: every topic routed, every call."""

    def wants(self, src: str) -> dict[tuple[str, int], tuple[SiteId, ...]]:
        self._forget_wants()
        return super().wants(src)


@pytest.mark.parametrize("seed", range(12))
def test_wants_kept_across_creates_and_growth_are_what_routing_every_topic_gives(seed: int) -> None:
    """Topics created and grown between wants() calls are added to the answers kept; stalls and link changes in
    between still start over. Against a reference that routes every topic at every call (planted: an answer kept
    without the new topics, or with a grown topic's old partitions only, fails here)."""
    rng = random.Random(seed)
    kept, fresh = LinkManager(DIAMOND, "a", stall_ms=500), NoCache(DIAMOND, "a", stall_ms=500)
    now, names = 0, ["t0"]
    for m in (kept, fresh):
        m.topic("t0", 1)
    for _ in range(400):
        op, src = rng.random(), rng.choice(["b", "c"])
        name = rng.choice(names)
        key = (name, rng.randrange(kept.partitions[name]))
        vector = {o: rng.randint(0, 6) for o in rng.sample([D, D2], rng.randint(0, 2))}
        new = f"t{len(names)}"
        for m in (kept, fresh):
            if op < 0.2:
                m.topic(new, rng.randint(1, 3) if m is kept else kept.partitions[new])
            elif op < 0.3:
                m.topic(name, m.partitions[name] + 1)
            else:
                feed(m, (op - 0.3) / 0.7, src, key, vector, now)
        if op < 0.2:
            names.append(new)
        now += rng.randint(0, 300)
        assert kept.wants("b") == fresh.wants("b") and kept.wants("c") == fresh.wants("c"), (seed, now)


def test_a_new_topic_routes_only_itself() -> None:
    """2,000 topics known and their wants kept: one more routes one topic per origin, not 2,001."""
    m = LinkManager(DIAMOND, "a", stall_ms=1_000)
    for i in range(2_000):
        m.topic(f"t{i}", 1)
    m.link_up("b", 0)
    before = m.wants("b")
    routed: list[Any] = []
    m._route = counting(routed, m._route)  # type: ignore[method-assign]
    m.topic("new", 2)
    after = m.wants("b")
    assert after is not before and set(after) - set(before) == {("new", 0), ("new", 1)}
    assert len(routed) <= len(DIAMOND.site_ids())


INTEREST_TOML = (
    DIAMOND_TOML.replace('src = "b"\ndst = "a"', 'src = "b"\ndst = "a"\nmode = "interest"')
    + '[sites.e]\nnodes = ["127.0.0.1:5"]\n[[links]]\nsrc = "a"\ndst = "e"\nmode = "interest"\n'
)
FILTERS = ["t1", "t2", "t3", "t7", "t1/x", "t1/**", "+/x", "t2/+"]


def change_interests(table: Interests, rng: random.Random, now: int) -> bool:
    """Time first (leases and lingers that ran out), as the node's tick does, then a random change of site a's
    interests: its readers, or e's advert."""
    changed = table.tick(now)
    op = rng.random()
    if op < 0.4:
        changed |= table.set_local(rng.sample(FILTERS, rng.randint(0, 3)), now)
    elif op < 0.7:
        entries = [(f, SiteId("e"), (SiteId("e"),)) for f in rng.sample(FILTERS, rng.randint(0, 3))]
        changed |= table.receive("e", entries, now, lease_ms=rng.choice([300, 3_000]))
    elif op < 0.8:
        changed |= table.drop("e", now)
    return changed


@pytest.mark.parametrize("seed", range(12))
def test_wants_after_an_interest_change_are_what_asking_about_every_topic_gives(seed: int) -> None:
    """An interest change asks again only about the topics its filters match (a subscription to 1,000 of 100,000
    topics, issue 25); against a reference that asks about every topic at every call, while topics are created
    and grown, links fail and interests come, go and linger (planted: the changed filters not taken, or an answer
    that only adds, fails here)."""
    rng = random.Random(seed)
    topology = parse_topology(INTEREST_TOML)
    table = Interests(topology, "a", linger_ms=400)
    kept, fresh = LinkManager(topology, "a", stall_ms=500), NoCache(topology, "a", stall_ms=500)
    ticked = [0]  # the table's time: what it answers changes when it ticks (the node's tick, every 0.2 s)
    for m in (kept, fresh):
        m.interest = lambda topic: table.wants(topic, ticked[0])
    now, names = 0, ["t0"]
    for m in (kept, fresh):
        m.topic("t0", 1)
    for _ in range(400):
        op = rng.random()
        if op < 0.15:
            name = rng.choice(["t1", "t2", "t3", "t7", "t1/x", "t1/y", "z/x", "t2/q", f"n{len(names)}"])
            names.append(name)
            count = max(1, kept.partitions.get(name, 0) + rng.randint(0, 2))  # created, grown, or the same again
            for m in (kept, fresh):
                m.topic(name, count)
        elif op < 0.7:
            ticked[0] = now
            if change_interests(table, rng, now):
                kept.interests_changed(table.take_changed())
        else:
            src = rng.choice(["b", "c"])
            for m in (kept, fresh):
                (m.link_up if op < 0.85 else m.link_down)(src, now)
        now += rng.randint(0, 200)
        assert kept.wants("b") == fresh.wants("b") and kept.wants("c") == fresh.wants("c"), (seed, now)
