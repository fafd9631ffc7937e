"""Consumer groups: the range and sticky assignors, and the GroupCoordinator's generations and fencing.

What a user relies on: every partition a group subscribes to is read by
exactly one member; a rebalance moves as few partitions as it can (sticky);
and a member that lost a partition (its session expired, or the group
rebalanced) can never commit it, so the new owner starts at the last accepted
commit.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from cluster.groups import (
    GroupCoordinator,
    IllegalGeneration,
    InvalidGroupRequest,
    NotAssigned,
    TopicPartition,
    UnknownMember,
    range_assign,
    sticky_assign,
)
from tests.support.examples import examples

PROPERTY = settings(max_examples=examples(150), deadline=None)
TOPICS = ("t0", "t1", "t2")

member_names = st.lists(st.sampled_from([f"m{i}" for i in range(8)]), min_size=1, max_size=8, unique=True)
counts_st = st.fixed_dictionaries({t: st.integers(0, 12) for t in TOPICS})
subscriptions_st = st.lists(st.sets(st.sampled_from(TOPICS), min_size=1), min_size=1, max_size=8)


def _members(names: list[str], subs: list[set[str]]) -> dict[str, tuple[str, ...]]:
    return {m: tuple(sorted(subs[i % len(subs)])) for i, m in enumerate(names)}


def _check_exactly_once(
    members: dict[str, tuple[str, ...]], counts: dict[str, int], out: dict[str, tuple[TopicPartition, ...]]
) -> None:
    owners: dict[TopicPartition, str] = {}
    for m, tps in out.items():
        for tp in tps:
            assert tp not in owners, f"{tp} assigned to {owners[tp]} and {m}"
            assert tp[0] in members[m], f"{m} got {tp} without subscribing to {tp[0]}"
            assert 0 <= tp[1] < counts[tp[0]]
            owners[tp] = m
    subscribed = {(t, p) for topics in members.values() for t in topics for p in range(counts[t])}
    assert set(owners) == subscribed
    assert set(out) == set(members)


@PROPERTY
@given(member_names, subscriptions_st, counts_st)
def test_range_assigns_every_subscribed_partition_exactly_once(
    names: list[str], subs: list[set[str]], counts: dict[str, int]
) -> None:
    members = _members(names, subs)
    _check_exactly_once(members, counts, range_assign(members, counts))


@PROPERTY
@given(member_names, subscriptions_st, counts_st)
def test_sticky_assigns_every_subscribed_partition_exactly_once(
    names: list[str], subs: list[set[str]], counts: dict[str, int]
) -> None:
    members = _members(names, subs)
    previous = sticky_assign(_members(names[::-1], subs[::-1]), counts, {})  # some unrelated earlier state
    _check_exactly_once(members, counts, sticky_assign(members, counts, previous))


def test_range_matches_kafkas_range_assignor() -> None:
    # The example of Kafka's RangeAssignor Javadoc: two consumers, two topics of three partitions.
    out = range_assign({"C0": ("t0", "t1"), "C1": ("t0", "t1")}, {"t0": 3, "t1": 3})
    assert out == {"C0": (("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1)), "C1": (("t0", 2), ("t1", 2))}
    # Per topic, over that topic's subscribers sorted by member id; the first ones take the extras.
    out = range_assign({"c": ("t0",), "a": ("t0", "t1"), "b": ("t1",)}, {"t0": 5, "t1": 2})
    assert out == {"a": (("t0", 0), ("t0", 1), ("t0", 2), ("t1", 0)), "b": (("t1", 1),), "c": (("t0", 3), ("t0", 4))}
    assert range_assign({"a": ("t0",), "b": ("t0",), "c": ("t0",)}, {"t0": 2}) == {
        "a": (("t0", 0),),
        "b": (("t0", 1),),
        "c": (),
    }


def _same_topics(names: list[str], topics: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {m: topics for m in names}


@PROPERTY
@given(member_names, st.sets(st.sampled_from(TOPICS), min_size=1), counts_st, member_names)
def test_sticky_is_balanced_within_one_when_everyone_subscribes_alike(
    names: list[str], topics: set[str], counts: dict[str, int], earlier: list[str]
) -> None:
    subs = tuple(sorted(topics))
    previous = sticky_assign(_same_topics(earlier, subs), counts, {})
    out = sticky_assign(_same_topics(names, subs), counts, previous)
    loads = [len(tps) for tps in out.values()]
    assert max(loads) - min(loads) <= 1


@PROPERTY
@given(
    st.lists(st.sampled_from([f"m{i}" for i in range(8)]), min_size=2, max_size=8, unique=True),
    st.sets(st.sampled_from(TOPICS), min_size=1),
    counts_st,
    st.data(),
)
def test_sticky_moves_only_the_partitions_it_must(
    names: list[str], topics: set[str], counts: dict[str, int], data: st.DataObject
) -> None:
    subs = tuple(sorted(topics))
    every = sum(counts[t] for t in subs)
    before = sticky_assign(_same_topics(names, subs), counts, {})
    # A member leaves: the survivors keep everything they had.
    gone = data.draw(st.sampled_from(names))
    survivors = [m for m in names if m != gone]
    after = sticky_assign(_same_topics(survivors, subs), counts, before)
    for m in survivors:
        assert set(before[m]) <= set(after[m]), f"{m} lost partitions although only {gone} left"
    # A member joins: at most ceil(P/M) partitions change owner.
    joined = [*names, "new"]
    grown = sticky_assign(_same_topics(joined, subs), counts, before)
    moved = sum(len(set(before[m]) - set(grown[m])) for m in names)
    assert moved <= -(-every // len(joined))
    assert len(grown["new"]) == moved


# -- the coordinator ------------------------------------------------------------------------


class _Ids:
    def __init__(self) -> None:
        self.n = itertools.count(1)

    def __call__(self, client_id: str) -> str:
        return f"{client_id or 'member'}-{next(self.n)}"


def _coordinator(counts: dict[str, int]) -> GroupCoordinator:
    return GroupCoordinator(lambda t: counts.get(t, 0), _Ids())


def test_join_expire_and_fencing() -> None:
    counts = {"t": 4}
    gc = _coordinator(counts)
    a = gc.heartbeat("g", "", ["t"], 3_000, "range", now_ms=0)
    assert a.generation == 1 and a.assignment == tuple(("t", p) for p in range(4))
    assert a.heartbeat_interval_ms == 1_000
    b = gc.heartbeat("g", "", ["t"], 10_000, "range", now_ms=100)
    assert b.generation == 2
    a = gc.heartbeat("g", a.member_id, ["t"], 3_000, "range", now_ms=200)
    assert a.generation == 2 and a.assignment == (("t", 0), ("t", 1))
    gc.check_commit("g", a.member_id, 2, [("t", 0)])
    with pytest.raises(NotAssigned, match="t/2"):
        gc.check_commit("g", a.member_id, 2, [("t", 2)])
    with pytest.raises(IllegalGeneration, match="generation 2"):
        gc.check_commit("g", a.member_id, 1, [("t", 0)])
    # a stops heartbeating; b goes on. After a's session timeout, a is gone and b owns everything.
    gc.heartbeat("g", b.member_id, ["t"], 10_000, "range", now_ms=3_000)
    assert gc.expire(3_200) == []  # 3000 ms since a's last heartbeat: not yet past its timeout
    assert gc.expire(3_201) == [("g", a.member_id)]
    with pytest.raises(UnknownMember, match="session expired"):
        gc.check_commit("g", a.member_id, 2, [("t", 0)])
    with pytest.raises(UnknownMember, match="rejoin"):
        gc.heartbeat("g", a.member_id, ["t"], 3_000, "range", now_ms=3_300)
    b = gc.heartbeat("g", b.member_id, ["t"], 10_000, "range", now_ms=3_300)
    assert b.generation == 3 and len(b.assignment) == 4
    gc.check_commit("g", b.member_id, 3, [("t", 0), ("t", 3)])


def test_standalone_commits_only_while_the_group_is_empty() -> None:
    gc = _coordinator({"t": 2})
    gc.check_commit("g", "", -1, [("t", 0)])  # no such group yet
    with pytest.raises(InvalidGroupRequest, match="generation -1"):
        gc.check_commit("g", "", 0, [("t", 0)])
    m = gc.heartbeat("g", "", ["t"], 3_000, "sticky", now_ms=0)
    with pytest.raises(UnknownMember, match="active member"):
        gc.check_commit("g", "", -1, [("t", 0)])
    gc.leave("g", m.member_id)
    gc.check_commit("g", "", -1, [("t", 0)])
    with pytest.raises(UnknownMember, match="nothing to leave"):
        gc.leave("g", m.member_id)


def test_join_requests_are_validated() -> None:
    gc = _coordinator({"t": 2})
    with pytest.raises(InvalidGroupRequest, match="no topic"):
        gc.heartbeat("g", "", [], 3_000, "range", now_ms=0)
    with pytest.raises(InvalidGroupRequest, match="unknown assignor 'roundrobin'"):
        gc.heartbeat("g", "", ["t"], 3_000, "roundrobin", now_ms=0)
    with pytest.raises(InvalidGroupRequest, match="session_timeout_ms=999"):
        gc.heartbeat("g", "", ["t"], 999, "range", now_ms=0)
    gc.heartbeat("g", "", ["t"], 3_000, "range", now_ms=0)
    with pytest.raises(InvalidGroupRequest, match="uses the range assignor"):
        gc.heartbeat("g", "", ["t"], 3_000, "sticky", now_ms=0)
    assert len(gc.groups["g"].members) == 1


def test_a_partition_count_change_rebalances() -> None:
    counts = {"t": 2}
    gc = _coordinator(counts)
    a = gc.heartbeat("g", "", ["t"], 3_000, "sticky", now_ms=0)
    b = gc.heartbeat("g", "", ["t"], 3_000, "sticky", now_ms=0)
    a = gc.heartbeat("g", a.member_id, ["t"], 3_000, "sticky", now_ms=10)
    assert (a.generation, len(a.assignment), len(b.assignment)) == (2, 1, 1)
    counts["t"] = 6
    a = gc.heartbeat("g", a.member_id, ["t"], 3_000, "sticky", now_ms=20)
    assert a.generation == 3 and len(a.assignment) == 3
    with pytest.raises(IllegalGeneration):
        gc.check_commit("g", b.member_id, 2, [b.assignment[0]])
    counts["t"] = 8  # noticed by the expiry timer too, even with no heartbeat
    assert gc.expire(30) == []
    assert gc.groups["g"].generation == 4


# -- a model-based test of the coordinator ----------------------------------------------------


class CoordinatorMachine(RuleBasedStateMachine):
    """Members join, heartbeat, leave, go silent and commit while partition counts change.

    Invariants: at the current generation no partition has two owners and every subscribed
    partition has one; a commit is accepted exactly when the model says it should be; a member
    that left or expired is fenced for good.
    """

    members = Bundle("members")

    @initialize(assignor=st.sampled_from(["range", "sticky"]))
    def start(self, assignor: str) -> None:
        self.assignor = assignor
        self.counts = {"t0": 3, "t1": 2}
        self.gc = _coordinator(self.counts)
        self.now = 0
        self.live: dict[str, tuple[int, tuple[str, ...]]] = {}  # member -> (last heartbeat, topics)
        self.seen_generation: dict[str, int] = {}  # the generation each member last heard
        self.fenced: set[str] = set()
        self.generation = 0
        self.timeout = 2_000

    def _heard(self, member: str, generation: int) -> None:
        self.seen_generation[member] = generation
        self.generation = generation

    @rule(target=members, topics=st.sets(st.sampled_from(["t0", "t1"]), min_size=1))
    def join(self, topics: set[str]) -> str:
        before = self.gc.groups["g"].generation if "g" in self.gc.groups else 0
        hb = self.gc.heartbeat("g", "", topics, self.timeout, self.assignor, self.now)
        assert hb.generation == before + 1
        self.live[hb.member_id] = (self.now, tuple(sorted(topics)))
        self._heard(hb.member_id, hb.generation)
        return hb.member_id

    @rule(member=members)
    def heartbeat(self, member: str) -> None:
        if member in self.fenced:
            with pytest.raises(UnknownMember):
                self.gc.heartbeat("g", member, ["t0"], self.timeout, self.assignor, self.now)
            return
        topics = self.live[member][1]
        hb = self.gc.heartbeat("g", member, topics, self.timeout, self.assignor, self.now)
        self.live[member] = (self.now, topics)
        self._heard(member, hb.generation)

    @rule(member=consumes(members))
    def leave(self, member: str) -> None:
        if member in self.fenced:
            return
        self.gc.leave("g", member)
        del self.live[member]
        self.fenced.add(member)

    @rule(ms=st.integers(1, 1_500))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        gone = self.gc.expire(self.now)
        expected = sorted(m for m, (last, _t) in self.live.items() if self.now - last > self.timeout)
        assert sorted(m for _g, m in gone) == expected
        for m in expected:
            del self.live[m]
            self.fenced.add(m)

    @rule(topic=st.sampled_from(["t0", "t1"]), n=st.integers(0, 6))
    def repartition(self, topic: str, n: int) -> None:
        self.counts[topic] = n

    @rule(member=members, partition=st.integers(0, 5), topic=st.sampled_from(["t0", "t1"]), stale=st.booleans())
    def commit(self, member: str, partition: int, topic: str, stale: bool) -> None:
        generation = self.seen_generation[member] - (1 if stale else 0)
        g = self.gc.groups["g"]
        if member in self.fenced:
            with pytest.raises(UnknownMember):
                self.gc.check_commit("g", member, generation, [(topic, partition)])
        elif generation != g.generation:
            with pytest.raises(IllegalGeneration):
                self.gc.check_commit("g", member, generation, [(topic, partition)])
        elif (topic, partition) not in g.members[member].assignment:
            with pytest.raises(NotAssigned):
                self.gc.check_commit("g", member, generation, [(topic, partition)])
        else:
            self.gc.check_commit("g", member, generation, [(topic, partition)])

    @invariant()
    def one_owner_per_partition(self) -> None:
        g = self.gc.groups.get("g")
        if g is None:
            return
        assert sorted(g.members) == sorted(self.live)
        subs = {m: member.topics for m, member in g.members.items()}
        _check_exactly_once(subs, g.partition_counts, {m: member.assignment for m, member in g.members.items()})


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
