"""A topic's own ``min_insync_replicas``, recorded per segment (issue 23).

A segment's recovery must fence ``E - AQ + 1`` members for the quorum ``AQ`` its writes were acked under: any
``AQ`` members that hold an acked batch then include one it reads. A topic's quorum can change after a segment
opened (an alter here, or one a topic sync brings), so each segment records the quorum it opened with
(``OpenSegment.ack_quorum``) and its recovery uses that one, not the topic's now; an alter rolls the open segment so
that the new quorum applies from the next write. Pure: the lead and node cores, the metadata's commands.
"""

from __future__ import annotations

import grpc
import pytest

from cluster.lead import (
    Adopted,
    CopyTail,
    FenceMember,
    LeadContext,
    LeadEffect,
    Note,
    PartitionLead,
    ProposeOpen,
    ProposeSeal,
    Sealing,
)
from cluster.node import NodeConfig, NodeCore
from cluster.placement import NodeLoad
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    InvalidCommand,
    MergeTopicEntry,
    OpenSegment,
    PartitionInfo,
    RegisterNode,
    SegmentInfo,
    SiteState,
    command_from_dict,
)
from georep.broker.errors import NotEnoughReplicas
from georep.kafka.errors import error_code
from georep.metadata.topic_entry import alter
from georep.metadata.topics import TopicSpec
from georep.proto.reasons import Reason
from georep.server.status import wire_status
from offsets.coordinates import LocalOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

A, B, C = NodeId(1), NodeId(2), NodeId(3)
KEY = ("t", 0)
E1, E2 = LeaderEpoch(1), LeaderEpoch(2)
SITE = NodeConfig(
    replication_factor=3, ack_quorum=2, session_timeout_ms=6_000, tick_ms=100, retry_ms=100, roll_wait_ms=0
)


def topic(aq: int | None) -> TopicSpec:
    return TopicSpec("t", 1, {} if aq is None else {"min_insync_replicas": aq})


def recover(segment_aq: int | None, topic_aq: int | None) -> tuple[PartitionLead, LeadContext, int]:
    """Node B, new leader in epoch 2, recovers segment 0 (A's, opened with ``segment_aq``) while the topic's
    quorum is ``topic_aq`` now: the lead's config is the topic's, as ``NodeCore`` makes it."""
    segment = SegmentInfo(SegmentId(0), LocalOffset(0), (A, B, C), E1, ack_quorum=segment_aq)
    info = PartitionInfo("t", 0, B, E2, (segment,))
    lead = PartitionLead(B, KEY, E2, SITE.lead(topic(topic_aq)), segment)
    ctx = LeadContext(0, info, list)
    fences = [e for e in lead.start(ctx) if isinstance(e, FenceMember)]
    assert sorted(f.member for f in fences) == [A, B, C]
    return lead, ctx, fences[0].attempt


def seals(effects: list[LeadEffect]) -> list[int]:
    return [e.end for e in effects if isinstance(e, ProposeSeal)]


def test_a_segment_acked_with_one_member_is_not_sealed_from_two_answers_after_the_topic_asks_two() -> None:
    """A's segment opened with min_insync_replicas 1: A acked [0, 100) once it alone held it. The topic was altered
    to 2 since; A is dead. B and C hold nothing: sealing at 0 from their two answers (what the topic's quorum 2
    would allow) would lose the acked write. The segment's quorum 1 needs all three answers: it waits for A."""
    lead, ctx, attempt = recover(segment_aq=1, topic_aq=2)
    out = lead.fenced(attempt, B, 0, ctx) + lead.fenced(attempt, C, 0, ctx)
    assert seals(out) == [], "sealed from two answers: A's acked [0, 100) would be lost"
    out = lead.unreachable(attempt, A, ctx)
    assert seals(out) == [] and any(isinstance(e, Note) and e.what == "recovery_failed" for e in out)
    assert lead.recovery is None  # tried again after retry_ms, until A answers
    lead.tick(LeadContext(1_000, ctx.info, list))
    assert lead.recovery is not None and lead.recovery.machine.ack_quorum == 1


def test_a_segment_acked_with_two_members_recovers_from_two_after_the_topic_asks_one() -> None:
    """The reverse: opened with 2 (A and B hold [0, 100)), the topic now asks 1. A is dead: the two answers of B
    and C are enough for the segment's own quorum; the topic's 1 would wait for A's answer for good."""
    lead, ctx, attempt = recover(segment_aq=2, topic_aq=1)
    out = lead.fenced(attempt, B, 100, ctx) + lead.fenced(attempt, C, 0, ctx)
    assert lead.recovery is not None and lead.recovery.machine.recovered_end == 100
    assert [e.copy.target for e in out if isinstance(e, CopyTail)] == [C]  # then the seal at 100


def test_a_segment_from_before_segments_recorded_their_quorum_recovers_with_the_sites() -> None:
    """Old metadata (no ack_quorum: the site's 2 applied, A and C hold the acked [0, 100)) under a topic now asking
    3: B's own answer alone (enough for 3) would seal at 0; the site's 2 waits for a second answer."""
    lead, ctx, attempt = recover(segment_aq=None, topic_aq=3)
    assert seals(lead.fenced(attempt, B, 0, ctx)) == []
    assert lead.recovery is not None and lead.recovery.machine.recovered_end is None
    lead.fenced(attempt, C, 100, ctx)
    assert lead.recovery is not None and lead.recovery.machine.recovered_end == 100


# -- opening with the topic's quorum, and rolling on an alter ---------------------------------------------------


def loads() -> list[NodeLoad]:
    return [NodeLoad(n, 1 << 40, 0, True, False) for n in (A, B, C)]


def opened_lead(aq: int) -> tuple[PartitionLead, PartitionInfo]:
    lead = PartitionLead(A, KEY, E1, SITE.lead(topic(aq)), None)
    info = PartitionInfo("t", 0, A, E1)
    (propose,) = [e for e in lead.start(LeadContext(0, info, loads)) if isinstance(e, ProposeOpen)]
    assert propose.command.ack_quorum == aq  # the segment records the topic's quorum when it opens
    state = SiteState()
    for n in (A, B, C):
        state.apply(RegisterNode(n, f"127.0.0.1:{9000 + n}"))
    state.apply(CreateTopic(topic(aq)))
    state.apply(ElectLeader("t", 0, A, LeaderEpoch(0)))
    assert isinstance(state.apply(propose.command), Applied)
    info = state.partition(*KEY)
    assert info is not None and info.segments[0].ack_quorum == aq
    adopted = [e for e in lead.opened(propose.command, Applied(segment_id=SegmentId(0)), LeadContext(0, info, loads))]
    assert [e.ack_quorum for e in adopted if isinstance(e, Adopted)] == [aq]
    assert lead.quorum is not None and lead.quorum.ack_quorum == aq
    return lead, info


def test_an_alter_of_the_quorum_rolls_the_open_segment_and_the_next_opens_with_the_new_one() -> None:
    lead, info = opened_lead(1)
    assert lead.retune(SITE.lead(topic(1)), 10) == []  # nothing changed: no roll
    out = lead.retune(SITE.lead(topic(3)), 10)
    assert any(isinstance(e, Sealing) for e in out), out
    lead.member_acked(A, 0)
    (seal,) = [e for e in lead.roll_check(LeadContext(10, info, loads)) if isinstance(e, ProposeSeal)]
    sealed = lead.sealed(seal.token, Applied(), LeadContext(10, PartitionInfo("t", 0, A, E1, ()), loads))
    (propose,) = [e for e in sealed if isinstance(e, ProposeOpen)]
    assert propose.command.ack_quorum == 3


def test_a_node_core_retunes_its_leads_when_the_view_shows_an_altered_topic() -> None:
    """``NodeCore.reconcile`` (every new view) hands each lead its topic's settings: an alter rolls at once."""
    lead, _ = opened_lead(1)
    core = NodeCore(A, SITE, {})
    core.leads[KEY] = lead
    state = SiteState()
    for n in (A, B, C):
        state.apply(RegisterNode(n, f"127.0.0.1:{9000 + n}"))
    state.apply(CreateTopic(topic(1)))
    assert not any(isinstance(e, Sealing) for e in core._retune(state, 0))
    held = state.entries()["t"]
    assert isinstance(state.apply(MergeTopicEntry(alter(held, "t", {"min_insync_replicas": 2}, 5, "a"))), Applied)
    assert any(isinstance(e, Sealing) for e in core._retune(state, 10))
    assert lead.config.ack_quorum == 2


# -- the command and the snapshot ----------------------------------------------------------------------------------


def test_open_segment_carries_its_quorum_through_the_codec_and_old_records_decode_to_none() -> None:
    cmd = OpenSegment("t", 0, E1, LocalOffset(0), (A, B, C), 2)
    assert command_from_dict(cmd.to_dict()) == cmd
    old = cmd.to_dict()
    del old["ack_quorum"]
    assert command_from_dict(old) == OpenSegment("t", 0, E1, LocalOffset(0), (A, B, C), None)
    assert "ack_quorum" not in OpenSegment("t", 0, E1, LocalOffset(0), (A, B, C)).to_dict()  # old form unchanged
    for bad in (0, 4):
        with pytest.raises(InvalidCommand, match="not between 1 and the ensemble size 3"):
            OpenSegment("t", 0, E1, LocalOffset(0), (A, B, C), bad)


def test_the_snapshot_keeps_each_segments_quorum_and_an_old_one_reads_as_the_sites() -> None:
    state = SiteState()
    for n in (A, B, C):
        state.apply(RegisterNode(n, f"127.0.0.1:{9000 + n}"))
    state.apply(CreateTopic(topic(None)))
    state.apply(ElectLeader("t", 0, A, LeaderEpoch(0)))
    state.apply(OpenSegment("t", 0, E1, LocalOffset(0), (A, B, C), 3))
    snap = state.snapshot()
    again = SiteState.restore(snap)
    info = again.partition(*KEY)
    assert info is not None and info.segments[0].ack_quorum == 3
    for p in snap["partitions"]:
        for s in p["segments"]:
            del s["ack_quorum"]
    info = SiteState.restore(snap).partition(*KEY)
    assert info is not None and info.segments[0].ack_quorum is None and info.segments[0].quorum(2) == 2


def test_a_lead_that_cannot_place_its_topics_quorum_says_why_until_the_quorum_is_lowered() -> None:
    """Two live nodes, the topic asks 3: no segment can open, and the lead keeps why, which the leader's broker
    answers produces with (NOT_ENOUGH_REPLICAS, gRPC UNAVAILABLE) rather than NOT_LEADER; altered to 2, the next
    retry opens a segment that records 2."""
    two_live = [NodeLoad(n, 1 << 40, 0, n != C, False) for n in (A, B, C)]
    lead = PartitionLead(A, KEY, E1, SITE.lead(topic(3)), None)
    info = PartitionInfo("t", 0, A, E1)
    out = lead.start(LeadContext(0, info, lambda: two_live))
    assert not any(isinstance(e, ProposeOpen) for e in out)
    assert lead.blocked is not None and "node 3 dead" in lead.blocked and "min_insync_replicas" in lead.blocked
    assert error_code(NotEnoughReplicas(lead.blocked)) == 19  # Kafka's NOT_ENOUGH_REPLICAS, which producers retry
    assert wire_status(NotEnoughReplicas(lead.blocked)) == (grpc.StatusCode.UNAVAILABLE, Reason.UNAVAILABLE)
    assert lead.retune(SITE.lead(topic(2)), 50) == []  # not writing: nothing to roll
    (propose,) = [e for e in lead.tick(LeadContext(1_000, info, lambda: two_live)) if isinstance(e, ProposeOpen)]
    assert propose.command.ack_quorum == 2 and len(propose.command.ensemble) == 2
    lead.opened(propose.command, Applied(segment_id=SegmentId(0)), LeadContext(1_000, info, lambda: two_live))
    assert lead.blocked is None
