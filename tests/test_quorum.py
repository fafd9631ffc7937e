"""The write quorum inside a site (cluster/quorum.py) and ``acks=all`` at that quorum (georep/broker/acks.py).

What a user relies on: an ``acks=all`` write is acknowledged only once ``min_insync_replicas`` nodes hold it
fsynced, so it survives the loss of a node; an ``acks=geo:N`` write needs that and N sites; other sites are only
told this site holds what its quorum holds; and a deposed leader can never add to a member's log. First each rule,
then properties against a naive reference over explicit member logs, then a state machine that drives the ack
table with leader, all and geo waiters while members stream, fsync, ack out of order, crash and come back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.quorum import (
    AckOutOfRange,
    AppendWentBack,
    Fenced,
    GuardState,
    InvalidEnsemble,
    LacAdvanced,
    Lagging,
    NotAMember,
    NotContiguous,
    QuorumEffect,
    QuorumError,
    QuorumLost,
    QuorumRegained,
    ReplicaGuard,
    SegmentQuorum,
    SegmentSealed,
)
from georep.broker import errors
from georep.broker.acks import AckKind, Acks, AckTable, Effect, Fail, HeldChanged, Release, StartFlush
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from tests.support.examples import examples
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

N1, N2, N3, N4 = NodeId(1), NodeId(2), NodeId(3), NodeId(4)
SEG = SegmentId(0)
EPOCH = LeaderEpoch(1)
A = Origin(SiteId("a"), 1)
B = Origin(SiteId("b"), 1)
KEY = ("t", 0)
ALL = Acks(AckKind.ALL)


def quorum(
    ack_quorum: int = 2, base_offset: int = 0, ensemble: tuple[NodeId, ...] = (N1, N2, N3), leader: NodeId = N1
) -> SegmentQuorum:
    return SegmentQuorum(SEG, base_offset, ensemble, ack_quorum, EPOCH, leader)


def reference_lac(ends: list[int], ack_quorum: int) -> int:
    """The naive definition: member ends sorted from the largest, the ack_quorum-th one."""
    return sorted(ends, reverse=True)[ack_quorum - 1]


# -- SegmentQuorum: the rules one by one ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ensemble", "ack_quorum", "leader", "match"),
    [
        ((), 1, N1, "ensemble is empty"),
        ((N1, N2, N2), 2, N1, r"node\(s\) \[2\] more than once"),
        ((N1, N2, N3), 0, N1, "ack quorum 0 is not between 1 and the ensemble size 3"),
        ((N1, N2, N3), 4, N1, "ack quorum 4 is not between 1 and the ensemble size 3"),
        ((N1, N2, N3), 2, N4, "leader 4 is not in ensemble"),
    ],
)
def test_an_ensemble_that_cannot_work_is_refused(
    ensemble: tuple[NodeId, ...], ack_quorum: int, leader: NodeId, match: str
) -> None:
    with pytest.raises(InvalidEnsemble, match=match):
        SegmentQuorum(SEG, 0, ensemble, ack_quorum, EPOCH, leader)


def test_the_lac_is_the_end_that_ack_quorum_members_hold_not_the_furthest_one() -> None:
    q = quorum(ack_quorum=2, base_offset=100)
    assert q.lac == 100  # nothing confirmed yet: the segment's base
    q.appended(110)
    assert q.member_acked(N1, 110) == []  # the leader's own fsync is one member of two
    assert q.member_acked(N3, 104) == [LacAdvanced(104)]
    assert q.member_acked(N2, 108) == [LacAdvanced(108)]
    assert q.lac == 108
    assert q.member_acked(N3, 110) == [LacAdvanced(110)]


def test_with_ack_quorum_equal_to_the_ensemble_every_member_must_hold_it() -> None:
    q = quorum(ack_quorum=3)
    q.appended(10)
    assert q.member_acked(N1, 10) == [] and q.member_acked(N2, 10) == []
    assert q.member_acked(N3, 7) == [LacAdvanced(7)]


def test_an_ensemble_of_one_confirms_at_the_leaders_own_fsync() -> None:
    q = quorum(ack_quorum=1, ensemble=(N1,))
    q.appended(5)
    assert q.member_acked(N1, 5) == [LacAdvanced(5)]


def test_stale_acks_change_nothing_and_the_lac_never_moves_back() -> None:
    q = quorum()
    q.appended(10)
    q.member_acked(N1, 10)
    q.member_acked(N2, 8)
    assert q.member_acked(N2, 3) == []  # an older ack arriving late: the fsync it reported is still true
    assert q.member_end(N2) == 8 and q.lac == 8
    assert q.member_acked(N3, 2) == []  # a third member behind the quorum does not pull it back
    assert q.lac == 8


def test_reports_no_member_could_make_are_refused_and_change_nothing() -> None:
    q = quorum(base_offset=100)
    q.appended(110)
    with pytest.raises(NotAMember, match="node 4, which is not in the ensemble"):
        q.member_acked(N4, 105)
    with pytest.raises(AckOutOfRange, match=r"up to offset 111, but .* leader appended up to 110"):
        q.member_acked(N2, 111)
    with pytest.raises(AckOutOfRange, match="segment starts at 100"):
        q.member_acked(N2, 99)
    with pytest.raises(NotAMember):
        q.member_failed(N4)
    assert [q.member_end(n) for n in (N1, N2, N3)] == [100, 100, 100] and q.lac == 100
    assert issubclass(NotAMember, QuorumError) and issubclass(AckOutOfRange, QuorumError)


def test_the_appended_end_never_goes_back() -> None:
    q = quorum()
    q.appended(10)
    q.appended(10)  # the same end again is fine
    with pytest.raises(AppendWentBack, match="below 10"):
        q.appended(9)
    assert q.appended_end == 10


def test_a_failed_member_keeps_what_it_acked_and_the_leader_learns_when_the_quorum_is_out_of_reach() -> None:
    q = quorum(ack_quorum=2)
    q.appended(10)
    q.member_acked(N1, 10)
    q.member_acked(N2, 6)
    assert q.member_failed(N2) == [] and q.can_reach_quorum  # leader and N3 are still two
    assert q.lac == 6  # N2's fsync happened: it still counts
    [lost] = q.member_failed(N3)
    assert lost == QuorumLost(SEG, (N1,), 2, 6) and not q.can_reach_quorum
    assert "1 live member(s) (1) but needs 2" in lost.message() and "LAC stays at 6" in lost.message()
    assert q.member_failed(N3) == []  # told once
    assert q.failed_members() == (N2, N3)
    assert q.member_reconnected(N2) == [QuorumRegained(SEG)] and q.can_reach_quorum
    assert q.member_reconnected(N2) == []


def test_lagging_lists_the_live_followers_behind_the_appended_end_and_where_to_resend_from() -> None:
    q = quorum(ensemble=(N1, N2, N3, N4), ack_quorum=2)
    q.appended(10)
    q.member_acked(N3, 10)
    q.member_acked(N4, 4)
    q.member_failed(N2)  # no stream to resend on
    assert q.lagging() == [Lagging(N4, 4)]  # the leader (N1) is never listed: its log is the source
    q.member_reconnected(N2)
    assert q.lagging() == [Lagging(N2, 0), Lagging(N4, 4)]


# -- ReplicaGuard: the rules one by one ----------------------------------------------------------------


def test_an_older_epoch_is_fenced_naming_both_epochs() -> None:
    guard = ReplicaGuard()
    guard.fence(LeaderEpoch(5))
    with pytest.raises(Fenced) as info:
        guard.check_append(LeaderEpoch(4), SEG, 0, 0)
    message = str(info.value)
    assert "leader epoch 4 is older than epoch 5" in message and "no longer the partition's leader" in message
    assert (info.value.sender_epoch, info.value.fenced_epoch) == (4, 5)


def test_a_newer_epoch_is_accepted_and_raises_the_fence() -> None:
    guard = ReplicaGuard(GuardState(LeaderEpoch(2)))
    assert guard.check_append(LeaderEpoch(3), SEG, 0, 0) is True  # persist before acking
    assert guard.fenced_epoch == 3
    assert guard.check_append(LeaderEpoch(3), SEG, 4, 4) is False  # same epoch: nothing new to persist
    with pytest.raises(Fenced):
        guard.check_append(LeaderEpoch(2), SEG, 8, 8)  # the leader it replaced is now fenced out


def test_a_fence_never_goes_back() -> None:
    guard = ReplicaGuard()
    guard.fence(LeaderEpoch(5))
    guard.fence(LeaderEpoch(5))  # a retried fence
    with pytest.raises(Fenced, match="leader epoch 4 is older than epoch 5"):
        guard.fence(LeaderEpoch(4))
    guard.fence(LeaderEpoch(7))
    assert guard.fenced_epoch == 7


@pytest.mark.parametrize("offset", [6, 14])
def test_an_append_must_start_at_the_members_local_end(offset: int) -> None:
    guard = ReplicaGuard()
    with pytest.raises(NotContiguous) as info:
        guard.check_append(EPOCH, SEG, offset, 10)
    assert f"offset {offset}" in str(info.value) and "must resend from offset 10" in str(info.value)
    assert (info.value.offset, info.value.local_end) == (offset, 10)


def test_sealed_segments_refuse_appends_and_a_seal_never_goes_back() -> None:
    guard = ReplicaGuard()
    guard.seal(EPOCH, SegmentId(2))
    for sealed in (SegmentId(1), SegmentId(2)):
        with pytest.raises(SegmentSealed, match=f"segment {sealed} is sealed"):
            guard.check_append(EPOCH, sealed, 10, 10)
    assert guard.check_append(EPOCH, SegmentId(3), 10, 10) is False
    guard.seal(EPOCH, SegmentId(1))  # an older seal is already implied
    assert guard.state == GuardState(EPOCH, SegmentId(2))
    with pytest.raises(Fenced):
        guard.seal(LeaderEpoch(0), SegmentId(3))
    guard.seal(LeaderEpoch(4), SegmentId(3))  # a newer leader's seal raises the fence too
    assert guard.state == GuardState(LeaderEpoch(4), SegmentId(3))


def test_a_refused_append_changes_nothing_and_the_epoch_is_checked_first() -> None:
    guard = ReplicaGuard(GuardState(LeaderEpoch(3), SegmentId(1)))
    before = guard.state
    with pytest.raises(NotContiguous):
        guard.check_append(LeaderEpoch(9), SegmentId(2), 5, 4)  # a newer epoch, but not contiguous
    with pytest.raises(SegmentSealed):
        guard.check_append(LeaderEpoch(9), SegmentId(1), 4, 4)
    with pytest.raises(Fenced):
        guard.check_append(LeaderEpoch(2), SegmentId(1), 5, 4)  # sealed and not contiguous, but fenced first
    assert guard.state == before


def test_the_guard_state_is_two_plain_numbers_that_restore_the_same_guard() -> None:
    guard = ReplicaGuard()
    guard.fence(LeaderEpoch(6))
    guard.seal(LeaderEpoch(6), SegmentId(3))
    saved = json.dumps(dataclasses.asdict(guard.state))
    restored = ReplicaGuard(GuardState(**json.loads(saved)))
    assert restored.state == guard.state
    with pytest.raises(Fenced):
        restored.check_append(LeaderEpoch(5), SegmentId(4), 0, 0)
    with pytest.raises(SegmentSealed):
        restored.check_append(LeaderEpoch(6), SegmentId(3), 0, 0)


# -- AckTable: acks=all at the quorum --------------------------------------------------------------------


def table(replicated_in_site: bool, fsync_per_batch: bool = True) -> AckTable:
    t = AckTable("a", A)
    t.open_partition(KEY, fsync_per_batch, 0, VectorOffset({}), replicated_in_site=replicated_in_site)
    return t


def test_on_a_single_node_site_acks_all_is_the_leader_promise() -> None:
    t = table(replicated_in_site=False)
    assert t.wait("w", KEY, 2, A, 1, ALL, now_ms=0) == [StartFlush(KEY)]
    assert t.flush_done(KEY, 2, VectorOffset({A: 2})) == [HeldChanged(), Release("w")]
    with pytest.raises(ValueError, match="not replicated in the site"):
        t.quorum_advanced(KEY, 2, VectorOffset({A: 2}))
    with pytest.raises(ValueError, match="pass replicated_in_site=True"):
        t.open_partition(("t", 1), True, 0, VectorOffset({}), lac=4)


def test_replicated_acks_all_waits_for_the_lac_and_its_own_fsync_in_either_order() -> None:
    t = table(replicated_in_site=True)
    assert t.wait("all", KEY, 2, A, 1, ALL, now_ms=0) == [StartFlush(KEY)]
    assert t.wait("leader", KEY, 2, A, 1, Acks(), now_ms=0) == []
    # the leader's fsync alone releases acks=leader, not acks=all, and tells no other site anything
    assert t.flush_done(KEY, 2, VectorOffset({A: 2})) == [Release("leader")]
    assert t.quorum_advanced(KEY, 2, VectorOffset({A: 2})) == [HeldChanged(), Release("all")]
    # the quorum first (two followers fsynced before the leader did): all still waits for the local fsync
    assert t.wait("all2", KEY, 4, A, 3, ALL, now_ms=0) == [StartFlush(KEY)]
    assert t.quorum_advanced(KEY, 4, VectorOffset({A: 4})) == [HeldChanged()]
    assert t.flush_done(KEY, 4, VectorOffset({A: 4})) == [Release("all2")]
    # already confirmed and fsynced: released at once
    assert t.wait("all3", KEY, 4, A, 3, ALL, now_ms=0) == [Release("all3")]


def test_without_fsync_per_batch_acks_all_still_waits_for_the_quorum() -> None:
    t = table(replicated_in_site=True, fsync_per_batch=False)
    assert t.wait("leader", KEY, 2, A, 1, Acks(), now_ms=0) == [Release("leader")]
    assert t.wait("all", KEY, 2, A, 1, ALL, now_ms=0) == []
    assert t.quorum_advanced(KEY, 2, VectorOffset({A: 2})) == [HeldChanged(), Release("all")]


def test_a_stale_lac_changes_nothing() -> None:
    t = table(replicated_in_site=True, fsync_per_batch=False)
    t.quorum_advanced(KEY, 4, VectorOffset({A: 4}))
    t.wait("all", KEY, 6, A, 5, ALL, now_ms=0)
    assert t.quorum_advanced(KEY, 2, VectorOffset({A: 2})) == []
    assert t.held.entries[("a", "t", 0)] == VectorOffset({A: 4})
    assert t.wait("confirmed", KEY, 4, A, 3, ALL, now_ms=0) == [Release("confirmed")]  # the LAC is still 4
    assert t.quorum_advanced(KEY, 6, VectorOffset({A: 6})) == [HeldChanged(), Release("all")]


def test_other_sites_are_told_only_what_the_quorum_holds() -> None:
    t = AckTable("a", A)
    t.open_partition(
        KEY, True, 8, VectorOffset({A: 8}), replicated_in_site=True, lac=5, lac_vector=VectorOffset({A: 5})
    )
    assert t.held.entries[("a", "t", 0)] == VectorOffset({A: 5})  # not the 8 this node flushed
    t.wait("w", KEY, 10, A, 9, Acks(), now_ms=0)
    t.flush_done(KEY, 10, VectorOffset({A: 10}))
    assert t.held.entries[("a", "t", 0)] == VectorOffset({A: 5})
    assert t.held.sites_holding("t", 0, A, 7) == []
    t.quorum_advanced(KEY, 10, VectorOffset({A: 10}))
    assert t.held.sites_holding("t", 0, A, 9) == ["a"]


def test_geo_needs_this_sites_quorum_as_well_as_n_sites() -> None:
    t = table(replicated_in_site=True, fsync_per_batch=False)
    assert t.wait("geo1", KEY, 2, A, 1, Acks.geo(1), now_ms=0) == []  # geo:1 is this site's quorum
    assert t.wait("geo2", KEY, 2, A, 1, Acks.geo(2), now_ms=0) == []
    # two other sites hold it (say, through another path after a failover), but this site's quorum does not yet
    assert t.held_reported([("b", "t", 0, VectorOffset({A: 2})), ("c", "t", 0, VectorOffset({A: 2}))]) == [
        HeldChanged()
    ]
    assert t.quorum_advanced(KEY, 2, VectorOffset({A: 2})) == [HeldChanged(), Release("geo1"), Release("geo2")]


def test_a_geo_timeout_says_when_this_sites_quorum_is_what_is_missing() -> None:
    t = table(replicated_in_site=True)
    t.wait("w", KEY, 2, A, 1, Acks.geo(2), now_ms=0, timeout_ms=100)
    t.flush_done(KEY, 2, VectorOffset({A: 2}))
    t.held_reported([("b", "t", 0, VectorOffset({A: 2}))])
    [fail] = t.tick(100)
    assert isinstance(fail, Fail) and isinstance(fail.error, errors.GeoAckTimeout)
    assert "1 site(s) (b)" in str(fail.error)
    assert "ack quorum has not confirmed it yet (last add confirmed 0, batch ends at 2)" in str(fail.error)


# -- properties against the naive reference ----------------------------------------------------------------


@st.composite
def ensembles(draw: st.DrawFn) -> tuple[tuple[NodeId, ...], int]:
    size = draw(st.integers(1, 5))
    return tuple(NodeId(n) for n in range(1, size + 1)), draw(st.integers(1, size))


QUORUM_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 4), st.just(0)),
        st.tuples(st.just("ack"), st.integers(0, 4), st.integers(0, 1_000)),
    ),
    max_size=60,
)
PROPERTY = settings(max_examples=examples(300), deadline=None)


@PROPERTY
@given(ensembles(), st.integers(0, 50), QUORUM_OPS)
def test_the_lac_is_the_ack_quorum_th_largest_member_end(
    shape: tuple[tuple[NodeId, ...], int], base: int, ops: list[tuple[str, int, int]]
) -> None:
    ensemble, ack_quorum = shape
    q = SegmentQuorum(SEG, base, ensemble, ack_quorum, EPOCH, ensemble[0])
    ends = dict.fromkeys(ensemble, base)  # the reference: each member's furthest report
    appended = base
    for op, a, b in ops:
        before = q.lac
        effects: list[QuorumEffect] = []
        if op == "append":
            appended += a
            q.appended(appended)
        else:
            node = ensemble[a % len(ensemble)]
            end = base + b % (appended - base + 1)
            effects = q.member_acked(node, end)
            ends[node] = max(ends[node], end)
        expected = reference_lac(list(ends.values()), ack_quorum)
        assert q.lac == expected
        assert effects == ([LacAdvanced(expected)] if expected != before else [])


@PROPERTY
@given(ensembles(), st.data())
def test_the_lac_never_moves_back_whatever_order_the_acks_arrive_in(
    shape: tuple[tuple[NodeId, ...], int], data: st.DataObject
) -> None:
    ensemble, ack_quorum = shape
    q = SegmentQuorum(SEG, 0, ensemble, ack_quorum, EPOCH, ensemble[0])
    q.appended(20)
    # each member acks an increasing run of ends, as its fsyncs happen; the network delivers them in any order
    sent = [(node, end) for node in ensemble for end in sorted(data.draw(st.sets(st.integers(0, 20), max_size=5)))]
    arrival = data.draw(st.permutations(sent))
    lac = q.lac
    for node, end in arrival:
        q.member_acked(node, end)
        assert q.lac >= lac
        lac = q.lac
    furthest = [max((e for n, e in sent if n == node), default=0) for node in ensemble]
    assert q.lac == reference_lac(furthest, ack_quorum)


# -- an explicit model of member logs -----------------------------------------------------------------------


@dataclass
class Batch:
    base_offset: int
    end_offset: int
    origin: Origin
    last_seq: int


@dataclass
class Members:
    """A segment's ensemble with explicit logs: what each node has written and fsynced, the leader's stream to each
    follower, acks in flight (delivered in any order), and crashes that lose what a follower had not fsynced.
    The leader is ``ensemble[0]`` and never crashes here (a leader change is another state machine)."""

    ensemble: tuple[NodeId, ...]
    ack_quorum: int
    quorum: SegmentQuorum = field(init=False)
    batches: list[Batch] = field(default_factory=list)
    written_end: dict[NodeId, int] = field(init=False)
    fsynced_end: dict[NodeId, int] = field(init=False)
    send_offset: dict[NodeId, int] = field(init=False)  # where the leader's stream to each follower stands
    stream_up: dict[NodeId, bool] = field(init=False)
    in_flight: dict[NodeId, list[int]] = field(init=False)  # acks sent, not yet delivered
    acked_end: dict[NodeId, int] = field(init=False)  # the furthest fsynced end the leader has been told of
    guards: dict[NodeId, ReplicaGuard] = field(init=False)

    def __post_init__(self) -> None:
        self.quorum = SegmentQuorum(SEG, 0, self.ensemble, self.ack_quorum, EPOCH, self.leader)
        self.written_end = dict.fromkeys(self.ensemble, 0)
        self.fsynced_end = dict.fromkeys(self.ensemble, 0)
        self.send_offset = dict.fromkeys(self.ensemble, 0)
        self.stream_up = dict.fromkeys(self.ensemble, True)
        self.in_flight = {n: [] for n in self.ensemble}
        self.acked_end = dict.fromkeys(self.ensemble, 0)
        self.guards = {n: ReplicaGuard(GuardState(EPOCH)) for n in self.ensemble}

    @property
    def leader(self) -> NodeId:
        return self.ensemble[0]

    @property
    def followers(self) -> tuple[NodeId, ...]:
        return self.ensemble[1:]

    @property
    def end_offset(self) -> int:
        return self.written_end[self.leader]

    def holders(self, end_offset: int) -> int:
        """How many members hold everything below ``end_offset`` fsynced: the truth the LAC must not exceed."""
        return sum(1 for n in self.ensemble if self.fsynced_end[n] >= end_offset)

    def known_holders(self, end_offset: int) -> int:
        """How many members the leader knows (by its own fsync or a delivered ack) to hold ``end_offset``."""
        return sum(1 for n in self.ensemble if self.acked_end[n] >= end_offset)

    def durable_end(self) -> int:
        return reference_lac(list(self.fsynced_end.values()), self.ack_quorum)

    def vector_at(self, offset: int) -> VectorOffset:
        nxt: dict[Origin, int] = {}
        for b in self.batches:
            if b.end_offset <= offset:
                nxt[b.origin] = b.last_seq + 1
        return VectorOffset(nxt)

    def append(self, origin: Origin, records: int) -> Batch:
        base = self.end_offset
        last_seq = max((b.last_seq for b in self.batches if b.origin == origin), default=-1) + records
        batch = Batch(base, base + records, origin, last_seq)
        self.batches.append(batch)
        self.written_end[self.leader] = batch.end_offset
        self.quorum.appended(batch.end_offset)
        return batch

    def deliver(self, node: NodeId) -> None:
        """The next batch on the leader's stream reaches ``node``, which appends it if its guard agrees."""
        if not self.stream_up[node] or self.send_offset[node] >= self.end_offset:
            return
        [batch] = [b for b in self.batches if b.base_offset == self.send_offset[node]]
        try:
            self.guards[node].check_append(EPOCH, SEG, batch.base_offset, self.written_end[node])
        except NotContiguous as exc:
            self.send_offset[node] = exc.local_end
            return
        self.written_end[node] = self.send_offset[node] = batch.end_offset

    def deposed_leader_appends(self, node: NodeId) -> None:
        before = (self.guards[node].state, self.written_end[node])
        with pytest.raises(Fenced):
            self.guards[node].check_append(LeaderEpoch(EPOCH - 1), SEG, self.written_end[node], self.written_end[node])
        assert (self.guards[node].state, self.written_end[node]) == before

    def fsync(self, node: NodeId) -> list[QuorumEffect]:
        self.fsynced_end[node] = self.written_end[node]
        if node == self.leader:  # its own fsync is reported to the quorum directly
            self.acked_end[node] = max(self.acked_end[node], self.fsynced_end[node])
            return self.quorum.member_acked(node, self.fsynced_end[node])
        self.in_flight[node].append(self.fsynced_end[node])
        return []

    def ack_arrives(self, node: NodeId, pick: int) -> list[QuorumEffect]:
        acks = self.in_flight[node]
        if not acks:
            return []
        end = acks.pop(pick % len(acks))
        self.acked_end[node] = max(self.acked_end[node], end)
        return self.quorum.member_acked(node, end)

    def crash(self, node: NodeId) -> list[QuorumEffect]:
        """A follower restarts: it loses what it had not fsynced, and the leader's stream to it breaks."""
        self.written_end[node] = self.fsynced_end[node]
        self.stream_up[node] = False
        self.in_flight[node] = []
        return self.quorum.member_failed(node)

    def reconnect(self, node: NodeId) -> list[QuorumEffect]:
        effects = self.quorum.member_reconnected(node)
        self.stream_up[node] = True
        lag = {entry.node: entry.end_offset for entry in self.quorum.lagging()}
        self.send_offset[node] = lag.get(node, self.end_offset)
        return effects

    def heal(self) -> list[QuorumEffect]:
        """Every stream back, every batch delivered, fsynced and acked: the LAC reaches the end."""
        effects: list[QuorumEffect] = []
        for node in self.followers:
            if not self.stream_up[node]:
                effects += self.reconnect(node)
            for _ in range(2 * len(self.batches) + 2):  # one NotContiguous at most, then one batch a step
                self.deliver(node)
            effects += self.fsync(node)
            while self.in_flight[node]:
                effects += self.ack_arrives(node, 0)
        return effects


MEMBER_OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "deliver", "fsync", "ack", "crash", "reconnect", "fenced"]),
        st.integers(0, 4),
        st.integers(0, 8),
    ),
    max_size=80,
)


@PROPERTY
@given(ensembles(), MEMBER_OPS)
def test_a_batch_released_at_the_lac_is_fsynced_at_ack_quorum_members(
    shape: tuple[tuple[NodeId, ...], int], ops: list[tuple[str, int, int]]
) -> None:
    ensemble, ack_quorum = shape
    m = Members(ensemble, ack_quorum)
    released = 0  # batches acked at acks=all, in order

    def release(effects: list[QuorumEffect]) -> None:
        nonlocal released
        for effect in effects:
            if isinstance(effect, LacAdvanced):
                while released < len(m.batches) and m.batches[released].end_offset <= effect.lac:
                    assert m.holders(m.batches[released].end_offset) >= ack_quorum
                    released += 1

    for op, a, b in ops:
        node = ensemble[a % len(ensemble)]
        follower = node if node != m.leader else None
        if op == "append":
            m.append(A, b + 1)
        elif op == "deliver" and follower:
            m.deliver(follower)
        elif op == "fsync":
            release(m.fsync(node))
        elif op == "ack" and follower:
            release(m.ack_arrives(follower, b))
        elif op == "crash" and follower:
            m.crash(follower)
        elif op == "reconnect" and follower and not m.stream_up[follower]:
            m.reconnect(follower)
        elif op == "fenced" and follower:
            m.deposed_leader_appends(follower)
        assert m.quorum.lac <= m.durable_end()
        assert m.quorum.can_reach_quorum == (sum(m.stream_up.values()) >= ack_quorum)
    release(m.heal() + m.fsync(m.leader))
    assert m.quorum.lac == m.end_offset and released == len(m.batches)  # liveness: healed, everything is acked


# -- the ack table driven by the quorum: every released waiter's promise holds ------------------------------------


@dataclass(frozen=True)
class Waiting:
    acks: Acks
    end_offset: int
    last_seq: int
    deadline_ms: int


LEVELS = st.sampled_from(["leader", "all", "geo:1", "geo:2", "geo:3"])


class AckQuorumMachine(RuleBasedStateMachine):
    """Site ``a``'s leader of one partition replicated in the site, with sites ``b`` and ``c`` downstream.

    Producers wait at acks=leader, all or geo:1..3; other sites' batches are appended too (origin ``b``); the
    leader fsyncs when the ack table asks (or the fsync fails); followers stream, fsync, ack out of order, crash
    and reconnect; the quorum's LAC feeds the table; sites ``b`` and ``c`` copy what ``a`` serves (only below the
    LAC) and report it. At every release, the waiter's promise is checked against the explicit logs.
    """

    m: Members
    acks: AckTable
    fsync_per_batch: bool
    flush_running: bool
    now_ms: int
    tokens: int
    pending: dict[int, Waiting]
    answered: set[int]
    other_sites: dict[str, int]  # next origin-a seq each other site holds fsynced

    @initialize(shape=ensembles(), fsync_per_batch=st.booleans())
    def start(self, shape: tuple[tuple[NodeId, ...], int], fsync_per_batch: bool) -> None:
        ensemble, ack_quorum = shape
        self.m = Members(ensemble, ack_quorum)
        self.fsync_per_batch = fsync_per_batch
        self.acks = AckTable("a", A)
        self.acks.open_partition(KEY, fsync_per_batch, 0, VectorOffset({}), replicated_in_site=True)
        self.flush_running = False
        self.now_ms = 0
        self.tokens = 0
        self.pending = {}
        self.answered = set()
        self.other_sites = {"b": 0, "c": 0}

    # -- performing effects, and the promise at release ------------------------------------------------

    def perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StartFlush):
                assert not self.flush_running, "one fsync at a time per partition"
                self.flush_running = True
            elif isinstance(effect, Release):
                self.check_promise(effect.token)
            elif isinstance(effect, Fail):
                assert effect.token in self.pending and effect.token not in self.answered
                w = self.pending.pop(effect.token)
                self.answered.add(effect.token)
                if isinstance(effect.error, errors.GeoAckTimeout):
                    assert w.acks.kind is AckKind.GEO and self.now_ms >= w.deadline_ms
                else:
                    assert isinstance(effect.error, errors.FsyncFailed) and self.fsync_per_batch

    def quorum_effects(self, effects: list[QuorumEffect]) -> None:
        for effect in effects:
            if isinstance(effect, LacAdvanced):
                self.perform(self.acks.quorum_advanced(KEY, effect.lac, self.m.vector_at(effect.lac)))

    def unmet(self, w: Waiting, known: bool = False) -> str | None:
        """What of ``w``'s promise does not hold now, from the explicit logs; None: it all holds.

        ``known``: count only the fsyncs the leader has been told of (a follower's ack still in flight does not
        count), which is what the table can act on.
        """
        m = self.m
        if self.fsync_per_batch and m.fsynced_end[m.leader] < w.end_offset:  # every level includes the leader's
            return "the leader's fsync"
        if w.acks.kind is AckKind.LEADER:
            return None
        holders = m.known_holders(w.end_offset) if known else m.holders(w.end_offset)
        if holders < m.ack_quorum:
            return f"the quorum: {holders} member(s) hold it fsynced, {m.ack_quorum} must"
        holding = 1 + sum(1 for seq in self.other_sites.values() if seq > w.last_seq)  # a: the quorum, above
        if holding < w.acks.sites:
            return f"{w.acks.sites} sites: {holding} hold it"
        return None

    def check_promise(self, token: object) -> None:
        assert isinstance(token, int) and token in self.pending and token not in self.answered
        w = self.pending.pop(token)
        self.answered.add(token)
        missing = self.unmet(w)
        assert missing is None, f"acks={w.acks} released for a batch ending at {w.end_offset} without {missing}"

    # -- rules -----------------------------------------------------------------------------------------------

    @rule(records=st.integers(1, 3), level=LEVELS, timeout_ms=st.sampled_from([50, 1_000]))
    def produce(self, records: int, level: str, timeout_ms: int) -> None:
        self.wait(self.m.append(A, records), level, timeout_ms)

    def wait(self, batch: Batch, level: str, timeout_ms: int) -> None:
        acks = Acks.geo(int(level[4:])) if level.startswith("geo") else Acks(AckKind(level))
        self.tokens += 1
        deadline = self.now_ms + timeout_ms if acks.kind is AckKind.GEO and acks.sites > 1 else -1
        self.pending[self.tokens] = Waiting(acks, batch.end_offset, batch.last_seq, deadline)
        self.perform(
            self.acks.wait(
                self.tokens, KEY, batch.end_offset, A, batch.last_seq, acks, self.now_ms, timeout_ms=timeout_ms
            )
        )

    @rule(level=LEVELS, data=st.data())
    def producer_retries_a_written_batch(self, level: str, data: st.DataObject) -> None:
        """A deduplicated retry waits again on the batch already written, which may be below the LAC by now."""
        written = [b for b in self.m.batches if b.origin == A]
        if written:
            self.wait(data.draw(st.sampled_from(written)), level, 1_000)

    @rule(records=st.integers(1, 3))
    def another_sites_batch_is_appended(self, records: int) -> None:
        self.m.append(B, records)
        self.perform(self.acks.replicated(KEY, self.m.end_offset))

    @rule()
    def periodic_flush(self) -> None:
        self.perform(self.acks.flush(KEY, self.m.end_offset))

    @precondition(lambda self: self.flush_running)
    @rule()
    def leader_fsync_completes(self) -> None:
        self.flush_running = False
        effects = self.m.fsync(self.m.leader)
        self.perform(
            self.acks.flush_done(
                KEY, self.m.fsynced_end[self.m.leader], self.m.vector_at(self.m.fsynced_end[self.m.leader])
            )
        )
        self.quorum_effects(effects)

    @precondition(lambda self: self.flush_running)
    @rule()
    def leader_fsync_fails(self) -> None:
        self.flush_running = False
        self.perform(self.acks.flush_failed(KEY, "EIO"))

    @rule(data=st.data())
    def follower_step(self, data: st.DataObject) -> None:
        m = self.m
        if not m.followers:
            return
        node = data.draw(st.sampled_from(m.followers))
        step = data.draw(st.sampled_from(["deliver", "fsync", "ack", "crash", "reconnect", "fenced"]))
        if step == "deliver":
            m.deliver(node)
        elif step == "fsync":
            m.fsync(node)
        elif step == "ack":
            self.quorum_effects(m.ack_arrives(node, data.draw(st.integers(0, 8))))
        elif step == "crash":
            m.crash(node)
        elif step == "reconnect" and not m.stream_up[node]:
            m.reconnect(node)
        elif step == "fenced":
            m.deposed_leader_appends(node)

    @rule(data=st.data())
    def a_stale_lac_arrives_late(self, data: st.DataObject) -> None:
        lac = data.draw(st.integers(0, self.m.quorum.lac))
        self.perform(self.acks.quorum_advanced(KEY, lac, self.m.vector_at(lac)))

    @rule(site=st.sampled_from(["b", "c"]), data=st.data())
    def another_site_copies_and_reports(self, site: str, data: st.DataObject) -> None:
        served = self.m.vector_at(self.m.quorum.lac).get(A)  # a serves only below its LAC
        seq = data.draw(st.integers(self.other_sites[site], max(self.other_sites[site], served)))
        self.other_sites[site] = seq
        self.perform(self.acks.held_reported([(site, "t", 0, VectorOffset({A: seq}))]))

    @rule(elapsed_ms=st.integers(1, 200))
    def time_passes(self, elapsed_ms: int) -> None:
        self.now_ms += elapsed_ms
        self.perform(self.acks.tick(self.now_ms))

    @rule()
    def heal_and_drain(self) -> None:
        """Liveness: with every member and site caught up, every waiter still pending is released."""
        m = self.m
        self.quorum_effects(m.heal())
        self.perform(self.acks.flush(KEY, m.end_offset))
        for _ in range(3):
            if self.flush_running:
                self.leader_fsync_completes()
        assert m.quorum.lac == m.end_offset
        for site in sorted(self.other_sites):
            self.other_sites[site] = m.vector_at(m.quorum.lac).get(A)
            self.perform(self.acks.held_reported([(site, "t", 0, VectorOffset({A: self.other_sites[site]}))]))
        assert self.pending == {} and self.acks.pending() == 0

    # -- invariants ------------------------------------------------------------------------------------------

    @invariant()
    def this_sites_held_entry_is_only_what_its_quorum_holds(self) -> None:
        m = self.m
        held = self.acks.held.entries.get(("a", "t", 0), VectorOffset())
        assert held <= m.vector_at(m.durable_end())
        assert m.quorum.lac <= m.durable_end()

    @invariant()
    def the_table_and_the_model_agree_on_who_waits(self) -> None:
        assert self.acks.pending() == len(self.pending)

    @invariant()
    def no_waiter_is_kept_once_its_promise_holds(self) -> None:
        """The table has been told every fsync, LAC and report as it happened: it must not sit on an ack."""
        for token, w in sorted(self.pending.items()):
            assert self.unmet(w, known=True) is not None, f"acks={w.acks} (token {token}) waits, but its promise holds"


AckQuorumMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=40, deadline=None)
TestAckQuorumMachine = AckQuorumMachine.TestCase
