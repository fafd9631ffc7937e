"""HLC stamps, the commit record codec, the latest-wins CommitTable and the HeldTable.

What a user relies on: a consumer's committed position is the same at every
site once the commits have spread (whatever order they arrived in), and it
never moves backwards because an older commit arrived late, even when the
consumer committed at sites whose clocks disagree.
"""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offsets.commits import (
    GROUP_NAME_MAX_CHARS,
    OFFSETS_PARTITIONS,
    Commit,
    CommitTable,
    InvalidCommit,
    offsets_partition,
    validate_group,
)
from offsets.coordinates import Origin
from offsets.held import HeldTable
from offsets.hlc import LOGICAL_BITS, LOGICAL_MAX, HlcStamp, HybridClock, pack, unpack
from offsets.vector import VectorOffset
from tests.support.examples import examples
from topology.ids import SiteId

PROPERTY = settings(max_examples=examples(150), deadline=None)

A1 = Origin(SiteId("a"), 1)
B3 = Origin(SiteId("b"), 3)
WALL = 1_700_000_000_000

# -- HLC ------------------------------------------------------------------------------

walls = st.integers(0, 2**40)
# ("now", wall, after) or ("observe", stamp, 0)
clock_ops = st.lists(
    st.one_of(
        st.tuples(st.just("now"), walls, st.integers(0, 2**50)),
        st.tuples(st.just("observe"), st.integers(0, 2**50), st.just(0)),
    ),
    max_size=60,
)


@PROPERTY
@given(clock_ops)
def test_stamps_strictly_increase_whatever_the_wall_clock_does(ops: list[tuple[str, int, int]]) -> None:
    clock = HybridClock()
    seen = 0  # the largest stamp issued or observed so far
    for op, x, after in ops:
        if op == "observe":
            clock.observe(x)
            seen = max(seen, x)
            continue
        stamp = clock.now(x, after=after)
        assert stamp > seen and stamp > after
        if x > unpack(max(seen, after))[0]:
            assert stamp == pack(x, 0)  # a leading wall clock is taken as is
        seen = stamp
        assert clock.last == stamp


def test_now_after_a_stamp_from_a_clock_far_ahead() -> None:
    ahead = HybridClock().now(WALL + 30_000)
    behind = HybridClock()
    stamp = behind.now(WALL, after=ahead)
    assert stamp > ahead and unpack(stamp) == (WALL + 30_000, 1)


@PROPERTY
@given(st.integers(0, 2**47 - 1), st.integers(0, LOGICAL_MAX))
def test_pack_unpack_round_trip(wall: int, logical: int) -> None:
    assert unpack(pack(wall, logical)) == (wall, logical)
    assert pack(wall, logical) >> LOGICAL_BITS == wall


@pytest.mark.parametrize(("wall", "logical"), [(-1, 0), (0, -1), (0, LOGICAL_MAX + 1), (2**47, 0)])
def test_pack_rejects_what_does_not_fit_an_int64(wall: int, logical: int) -> None:
    with pytest.raises(ValueError, match="HLC"):
        pack(wall, logical)


def test_logical_overflow_borrows_the_next_millisecond() -> None:
    clock = HybridClock(pack(WALL, LOGICAL_MAX - 1))
    assert clock.now(WALL) == pack(WALL, LOGICAL_MAX)
    assert clock.now(WALL) == pack(WALL + 1, 0)  # the wall clock stalled: borrow a millisecond
    assert clock.now(WALL - 5) == pack(WALL + 1, 1)  # and stay ahead when it steps back
    assert clock.now(WALL + 2) == pack(WALL + 2, 0)


def test_observe_never_moves_the_clock_back() -> None:
    clock = HybridClock()
    clock.observe(pack(WALL, 7))
    clock.observe(pack(WALL - 1, 9))
    assert clock.last == pack(WALL, 7)
    assert clock.now(WALL) == pack(WALL, 8)


# -- the commit record --------------------------------------------------------------------

origins = st.builds(Origin, site=st.sampled_from([SiteId(s) for s in ("a", "b", "us-east")]), epoch=st.integers(0, 9))
vectors = st.dictionaries(origins, st.integers(0, 2**63 - 1), max_size=4).map(VectorOffset)
groups = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40).filter(
    lambda g: g.isprintable()
)
topics = st.from_regex(r"[A-Za-z0-9._-]{1,10}(/[A-Za-z0-9._-]{1,10}){0,2}", fullmatch=True)
stamps = st.integers(0, 2**63 - 1).map(HlcStamp)
commits = st.builds(
    Commit,
    group=groups,
    topic=topics,
    partition=st.integers(0, 1_000),
    vector=vectors,
    hlc=stamps,
    committed_by=origins,
    hint_offset=st.integers(-1, 2**40),
    member_id=st.text(max_size=20),
    generation=st.integers(-1, 2**31),
    committed_at_ms=st.integers(0, 2**45),
    metadata=st.text(max_size=50),
)


@PROPERTY
@given(commits)
def test_commit_codec_round_trip(commit: Commit) -> None:
    assert Commit.decode(commit.value()) == commit
    group, topic, partition = commit.key().decode().split("\x00")
    assert (group, topic, int(partition)) == (commit.group, commit.topic, commit.partition)


def test_commit_value_is_readable_json() -> None:
    commit = Commit("billing-ü", "orders/eu", 1, VectorOffset({A1: 10, B3: 7}), pack(WALL, 2), A1)
    assert commit.value().decode() == (
        f'{{"g":"billing-ü","t":"orders/eu","p":1,"v":"a@1:10,b@3:7","h":{pack(WALL, 2)},"by":"a@1",'
        '"ho":-1,"m":"","gen":-1,"at":0,"md":""}'
    )


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xff\xfe",
        b"null",
        b"[]",
        b'"text"',
        b"5",
        b"{}",
        b'{"g":"x"}',
        b'{"g":"x","t":"t","p":"one","v":"","h":1,"by":"a@1"}',
        b'{"g":"x","t":"t","p":0,"v":"nope","h":1,"by":"a@1"}',
        b'{"g":"x","t":"t","p":0,"v":"","h":1,"by":"A@1"}',
        b'{"g":"x","t":"t","p":0,"v":"","h":1,"by":"a@1","gen":{}}',
        b'{"g":"x","t":"t","p":1e400,"v":"","h":1,"by":"a@1"}',
        b'{"g":"x","t":"t","p":0,"v":"","h":Infinity,"by":"a@1"}',
        b"[" * 100_000,
    ],
)
def test_garbage_is_an_invalid_commit(garbage: bytes) -> None:
    with pytest.raises(InvalidCommit, match="not a commit record"):
        Commit.decode(garbage)


@PROPERTY
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_invalid_commit(data: bytes) -> None:
    with contextlib.suppress(InvalidCommit):
        Commit.decode(data)


def test_validate_group() -> None:
    assert validate_group("billing") == "billing"
    assert validate_group("é-groupe 1") == "é-groupe 1"
    assert validate_group("g" * GROUP_NAME_MAX_CHARS)
    for bad, why in [
        ("", "empty"),
        ("g" * (GROUP_NAME_MAX_CHARS + 1), "limit"),
        ("a\x00b", "control"),
        ("tab\there", "control"),
        ("new\nline", "control"),
    ]:
        with pytest.raises(InvalidCommit, match=why):
            validate_group(bad)


@PROPERTY
@given(groups)
def test_a_group_always_maps_to_one_internal_partition(group: str) -> None:
    p = offsets_partition(group)
    assert 0 <= p < OFFSETS_PARTITIONS and offsets_partition(group) == p


# -- the commit table ----------------------------------------------------------------------

small_commits = st.builds(
    Commit,
    group=st.sampled_from(["g", "h"]),
    topic=st.just("t"),
    partition=st.integers(0, 1),
    vector=st.dictionaries(st.sampled_from([A1, B3]), st.integers(0, 5), max_size=2).map(VectorOffset),
    hlc=st.integers(0, 4).map(HlcStamp),  # few stamps, so ties happen
    committed_by=st.sampled_from([A1, B3]),
    member_id=st.sampled_from(["", "m1"]),
)


def _fold(items: list[Commit]) -> dict[tuple[str, str, int], Commit]:
    table = CommitTable()
    for c in items:
        table.apply(c)
    return table.latest


@PROPERTY
@given(st.lists(small_commits, max_size=12), st.randoms(use_true_random=False))
def test_every_delivery_order_gives_the_same_table(items: list[Commit], rnd: random.Random) -> None:
    """Sites receive the same commits in different orders (and some twice): they must agree."""
    first = _fold(items)
    shuffled = items + rnd.sample(items, k=len(items) // 2)
    rnd.shuffle(shuffled)
    assert _fold(shuffled) == first


def test_equal_stamps_from_one_site_still_pick_one_winner_everywhere() -> None:
    """Found by the property above: a site that restarts within one millisecond can issue the same
    stamp twice (its clock's last stamp is not durable); the winner must not depend on arrival order."""
    x = Commit("g", "t", 0, VectorOffset({A1: 3}), pack(WALL, 0), A1)
    y = Commit("g", "t", 0, VectorOffset({A1: 5}), pack(WALL, 0), A1)
    assert _fold([x, y]) == _fold([y, x])


@PROPERTY
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(-30_000, 30_000)), min_size=1, max_size=15),
    st.randoms(use_true_random=False),
)
def test_a_consumer_never_moves_backwards_whatever_the_delivery_order(
    hops: list[tuple[str, int]], rnd: random.Random
) -> None:
    """The consumer commits increasing vectors at sites with skewed clocks, each commit stamped
    ``now(wall, after=previous stamp)``; every prefix of any delivery order leaves the newest
    delivered commit on top."""
    skew = {"a": 0, "b": 25_000, "c": -25_000}
    clocks = {s: HybridClock() for s in skew}
    made: list[Commit] = []
    previous = 0
    for i, (site, jitter) in enumerate(hops):
        stamp = clocks[site].now(WALL + i + skew[site] + jitter // 1_000, after=previous)
        previous = stamp
        made.append(Commit("g", "t", 0, VectorOffset({A1: i + 1}), stamp, Origin(SiteId(site), 1)))
    order = made[:]
    rnd.shuffle(order)
    table = CommitTable()
    newest = -1
    for c in order:
        table.apply(c)
        newest = max(newest, made.index(c))
        winner = table.get("g", "t", 0)
        assert winner is not None and winner == made[newest]
    assert table.get("g", "t", 0) == made[-1]


def test_commit_table_lookups() -> None:
    table = CommitTable()
    old = Commit("g", "t", 0, VectorOffset({A1: 1}), pack(WALL, 0), A1)
    new = Commit("g", "t", 0, VectorOffset({A1: 2}), pack(WALL, 0), B3)  # same stamp: site b wins the tie
    assert table.apply(old) and table.apply(new) and not table.apply(old)
    assert table.apply(Commit("f", "t", 1, VectorOffset(), pack(WALL, 0), A1))
    assert table.get("g", "t", 0) == new and table.get("g", "t", 1) is None
    assert table.groups() == ["f", "g"]
    assert [c.partition for c in table.of_group("g")] == [0]


# -- the held table -----------------------------------------------------------------------


def test_held_table_only_grows_and_reports_what_changed() -> None:
    held = HeldTable()
    assert held.update("b", "t", 0, VectorOffset({A1: 5}))
    v1 = held.version
    assert not held.update("b", "t", 0, VectorOffset({A1: 3}))  # older news: nothing learned
    assert held.entries[("b", "t", 0)] == VectorOffset({A1: 5})
    assert held.version == v1
    assert held.update("c", "t", 0, VectorOffset({A1: 2, B3: 1}))
    assert held.update("b", "t", 0, VectorOffset({B3: 4}))  # merged, not replaced
    assert held.entries[("b", "t", 0)] == VectorOffset({A1: 5, B3: 4})
    assert [k for k, _v in held.changed_since(v1)] == [("b", "t", 0), ("c", "t", 0)]
    assert [k for k, _v in held.changed_since(held.version)] == []
    assert held.sites_holding("t", 0, A1, 4) == ["b"]
    assert held.sites_holding("t", 0, A1, 1) == ["b", "c"]
    assert held.sites_holding("t", 0, B3, 3) == ["b"]
    assert held.sites_holding("t", 1, A1, 0) == []


held_updates = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 1),
        st.dictionaries(st.sampled_from([A1, B3]), st.integers(0, 9), max_size=2).map(VectorOffset),
    ),
    max_size=20,
)


@PROPERTY
@given(held_updates, st.randoms(use_true_random=False))
def test_held_table_is_a_merge_of_everything_reported(
    updates: list[tuple[str, int, VectorOffset]], rnd: random.Random
) -> None:
    """Reports arrive in any order and some twice; the table is their pointwise max, and an
    incremental reporter that sends ``changed_since(last)`` reproduces it."""
    held, mirror = HeldTable(), HeldTable()
    sent = 0
    for site, p, v in updates:
        held.update(site, "t", p, v)
        if rnd.random() < 0.5:
            for (s, t, q), vector in held.changed_since(sent):
                mirror.update(s, t, q, vector)
            sent = held.version
    for (s, t, q), vector in held.changed_since(sent):
        mirror.update(s, t, q, vector)
    expected: dict[tuple[str, str, int], VectorOffset] = {}
    for site, p, v in updates:
        key = (site, "t", p)
        expected[key] = expected.get(key, VectorOffset()).merge(v)
    assert held.entries == expected
    assert mirror.entries == expected
    shuffled = updates[:]
    rnd.shuffle(shuffled)
    other = HeldTable()
    for site, p, v in shuffled:
        other.update(site, "t", p, v)
    assert other.entries == expected
