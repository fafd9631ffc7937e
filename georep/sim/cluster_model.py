"""What the segment-cluster simulator (``cluster.py``) stores and counts, and the shapes of its runs.

Kept apart from the simulator so that the checker (``cluster_checks.py``) and the tests can use the
same types without the event loop: a batch, one node's copy of a segment, the shape of a run (nodes,
topics, replication factor, ack quorum, which faults), and the counts of what happened.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from typing import NamedTuple

from topology.ids import SegmentId

PartKey = tuple[str, int]  # (topic, partition)
SegKey = tuple[str, int, SegmentId]  # (topic, partition, segment id)

START_MS = 1_700_000_000_000  # virtual time starts at a realistic Unix time
GIB = 1 << 30


class Batch(NamedTuple):
    """A batch of ``records`` records at local ``offset``; ``payload`` names it (the producer's batch id). An
    idempotent producer's batch carries its producer id and base sequence (``producer`` -1: none), and the time
    its leader appended it: what a leader's producer table keeps of it."""

    offset: int
    records: int
    payload: int
    producer: int = -1
    sequence: int = 0
    append_ms: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.records


@dataclass(slots=True)
class SegCopy:
    """One node's copy of one segment: batches contiguous from ``base``, the first ``fsynced`` on disk."""

    base: int
    batches: list[Batch] = field(default_factory=list)
    fsynced: int = 0  # how many of ``batches`` are fsynced (a crash keeps exactly those)
    via_repair: bool = False  # the copy was started by a repair copy (not by the writer or a recovery)

    @property
    def end(self) -> int:
        return self.batches[-1].end if self.batches else self.base

    @property
    def fsynced_end(self) -> int:
        return self.batches[self.fsynced - 1].end if self.fsynced else self.base

    def index_at(self, offset: int) -> int:
        """The index of the batch that starts at ``offset``, or -1."""
        i = bisect_left(self.batches, offset, key=lambda b: b.offset)
        return i if i < len(self.batches) and self.batches[i].offset == offset else -1

    def read(self, start: int, end: int, *, fsynced_only: bool = False) -> list[Batch]:
        """The batches that lie in ``[start, end)``."""
        limit = self.fsynced if fsynced_only else len(self.batches)
        i = bisect_left(self.batches, start, 0, limit, key=lambda b: b.offset)
        out: list[Batch] = []
        for j in range(i, limit):
            b = self.batches[j]
            if b.end > end:
                break
            out.append(b)
        return out


# -- shapes ----------------------------------------------------------------------------------------------

SHAPES = ("single3", "expand5", "rf2", "meta")


class UnknownShape(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown cluster simulator shape {name!r}: use one of {', '.join(SHAPES)}")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One run's cluster and fault settings, drawn from the seed by :func:`shape_config`."""

    shape: str
    nodes: int  # at the start
    add_node: bool  # expansion: one more node joins during the safety phase
    topics: tuple[tuple[str, int], ...]  # (name, partitions), sorted
    rf: int  # replication_factor: the ensemble size, while that many nodes are live
    aq: int  # min_insync_replicas: the ack quorum, and the smallest ensemble a segment opens on
    single_loss: bool  # at most one node down (killed or paused) at a time; C1 must hold with no excuse
    max_down: int  # nodes down (killed or paused) at once
    meta_faults: bool  # Raft stalls and lost proposals (besides losing the majority)
    kill_every_ms: int
    down_ms: tuple[int, int]
    pause_every_ms: int
    pause_ms: tuple[int, int]
    cut_every_ms: int  # a stream cut: the rest of what is in flight on a pair of links is lost
    partition_every_ms: int  # a pair of nodes cannot talk for a while
    partition_ms: tuple[int, int]
    isolate_every_ms: int  # a node is cut off from the metadata majority (not from its peers): a zombie leader
    isolate_ms: tuple[int, int]
    meta_outage_every_ms: int
    meta_outage_ms: tuple[int, int]
    latency_ms: tuple[int, int]
    fsync_ms: tuple[int, int]
    roll_records: int  # a leader rolls its open segment once it holds this many records
    roll_kill_p: float = 0.25  # the chance that a leader is killed right after its roll's seal commits
    # (ms after the start, topic, its min_insync_replicas then, None: the site's): operators' alters (issue 23)
    quorum_alters: tuple[tuple[int, str, int | None], ...] = ()
    safety_ms: int = 9_000
    liveness_ms: int = 25_000
    max_events: int = 400_000
    tick_ms: int = 100  # a node's heartbeat, metadata refresh and housekeeping
    session_timeout_ms: int = 700
    raft_ms: tuple[int, int] = (2, 8)  # a proposal's commit latency
    proposal_timeout_ms: int = 250  # the proposer gives up (the command may still commit: ambiguous)
    view_lag_ms: tuple[int, int] = (1, 6)  # a node applies a committed leadership or segment change this late
    detect_ms: int = 30  # a sender notices a broken stream
    reconnect_ms: int = 60
    fence_timeout_ms: int = 150
    copy_timeout_ms: int = 250
    retry_ms: int = 150  # a leader retries a failed recovery or placement
    roll_wait_ms: int = 150  # a rolling leader waits this long for the LAC to reach what it appended
    produce_ms: tuple[int, int] = (15, 90)
    records_per_batch: tuple[int, int] = (1, 3)
    max_in_flight: int = 3
    request_timeout_ms: int = 400
    backoff_ms: tuple[int, int] = (10, 60)
    read_ms: tuple[int, int] = (10, 40)
    repair_every_ms: int = 200
    repair_delay_ms: int = 1_500
    max_concurrent_copies: int = 2
    record_bytes: int = 64 << 20  # what one record weighs on a disk (free bytes for placement)
    capacity_bytes: int = 200 * GIB

    def partition_keys(self) -> list[PartKey]:
        return [(t, p) for t, n in self.topics for p in range(n)]

    def describe(self) -> str:
        topics = ",".join(f"{t}:{n}" for t, n in self.topics)
        return (
            f"shape={self.shape} nodes={self.nodes}{'+1' if self.add_node else ''} rf={self.rf} aq={self.aq} "
            f"topics={topics} max_down={self.max_down}{' single-loss' if self.single_loss else ''}"
            f"{' meta-faults' if self.meta_faults else ''} roll={self.roll_records}"
        )


def _topics(rng: random.Random) -> tuple[tuple[str, int], ...]:
    if rng.random() < 0.5:
        return (("orders", rng.randint(2, 3)),)
    return (("audit", rng.randint(1, 2)), ("orders", rng.randint(1, 2)))


def _draw(
    rng: random.Random,
    shape: str,
    nodes: int,
    add_node: bool,
    topics: tuple[tuple[str, int], ...],
    rf: int,
    aq: int,
    single_loss: bool,
    max_down: int,
    meta_faults: bool,
) -> ClusterConfig:
    return ClusterConfig(
        shape,
        nodes,
        add_node,
        topics,
        rf,
        aq,
        single_loss,
        max_down,
        meta_faults,
        kill_every_ms=rng.choice((700, 1_200, 2_000)),
        down_ms=(100, rng.choice((600, 1_500, 3_000))),
        pause_every_ms=rng.choice((1_500, 3_000)),
        pause_ms=(50, rng.choice((400, 1_200))),
        cut_every_ms=rng.choice((200, 500, 1_200)),
        partition_every_ms=rng.choice((800, 2_000)),
        partition_ms=(50, rng.choice((300, 1_200))),
        isolate_every_ms=rng.choice((1_000, 2_500)),
        isolate_ms=(300, rng.choice((1_000, 2_000))),
        meta_outage_every_ms=rng.choice((600, 1_500)) if meta_faults else 0,
        meta_outage_ms=(50, rng.choice((400, 1_200))) if meta_faults else (0, 0),
        latency_ms=(1, rng.choice((2, 5, 12))),
        fsync_ms=(1, rng.choice((4, 10, 25))),
        roll_records=rng.choice((8, 20, 45)),
    )


def shape_config(shape: str, rng: random.Random) -> ClusterConfig:
    """The run's settings for ``shape``, drawn from ``rng`` (the run's only randomness).

    * ``single3``: 3 nodes, RF 3, AQ 2, at most one node down at a time (C1 must hold with no excuse);
    * ``expand5``: 4 nodes and a fifth that joins mid-run, RF 3, AQ 2, up to two nodes down;
    * ``rf2``: 3 to 5 nodes, RF 2, AQ 1, one or two nodes down;
    * ``meta``: 3 to 5 nodes, RF 2..3, AQ 1..RF, Raft stalls and lost proposals, and up to all nodes but
      one down (so the metadata loses its majority); some runs add a node.
    """
    if shape not in SHAPES:
        raise UnknownShape(shape)
    topics = _topics(rng)
    if shape == "single3":
        return _draw(rng, shape, 3, False, topics, 3, 2, True, 1, False)
    if shape == "expand5":
        return _draw(rng, shape, 4, True, topics, 3, 2, False, 2, False)
    nodes = rng.randint(3, 5)
    if shape == "rf2":
        return _draw(rng, shape, nodes, False, topics, 2, 1, False, rng.randint(1, 2), False)
    rf = rng.randint(2, min(3, nodes))
    return _draw(rng, shape, nodes, rng.random() < 0.3, topics, rf, rng.randint(1, rf), False, nodes - 1, True)


# -- counts ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ClusterCounts:
    """What happened in one run; the tests use these to prove that the faults and the protocol paths ran."""

    kills: int = 0
    restarts: int = 0
    pauses: int = 0
    lost_batches: int = 0  # unfsynced batches that kills threw away
    stream_cuts: int = 0
    partitions: int = 0
    isolations: int = 0  # a node cut off from the metadata: its proposals are lost and its view freezes
    zombie_appends: int = 0  # appends a member got from a leader whose epoch the metadata had already replaced
    dropped_messages: int = 0
    meta_outages: int = 0
    no_majority: int = 0  # proposals held back because a majority of the voters was down
    proposals_lost: int = 0  # the proposer gave up (timeout), and the command never committed
    proposals_late: int = 0  # the proposer gave up, and the command committed later (ambiguous)
    elections: int = 0  # ElectLeader applied, and partitions a FailOver moved
    failovers: int = 0  # FailOver applied (each moves every partition of one dead leader)
    elections_refused: int = 0  # ElectLeader refused (a stale plan: the compare-and-set on the epoch)
    reelections: int = 0  # a node re-elected itself (restarted leader, or a superseded recovery)
    recoveries: int = 0
    recoveries_done: int = 0
    recoveries_failed: int = 0
    recoveries_superseded: int = 0
    recovery_copies: int = 0
    recovered_tails: int = 0  # recoveries whose end was past the LAC the old leader had reached
    tail_cuts: int = 0  # members that cut their copy after a seal
    opens: int = 0
    opens_short: int = 0  # segments opened on fewer than RF nodes (fewer were live), down to the ack quorum
    acked_short: int = 0  # acks released in such a segment: writes went on with a node down
    seals: int = 0
    rolls_by_size: int = 0
    rolls_by_repair: int = 0
    rolls_to_widen: int = 0  # the controller asked a leader to roll a short open segment (a node can join now)
    placement_waits: int = 0  # placement could not find enough eligible nodes yet
    quorum_rolls: int = 0  # open segments rolled because their topic's min_insync_replicas changed
    quorum_lost: int = 0
    fenced_appends: int = 0  # appends a member refused as fenced (a deposed leader)
    gaps: int = 0  # a member asked its leader to resend from its end
    resends: int = 0
    step_downs: int = 0
    repair_copies: int = 0
    repair_copies_failed: int = 0
    members_replaced: int = 0
    members_added: int = 0  # AddMember applied: a short sealed segment copied to one more node
    fills: int = 0  # sealed segments re-filled on a member that held less than the sealed end
    fills_failed: int = 0  # (a stale report: the source was short too, or the fill timed out)
    produced: int = 0
    retries: int = 0
    acked: int = 0  # acks released at the LAC
    dedup_hits: int = 0  # a retried batch the partition already held (the leader's producer table said Duplicate)
    out_of_order: int = 0  # answers OutOfOrderSequence: each a gap an earlier refusal of the same round left
    roll_kills: int = 0  # a leader killed after its roll's seal committed, before it opened the next segment
    leaders_missing_history: int = 0  # a leader started a segment without a whole copy of the last sealed one
    reads: int = 0
    read_batches: int = 0
    nodes_added: int = 0
    budget_exceeded: int = 0  # C1 below the ack quorum after more member crashes than RF - AQ (reported only)

    def add(self, other: ClusterCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
