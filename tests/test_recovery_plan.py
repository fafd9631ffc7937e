"""Recovery of an open segment after its leader dies: each rule, then a model of the ensemble under Hypothesis.

What a user relies on: after a leader change, every batch acked with
``acks=all`` (so everything any reader saw) is in the sealed segment, held by
``min_insync_replicas`` members, the new leader among them; the seal invents
nothing; a recovery that cannot be safe fails and says which members to bring
back instead of sealing; and leaders racing each other never seal two ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cluster.recovery import (
    Copy,
    Done,
    Effect,
    Failed,
    Fence,
    InvalidRecovery,
    InvalidRecoveryEvent,
    Phase,
    Seal,
    SegmentRecovery,
    Superseded,
    cut_after_seal,
)
from offsets.coordinates import LocalOffset
from tests.support.examples import examples
from topology.ids import InvalidNodeId, LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4, N5 = (NodeId(n) for n in range(1, 6))
SEG = SegmentId(7)
BASE = 100


def recovery(
    ensemble: Sequence[int] = (1, 2, 3), aq: int = 2, me: int = 1, epoch: int = 2, base: int = BASE
) -> SegmentRecovery:
    r = SegmentRecovery(SEG, base, [NodeId(n) for n in ensemble], aq, LeaderEpoch(epoch), NodeId(me))
    r.start()
    return r


def off(n: int) -> LocalOffset:
    return LocalOffset(n)


# --- construction and start ------------------------------------------------------------


def test_start_fences_every_member_self_included_with_the_new_epoch() -> None:
    r = SegmentRecovery(SEG, BASE, [N3, N1, N2], 2, LeaderEpoch(5), N1)
    assert r.phase is Phase.NEW
    assert r.start() == [Fence(N3, LeaderEpoch(5)), Fence(N1, LeaderEpoch(5)), Fence(N2, LeaderEpoch(5))]
    assert r.phase is Phase.FENCING and r.need == 2
    with pytest.raises(InvalidRecoveryEvent, match="already started"):
        r.start()


def test_events_before_start_are_refused() -> None:
    r = SegmentRecovery(SEG, BASE, [N1, N2, N3], 2, LeaderEpoch(2), N1)
    with pytest.raises(InvalidRecoveryEvent, match="before start"):
        r.fenced(N1, BASE)


@pytest.mark.parametrize(
    ("ensemble", "aq", "me", "epoch", "base", "error", "match"),
    [
        ((), 1, 1, 2, 0, InvalidRecovery, "empty ensemble"),
        ((1, 2, 2), 2, 1, 2, 0, InvalidRecovery, "names a node twice"),
        ((1, 2, 3), 0, 1, 2, 0, InvalidRecovery, "must be 1 to 3"),
        ((1, 2, 3), 4, 1, 2, 0, InvalidRecovery, "min_insync_replicas against replication_factor"),
        ((1, 2, 3), 2, 4, 2, 0, InvalidRecovery, "only a member can recover it"),
        ((1, 2, 3), 2, 1, 0, 0, InvalidRecovery, "follows an epoch bump"),
        ((1, 2, 3), 2, 1, 2, -1, InvalidRecovery, "offsets start at 0"),
        ((0, 1, 2), 2, 1, 2, 0, InvalidNodeId, "invalid node id 0"),
    ],
)
def test_parameters_that_describe_no_real_segment_are_refused(
    ensemble: tuple[int, ...], aq: int, me: int, epoch: int, base: int, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        SegmentRecovery(SEG, base, [NodeId(n) for n in ensemble], aq, LeaderEpoch(epoch), NodeId(me))


# --- fencing and the decision -------------------------------------------------------------


def test_the_end_is_decided_on_e_minus_aq_plus_1_answers_and_is_their_max() -> None:
    r = recovery((1, 2, 3, 4, 5), aq=3, me=1)  # need = 3
    assert r.fenced(N1, 110) == []
    assert r.fenced(N2, 130) == []
    assert r.recovered_end is None and r.phase is Phase.FENCING
    out = r.fenced(N3, 120)
    assert r.recovered_end == 130 and r.fence_quorum == (N1, N2, N3)
    # The tail goes to every answering member that lacks it; this node first, from the only holder.
    assert out == [Copy(N2, N1, off(110), off(130)), Copy(N2, N3, off(120), off(130))]
    assert r.phase is Phase.COPYING


def test_the_decision_waits_for_this_nodes_own_answer() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    assert r.fenced(N2, 120) == [] and r.fenced(N3, 110) == []
    assert r.recovered_end is None
    out = r.fenced(N1, 105)
    assert r.recovered_end == 120 and r.fence_quorum == (N1, N2, N3)
    assert out == [Copy(N2, N1, off(105), off(120)), Copy(N2, N3, off(110), off(120))]


def test_copies_come_from_this_node_first_and_the_seal_waits_for_aq_holders() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    out = r.fenced(N3, 110)
    assert out == [Copy(N1, N3, off(110), off(120))]
    assert r.holders() == (N1,)
    assert r.copied(N3, 120) == [Seal(SEG, off(120))]
    assert r.phase is Phase.SEALING and r.holders() == (N1, N3)
    assert r.seal_committed(120) == [Done(off(120))]
    assert r.phase is Phase.DONE


def test_the_seal_waits_for_this_node_to_hold_the_end_even_when_aq_others_do() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N2, 120)
    r.fenced(N3, 120)
    assert r.fenced(N1, 110) == [Copy(N2, N1, off(110), off(120))]
    assert r.holders() == (N2, N3) and r.phase is Phase.COPYING
    assert r.copied(N1, 120) == [Seal(SEG, off(120))]


def test_a_segment_that_aq_members_already_hold_is_sealed_at_once() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    assert r.fenced(N2, 120) == [Seal(SEG, off(120))]
    assert r.fenced(N3, 100) == []  # a late answer while sealing: nothing more is needed


def test_an_empty_segment_is_sealed_at_its_base() -> None:
    r = recovery((1, 2, 3), aq=2, me=2)
    r.fenced(N2, BASE)
    assert r.fenced(N1, BASE) == [Seal(SEG, off(BASE))]


def test_a_single_node_ensemble_recovers_from_itself() -> None:
    r = recovery((4,), aq=1, me=4)
    assert r.fenced(N4, 150) == [Seal(SEG, off(150))]


def test_a_fence_answer_below_the_base_offset_is_refused_and_changes_nothing() -> None:
    r = recovery()
    with pytest.raises(InvalidRecoveryEvent, match="below the segment's base offset 100"):
        r.fenced(N2, 99)
    r.fenced(N1, 110)
    assert r.fenced(N2, 110) == [Seal(SEG, off(110))]  # the same member may still answer properly


def test_a_repeated_fence_answer_is_ignored_and_a_contradicting_one_refused() -> None:
    r = recovery((1, 2, 3), aq=3, me=1)  # need = 1, but this node's own answer comes first
    r.fenced(N2, 120)
    assert r.fenced(N2, 120) == []
    with pytest.raises(InvalidRecoveryEvent, match="twice, with ends 120 and 130"):
        r.fenced(N2, 130)  # nothing was copied to it yet: someone else wrote
    assert r.fenced(N1, 140) == [Copy(N1, N2, off(120), off(140))]
    assert r.fenced(N2, 130) == []  # a retried fence after part of our copy: consistent
    with pytest.raises(InvalidRecoveryEvent, match="lose fsynced data"):
        r.fenced(N2, 110)


def test_events_about_a_node_outside_the_ensemble_are_refused() -> None:
    r = recovery()
    with pytest.raises(InvalidRecoveryEvent, match="not in segment 7's ensemble"):
        r.fenced(N5, 110)
    with pytest.raises(InvalidRecoveryEvent, match="not in segment 7's ensemble"):
        r.unreachable(N5)


# --- a newer leader ---------------------------------------------------------------------


def test_a_member_fenced_by_a_newer_epoch_supersedes_the_recovery() -> None:
    r = recovery(epoch=2)
    out = r.fence_refused(N3, 3)
    assert out and isinstance(out[0], Superseded) and out[0].their_epoch == 3
    assert "step down" in out[0].reason
    assert r.phase is Phase.SUPERSEDED
    assert r.fenced(N1, 110) == [] and r.fenced(N2, 110) == []  # nothing more from a superseded recovery


def test_a_refusal_for_an_epoch_not_newer_is_refused() -> None:
    r = recovery(epoch=2)
    with pytest.raises(InvalidRecoveryEvent, match="refuses only older"):
        r.fence_refused(N3, 2)


def test_a_copy_refused_for_a_newer_epoch_supersedes_the_recovery() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    r.fenced(N2, 110)
    assert isinstance(r.fence_refused(N2, 9)[0], Superseded)


def test_a_refused_seal_supersedes_the_recovery() -> None:
    r = recovery()
    r.fenced(N1, 120)
    r.fenced(N2, 120)
    out = r.seal_refused("epoch 3 is current")
    assert isinstance(out[0], Superseded) and "epoch 3 is current" in out[0].reason
    assert r.seal_committed(120) == []


def test_seal_answers_without_a_seal_or_at_another_end_are_refused() -> None:
    r = recovery()
    with pytest.raises(InvalidRecoveryEvent, match="asked no seal"):
        r.seal_committed(120)
    with pytest.raises(InvalidRecoveryEvent, match="none was asked"):
        r.seal_refused("?")
    r.fenced(N1, 120)
    r.fenced(N2, 120)
    with pytest.raises(InvalidRecoveryEvent, match="asked 120"):
        r.seal_committed(130)


# --- failure: too few members -------------------------------------------------------------


def test_fewer_than_e_minus_aq_plus_1_reachable_members_fail_and_say_what_to_do() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    assert r.unreachable(N2) == []  # N3 may still answer
    out = r.unreachable(N3)
    assert len(out) == 1 and isinstance(out[0], Failed)
    assert "cannot be recovered safely" in out[0].reason
    assert "Bring a member back (unreachable: 2, 3)" in out[0].reason
    assert r.phase is Phase.FAILED and r.recovered_end is None
    assert r.fenced(N2, 120) == []  # too late: the shell starts a new recovery


@pytest.mark.parametrize("answered_first", [False, True])
def test_this_node_unable_to_use_its_own_copy_fails(answered_first: bool) -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    if answered_first:
        r.fenced(N1, 110)
    r.fenced(N2, 120)
    out = r.unreachable(N1)
    assert out == [
        Failed(
            "this node (1) cannot use its own copy of segment 7: it cannot lead the partition; "
            "let another member of the ensemble lead"
        )
    ]


def test_with_aq_equal_to_e_one_answer_decides_but_every_member_must_hold_the_end() -> None:
    r = recovery((1, 2, 3), aq=3, me=1)  # need = 1
    assert r.fenced(N1, 120) == []
    assert r.recovered_end == 120 and r.fence_quorum == (N1,)
    assert r.fenced(N2, 110) == [Copy(N1, N2, off(110), off(120))]
    out = r.unreachable(N3)
    assert isinstance(out[0], Failed) and "only 2 members can hold it, and 3" in out[0].reason


def test_a_late_answer_with_more_holds_the_end_and_is_cut_after_the_seal() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 110)
    assert r.fenced(N2, 105) == [Copy(N1, N2, off(105), off(110))]
    assert r.fenced(N3, 140) == [Seal(SEG, off(110))]  # holds [base, 110) as a prefix: a second holder
    assert r.fence_quorum == (N1, N2) and r.holders() == (N1, N3)
    assert cut_after_seal(140, 110) == 110


def test_a_late_answer_with_less_gets_a_copy() -> None:
    r = recovery((1, 2, 3, 4, 5), aq=4, me=1)  # need = 2
    r.fenced(N1, 120)
    r.fenced(N2, 120)
    assert r.fenced(N5, 100) == [Copy(N1, N5, off(100), off(120))]


# --- copies -----------------------------------------------------------------------------


def test_a_failed_copy_is_tried_from_each_other_holder_once_then_given_up() -> None:
    r = recovery((1, 2, 3, 4), aq=2, me=1)  # need = 3
    r.fenced(N2, 130)
    r.fenced(N3, 130)
    assert r.fenced(N1, 100) == [Copy(N2, N1, off(100), off(130))]  # N2 and N3 hold it, but not this node
    assert r.copy_failed(N1, "connection reset") == [Copy(N3, N1, off(100), off(130))]
    out = r.copy_failed(N1, "connection reset")
    assert isinstance(out[0], Failed) and "cannot get the recovered end 130" in out[0].reason


def test_an_unreachable_holder_is_not_a_source_but_its_answer_still_counts() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 100)
    r.fenced(N2, 130)  # decides: copy N2 -> N1
    assert r.unreachable(N2) == []  # the copy in flight gets its own answer
    out = r.copy_failed(N1, "N2 is gone")
    assert isinstance(out[0], Failed) and "unreachable: 2" in out[0].reason


def test_an_unreachable_target_gets_no_copy_and_the_recovery_goes_on_with_others() -> None:
    r = recovery((1, 2, 3, 4, 5), aq=3, me=1)  # need = 3
    r.unreachable(N2)
    r.fenced(N1, 130)
    r.fenced(N3, 100)
    out = r.fenced(N4, 120)
    assert out == [Copy(N1, N3, off(100), off(130)), Copy(N1, N4, off(120), off(130))]
    assert r.copy_failed(N3, "disk full") == []  # N1 was the only holder: N3 is given up; N4, N5 remain
    assert r.copied(N4, 130) == []
    assert r.fenced(N5, 130) == [Seal(SEG, off(130))]


def test_copy_answers_that_match_no_copy_are_refused() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    with pytest.raises(InvalidRecoveryEvent, match="no copy to it is in flight"):
        r.copied(N2, 120)
    r.fenced(N2, 110)
    with pytest.raises(InvalidRecoveryEvent, match="ends at 120"):
        r.copied(N2, 115)
    with pytest.raises(InvalidRecoveryEvent, match="no copy to it is in flight"):
        r.copy_failed(N3, "?")


def test_copy_answers_after_the_seal_are_taken_quietly() -> None:
    r = recovery((1, 2, 3), aq=2, me=1)
    r.fenced(N1, 120)
    r.fenced(N2, 120)  # seal asked
    assert r.fenced(N3, 110) == []
    r2 = recovery((1, 2, 3), aq=2, me=1)
    r2.fenced(N1, 120)
    r2.fenced(N3, 110)  # copy N1 -> N3
    r2.fenced(N2, 120)  # seal asked while the copy is in flight
    assert r2.phase is Phase.SEALING
    assert r2.copy_failed(N3, "late") == []
    assert r2.seal_committed(120) == [Done(off(120))]


# --- cut after seal -----------------------------------------------------------------------


@pytest.mark.parametrize(("local_end", "sealed_end", "cut"), [(140, 120, 120), (120, 120, None), (110, 120, None)])
def test_only_a_member_holding_more_than_the_sealed_end_cuts(local_end: int, sealed_end: int, cut: int | None) -> None:
    assert cut_after_seal(local_end, sealed_end) == cut


def test_cut_refuses_negative_offsets() -> None:
    with pytest.raises(InvalidRecovery, match="never negative"):
        cut_after_seal(-1, 0)


# --- the model ------------------------------------------------------------------------------
#
# An ensemble, the writer's stream W of batches (offsets from BASE), each member holding a prefix
# of W, the acks those prefixes allow, members down from the start or crashing midway, the old
# writer still appending to members not yet fenced, random interleavings of every message, copies
# failing (partway or whole), and up to two more leaders taking over. The metadata (a single seal,
# conditional on the epoch) is the single source of truth.


@dataclass
class Member:
    data: list[int]  # batch numbers held fsynced: must be a prefix of W
    writer_batches: int  # how many batches the writer itself gave it (what its acks could cover)
    epoch: int = 0  # the newest epoch that fenced it; 0 is the writer's
    down: bool = False
    knows_seal: bool = False  # learned the committed seal and cut: refuses every later append or copy


@dataclass
class Meta:
    epoch: int = 1
    sealed: int | None = None
    sealed_by: int | None = None  # index of the recovery whose seal committed
    seals: int = 0


@dataclass
class World:
    nodes: tuple[NodeId, ...]
    aq: int
    bounds: list[int]  # bounds[i]: offset where batch i starts; bounds[-1]: end of W
    members: dict[NodeId, Member]
    meta: Meta = field(default_factory=Meta)
    recoveries: list[SegmentRecovery] = field(default_factory=list)
    outcomes: list[Effect | None] = field(default_factory=list)
    pool: list[tuple[int, str, object]] = field(default_factory=list)  # (recovery, "do" | "answer", item)
    faults: int = 0  # copies failed or members crashed midway
    max_writer_end: int = BASE

    @property
    def stream(self) -> list[int]:
        return list(range(len(self.bounds) - 1))

    def end_of(self, node: NodeId) -> int:
        return self.bounds[len(self.members[node].data)]

    def batches_to(self, offset: int) -> int:
        assert offset in self.bounds, f"offset {offset} is not a batch boundary of {self.bounds}"
        return self.bounds.index(offset)

    def acked_end(self) -> int:
        """The highest end that AQ members got from the writer: every batch the writer could have acked."""
        got = sorted((m.writer_batches for m in self.members.values()), reverse=True)
        return self.bounds[got[self.aq - 1]]

    def begin(self, me: NodeId) -> None:
        r = SegmentRecovery(SEG, BASE, self.nodes, self.aq, LeaderEpoch(self.meta.epoch), me)
        self.recoveries.append(r)
        self.outcomes.append(None)
        self.take(len(self.recoveries) - 1, r.start())

    def take(self, index: int, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, (Fence, Copy, Seal)):
                self.pool.append((index, "do", e))
            else:
                assert self.outcomes[index] is None, f"recovery {index} ended twice: {self.outcomes[index]}, {e}"
                self.outcomes[index] = e

    def answer(self, index: int, event: Callable[[SegmentRecovery], list[Effect]]) -> None:
        self.pool.append((index, "answer", event))

    def deliver(self, pos: int, copy_fault: int | None) -> None:
        index, kind, item = self.pool.pop(pos)
        r = self.recoveries[index]
        if kind == "answer":
            assert callable(item)
            self.take(index, item(r))
        elif isinstance(item, Fence):
            self.do_fence(index, item)
        elif isinstance(item, Copy):
            self.do_copy(index, r, item, copy_fault)
        else:
            assert isinstance(item, Seal)
            self.do_seal(index, r, item)

    def do_fence(self, index: int, f: Fence) -> None:
        m = self.members[f.node]
        node = f.node
        if m.down:
            self.answer(index, lambda r: r.unreachable(node))
        elif m.epoch > f.epoch:
            their = m.epoch
            self.answer(index, lambda r: r.fence_refused(node, their))
        else:
            m.epoch = f.epoch
            end = self.end_of(node)
            self.answer(index, lambda r: r.fenced(node, end))

    def do_copy(self, index: int, r: SegmentRecovery, c: Copy, copy_fault: int | None) -> None:
        src, dst = self.members[c.source], self.members[c.target]
        target = c.target
        if src.down or dst.down:
            self.answer(index, lambda r: r.copy_failed(target, "down"))
            return
        if dst.knows_seal:
            self.answer(index, lambda r: r.copy_failed(target, "the segment is sealed"))
            return
        if dst.epoch > r.epoch:
            their = dst.epoch
            self.answer(index, lambda r: r.fence_refused(target, their))
            return
        assert dst.epoch == r.epoch, f"copy to node {target}, which this recovery never fenced"
        start, end = self.batches_to(c.start_offset), self.batches_to(c.end_offset)
        assert start <= len(dst.data), f"copy to node {target} from {c.start_offset} would leave a hole"
        assert len(src.data) >= end, f"copy source node {c.source} does not hold up to {c.end_offset}"
        if copy_fault is not None:  # fails after copying part of the tail
            upto = min(end, len(dst.data) + copy_fault)
            dst.data += src.data[len(dst.data) : upto]
            self.faults += 1
            self.answer(index, lambda r: r.copy_failed(target, "connection reset"))
            return
        dst.data += src.data[len(dst.data) : end]
        end_offset = c.end_offset
        self.answer(index, lambda r: r.copied(target, end_offset))

    def do_seal(self, index: int, r: SegmentRecovery, s: Seal) -> None:
        meta = self.meta
        if meta.epoch != r.epoch or meta.sealed is not None:
            self.answer(index, lambda r: r.seal_refused(f"epoch {meta.epoch} is current, sealed at {meta.sealed}"))
            return
        meta.sealed, meta.sealed_by, meta.seals = s.end_offset, index, meta.seals + 1
        sealed = s.end_offset
        # At commit: the end is held by AQ members and this node, covers every ack, and was some member's.
        holders = [n for n in self.nodes if self.end_of(n) >= sealed]
        assert len(holders) >= self.aq, f"sealed at {sealed} with holders {holders} only"
        own = self.end_of(r.self_node)
        assert own >= sealed, f"sealed at {sealed}, but the new leader holds {own}"
        assert self.acked_end() <= sealed, f"acked {self.acked_end()} is beyond the seal at {sealed}"
        assert sealed <= self.max_writer_end, f"sealed at {sealed}: no member ever got that much from the writer"
        self.answer(index, lambda r: r.seal_committed(sealed))

    def writer_targets(self) -> list[NodeId]:
        """Members the old writer can still append to: up, never fenced, short of W."""
        n = len(self.bounds) - 1
        return [
            k
            for k in self.nodes
            if not self.members[k].down
            and self.members[k].epoch == 0
            and not self.members[k].knows_seal
            and len(self.members[k].data) < n
        ]

    def learn_seal(self, node: NodeId) -> None:
        """``node`` learns the committed seal: it cuts what it holds beyond it, and takes nothing more."""
        sealed, sealed_by = self.meta.sealed, self.meta.sealed_by
        assert sealed is not None and sealed_by is not None
        m = self.members[node]
        w = self.stream
        assert m.data == w[: len(m.data)], f"node {node} holds {m.data}: not a prefix of the writer's stream"
        cut = cut_after_seal(self.end_of(node), sealed)
        if cut is not None:
            event("a member cut its tail")
            assert node not in self.recoveries[sealed_by].fence_quorum, f"node {node} of the fence quorum held more"
            del m.data[self.batches_to(cut) :]
        m.knows_seal = True
        assert m.data == w[: self.batches_to(sealed)][: len(m.data)]

    def writer_append(self, node: NodeId) -> None:
        m = self.members[node]
        m.data.append(len(m.data))
        m.writer_batches = len(m.data)
        self.max_writer_end = max(self.max_writer_end, self.end_of(node))


MODEL = settings(max_examples=examples(300), deadline=None)


@dataclass
class Scenario:
    """A drawn ensemble, its old writer's stream, and the new leader that begins recovering it."""

    world: World
    members: dict[NodeId, Member]
    aq: int
    need: int
    me: NodeId
    up_at_start: int
    writer_alive: bool  # cut off from the metadata but not from the members: it goes on appending


def draw_scenario(data: st.DataObject) -> Scenario:
    d = data.draw
    e = d(st.integers(1, 5), label="E")
    aq = d(st.integers(1, e), label="AQ")
    nodes = tuple(d(st.permutations([NodeId(n) for n in d(st.sets(st.integers(1, 9), min_size=e, max_size=e))])))
    sizes = d(st.lists(st.integers(1, 3), min_size=1, max_size=6), label="batch sizes")
    bounds = [BASE]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    # The old writer appended every batch locally (unless it lost an unfsynced tail) and streamed it:
    # each other member holds some prefix, and AQ of them bound what was acked.
    writer = d(st.sampled_from(nodes), label="old writer's node")
    held = {n: d(st.integers(0, len(sizes))) for n in nodes}
    if not d(st.booleans(), label="the writer lost an unfsynced tail"):
        held[writer] = len(sizes)
    members = {n: Member(list(range(held[n])), held[n]) for n in nodes}
    world = World(nodes, aq, bounds, members)
    world.max_writer_end = max(world.end_of(n) for n in nodes)
    me = d(st.sampled_from(nodes), label="new leader")
    others = [n for n in nodes if n != me]
    down = d(st.sets(st.sampled_from(others)) if others else st.just(set[NodeId]()), label="down")
    if writer != me and not d(st.booleans(), label="the writer's node is still up"):
        down.add(writer)
    for n in down:
        members[n].down = True
    writer_alive = writer != me and writer not in down and d(st.booleans(), label="old writer still appending")
    world.begin(me)
    return Scenario(world, members, aq, e - aq + 1, me, e - len(down), writer_alive)


def play(data: st.DataObject, sc: Scenario) -> None:
    """Deliveries, the old writer's appends, crashes, new leaders and members learning the seal, in a drawn
    order with at most three faults; then every message arrives."""
    draw = data.draw
    world, members, nodes = sc.world, sc.members, sc.world.nodes
    leaders = {sc.me}
    takeovers = 0
    for _ in range(300):
        kinds: list[str] = ["deliver"] * 4 if world.pool else []
        if sc.writer_alive and world.writer_targets() and world.pool:
            kinds += ["write"] * 2
        crashable = [n for n in nodes if not members[n].down and n not in leaders]
        if crashable and world.faults < 3 and world.pool:
            kinds.append("crash")
        if takeovers < 2:
            kinds.append("takeover")
        learners = [
            n for n in nodes if world.meta.sealed is not None and not members[n].knows_seal and not members[n].down
        ]
        if learners and world.pool:
            kinds.append("learn")
        if not world.pool and ("takeover" not in kinds or not draw(st.booleans(), label="a leader after quiet")):
            break
        kind = draw(st.sampled_from(kinds))
        if kind == "deliver":
            pos = draw(st.integers(0, len(world.pool) - 1))
            fault = draw(st.one_of(st.none(), st.integers(0, 3))) if world.pool[pos][1] == "do" else None
            world.deliver(pos, fault if world.faults < 3 else None)
        elif kind == "write":
            world.writer_append(draw(st.sampled_from(world.writer_targets())))
        elif kind == "learn":
            world.learn_seal(draw(st.sampled_from(learners)))
        elif kind == "crash":
            members[draw(st.sampled_from(crashable))].down = True
            world.faults += 1
        else:
            takeovers += 1
            world.meta.epoch += 1
            alive = [n for n in nodes if not members[n].down]
            if world.meta.sealed is None and alive:  # once sealed, a new leader reads it sealed and does not recover
                leader = draw(st.sampled_from(alive), label="next leader")
                leaders.add(leader)
                world.begin(leader)
    for _ in range(1_000):  # drain: every message arrives, no more faults
        if not world.pool:
            break
        world.deliver(0, None)
    assert not world.pool


def check_outcomes(sc: Scenario) -> None:
    """Every recovery ends and says how; with too few members up, none seals."""
    world = sc.world
    for r, outcome in zip(world.recoveries, world.outcomes, strict=True):
        assert outcome is not None, f"recovery at epoch {r.epoch} is stuck in {r.phase}"
        event(f"outcome: {type(outcome).__name__}")
    event(f"recoveries: {len(world.recoveries)}")
    if sc.up_at_start < sc.need:
        assert world.meta.sealed is None, "sealed with fewer than E - AQ + 1 members able to answer"
        assert all(isinstance(o, (Failed, Superseded)) for o in world.outcomes)
    if len(world.recoveries) == 1 and world.faults == 0:
        if sc.up_at_start >= sc.need and sc.up_at_start >= sc.aq:
            assert world.outcomes[0] == Done(LocalOffset(world.end_of(sc.me)))
        else:
            assert isinstance(world.outcomes[0], Failed)
            assert "Bring a member back" in world.outcomes[0].reason
    assert world.meta.seals <= 1
    if world.meta.sealed is None:
        assert not any(isinstance(o, Done) for o in world.outcomes)


def check_seal(sc: Scenario) -> None:
    """One seal, by the recovery that says Done; no ack past it; AQ members, the sealer among them, hold exactly
    the stream up to it once every member has learnt it."""
    world, meta = sc.world, sc.world.meta
    sealed = meta.sealed
    assert sealed is not None and meta.sealed_by is not None
    sealer = world.recoveries[meta.sealed_by]
    assert world.outcomes[meta.sealed_by] == Done(LocalOffset(sealed))
    assert [o for o in world.outcomes if isinstance(o, Done)] == [Done(LocalOffset(sealed))]
    # No ack ever went past the seal, not even from the old writer still appending afterwards.
    assert world.acked_end() <= sealed
    # Every member learns the committed seal (a down one when it comes back) and cuts.
    for n in world.nodes:
        if not sc.members[n].knows_seal:
            world.learn_seal(n)
    content = world.stream[: world.batches_to(sealed)]
    exact = [n for n in world.nodes if sc.members[n].data == content]
    assert len(exact) >= sc.aq and sealer.self_node in exact


@MODEL
@given(st.data())
def test_recovery_against_a_model_of_the_ensemble(data: st.DataObject) -> None:
    sc = draw_scenario(data)
    play(data, sc)
    check_outcomes(sc)
    if sc.world.meta.sealed is not None:
        check_seal(sc)
