"""Idempotent producers across the leader changes of a multi-node site: the table each seal carries.

What a user relies on: an idempotent producer writing ``acks=all`` to a multi-node site never gets
``OutOfOrderSequence`` because the partition changed leader, and a batch it resends is never stored twice,
whichever node leads next, even one that holds none of the segments the producer last wrote to
(``cluster/producer_snapshot.py`` has the proof). The simulators check it under faults
(``tests/test_sim_cluster.py``, ``tests/test_sim_geo_cluster.py``); here, the rule on its own, the
metadata that carries it, and the node's two uses of it over real segment copies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cluster.producer_snapshot as producer_snapshot
from cluster.producer_snapshot import SNAPSHOT_ENTRIES_MAX, ProducerEntry, ProducerSnapshot, fold
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    SealSegment,
    SiteState,
    command_from_dict,
)
from dedup.producer import Append, Duplicate, OutOfOrderSequence, ProducerStateTable
from georep.metadata.topics import TopicSpec
from georep.raft.frames import COMMAND_BYTES_MAX
from georep.raft.store import command_bytes
from georep.server.cluster_member import seal_producers
from georep.server.site_cluster import leader_producers
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from tests.support.examples import examples
from tests.support.segments import make_batch
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

ORIGIN = Origin(SiteId("a"), 1)
OTHER = Origin(SiteId("b"), 9)
NOW = 1_700_000_000_000


@dataclass(frozen=True)
class Entry:
    """A batch as a log's index reports it (``ProducerBatch``)."""

    origin: Origin
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_offset_delta: int
    base_offset: LocalOffset
    base_origin_seq: OriginSeq
    append_time_ms: int


def _log(draws: list[tuple[int, int, int, bool]]) -> list[Entry]:
    """A partition's batches in log order: (producer, new epoch?, records, other origin?) per batch."""
    out: list[Entry] = []
    epoch: dict[int, int] = {}
    seq: dict[int, int] = {}
    offset = 0
    for producer, records, bump, other in draws:
        if bump % 7 == 0:
            epoch[producer] = epoch.get(producer, 0) + 1
            seq[producer] = 0
        base = seq.get(producer, 0)
        out.append(
            Entry(
                OTHER if other else ORIGIN,
                producer,
                epoch.get(producer, 0),
                base,
                records - 1,
                LocalOffset(offset),
                OriginSeq(offset),
                NOW + offset,
            )
        )
        seq[producer] = base + records
        offset += records
    return out


def _state(table: ProducerStateTable) -> dict[int, tuple[int, list[tuple[int, int, object]]]]:
    """What a table decides with: per producer, its epoch and its cached batches with their answers."""
    return {
        pid: (s.epoch, [(b.base_sequence, b.last_sequence, b.result) for b in s.batches])
        for pid, s in sorted(table._producers.items())
    }


# -- the fold -------------------------------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(0, 30), st.booleans()), max_size=60),
    st.lists(st.integers(0, 60), max_size=4),
)
def test_seals_folded_one_after_the_other_give_the_table_of_the_whole_chain(
    draws: list[tuple[int, int, int, bool]], cuts: list[int]
) -> None:
    """Segment after segment, each seal folds the previous one's snapshot and its own batches: a leader that starts
    from the last one decides every batch as the leader that held the whole chain would."""
    log = _log(draws)
    bounds = sorted({0, len(log), *(c for c in cuts if c <= len(log))})
    snapshot = ProducerSnapshot(ORIGIN)
    for start, end in itertools.pairwise(bounds):
        snapshot = fold(snapshot.entries, ORIGIN, log[start:end], now_ms=NOW)
    whole = ProducerStateTable.rebuild(log, origin=ORIGIN)
    assert _state(ProducerStateTable.rebuild(snapshot.entries, origin=ORIGIN)) == _state(whole)
    assert all(e.origin == ORIGIN for e in snapshot.entries)  # other sites' producers are theirs


def test_a_producer_idle_past_the_expiration_is_left_out_as_a_running_leader_drops_it() -> None:
    log = [
        Entry(ORIGIN, 1, 0, 0, 0, LocalOffset(0), OriginSeq(0), NOW),
        Entry(ORIGIN, 2, 0, 0, 0, LocalOffset(1), OriginSeq(1), NOW + 50),
    ]
    snapshot = fold((), ORIGIN, log, now_ms=NOW + 100, expiration_ms=60)
    assert [e.producer_id for e in snapshot.entries] == [2]


def test_past_the_bound_the_least_recently_active_producers_go_first_and_are_counted() -> None:
    log = [
        Entry(ORIGIN, pid, 0, seq, 0, LocalOffset(2 * pid + seq), OriginSeq(2 * pid + seq), NOW)
        for pid in range(6)
        for seq in range(2)
    ]
    snapshot = fold((), ORIGIN, log, now_ms=NOW, max_entries=8)
    kept = {(e.producer_id, e.base_sequence) for e in snapshot.entries}
    assert len(kept) == 8 and snapshot.left_out == 0
    assert {(pid, 1) for pid in range(6)} <= kept  # every producer keeps its last batch: it continues its sequence
    snapshot = fold((), ORIGIN, log, now_ms=NOW, max_entries=4)
    assert {(e.producer_id, e.base_sequence) for e in snapshot.entries} == {(5, 1), (4, 1), (3, 1), (2, 1)}
    assert snapshot.left_out == 2


# -- in the metadata ------------------------------------------------------------------------------------------


def _worst_snapshot() -> ProducerSnapshot:
    big = 2**63 - 1
    entries = tuple(
        ProducerEntry(ORIGIN, big - i, 32767, 2**31 - 1, 2**31 - 1, LocalOffset(big - i), OriginSeq(big - i), big)
        for i in range(SNAPSHOT_ENTRIES_MAX)
    )
    return ProducerSnapshot(ORIGIN, entries)


def test_a_seal_with_the_largest_snapshot_is_one_metadata_command() -> None:
    seal = SealSegment(
        "t", 0, LeaderEpoch(3), SegmentId(5), LocalOffset(10), VectorOffset({ORIGIN: 10}), 100, NOW, _worst_snapshot()
    )
    raw = seal.to_dict()
    assert command_from_dict(raw) == seal
    assert command_bytes(raw) < COMMAND_BYTES_MAX  # the log entry's size, as the Raft store measures it


def test_the_metadata_keeps_the_last_seals_snapshot_across_a_dump_and_an_older_seal_clears_it() -> None:
    state = _site()
    snapshot = ProducerSnapshot(ORIGIN, (ProducerEntry(ORIGIN, 7, 0, 0, 1, LocalOffset(0), OriginSeq(0), NOW),))
    info = state.partition("t", 0)
    assert info is not None and info.sealed_producers(ORIGIN) == ProducerSnapshot(ORIGIN)  # nothing sealed: empty
    assert isinstance(
        state.apply(
            SealSegment(
                "t", 0, LeaderEpoch(1), SegmentId(0), LocalOffset(2), VectorOffset({ORIGIN: 2}), producers=snapshot
            )
        ),
        Applied,
    )
    assert SiteState.restore(state.snapshot()).partition("t", 0) == state.partition("t", 0)
    info = state.partition("t", 0)
    assert info is not None and info.sealed_producers(ORIGIN) == snapshot
    state.apply(OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(2), (NodeId(1), NodeId(2))))
    state.apply(SealSegment("t", 0, LeaderEpoch(1), SegmentId(1), LocalOffset(2), VectorOffset({ORIGIN: 2})))
    info = state.partition("t", 0)
    assert info is not None and info.sealed_producers(ORIGIN) is None  # a node from before snapshots sealed it


def _site() -> SiteState:
    state = SiteState()
    for n in (1, 2, 3, 4):
        state.apply(RegisterNode(NodeId(n), f"127.0.0.1:{7000 + n}"))
        state.apply(NodeHeartbeat(NodeId(n), NOW, 1 << 40, 0))
    state.apply(CreateTopic(TopicSpec("t", 1)))
    state.apply(ElectLeader("t", 0, NodeId(1), LeaderEpoch(0)))
    state.apply(OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(0), (NodeId(1), NodeId(2), NodeId(3))))
    return state


# -- the node: a new leader that holds none of the producer's last segment ---------------------------------------


KEY = ("t", 0)
PID = 7


def _write(store: ReplicaStore, segment: int, base: int, sequences: list[int], epoch: int = 1) -> None:
    """The producer's batches of one record each (sequence ``s`` at origin seq and offset ``s``), as a leader's
    broker appends them to its copy."""
    store.open_segment(
        KEY, LeaderEpoch(epoch), SegmentId(segment), base, {ORIGIN: OriginSeq(base)} if base else {}, NOW
    )
    for s in sequences:
        batch = make_batch(ORIGIN, s, [b"v%d" % s], producer_id=PID, producer_epoch=0, base_sequence=s)
        store.append_batch(KEY, LeaderEpoch(epoch), SegmentId(segment), batch.header, batch.body, NOW + s)


def _chain_where_node_2_missed_the_last_segment(tmp_path: Path) -> tuple[SiteState, ReplicaStore]:
    """Node 1 writes segment 0 (sequences 0-2) on nodes 1-3, then segment 1 (sequences 3-5) on nodes 1, 3, 4 while
    node 2 is down, seals it in a roll, and is killed before it opens the next one: the controller names node 2,
    which holds segment 0 only."""
    writer, new_leader = ReplicaStore(tmp_path / "1", NOW), ReplicaStore(tmp_path / "2", NOW)
    state = _site()
    _write(writer, 0, 0, [0, 1, 2])
    _write(new_leader, 0, 0, [0, 1, 2])
    for segment, base, end, ensemble in ((0, 0, 3, (1, 2, 3)), (1, 3, 6, (1, 3, 4))):
        if segment == 1:
            assert isinstance(
                state.apply(OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(base), tuple(NodeId(n) for n in ensemble))),
                Applied,
            )
            _write(writer, 1, 3, [3, 4, 5])
        info = state.partition(*KEY)
        assert info is not None
        producers = seal_producers(writer, info, SegmentId(segment), base, end, ORIGIN, NOW + 10)
        assert isinstance(
            state.apply(
                SealSegment(
                    "t",
                    0,
                    LeaderEpoch(1),
                    SegmentId(segment),
                    LocalOffset(end),
                    VectorOffset({ORIGIN: end}),
                    producers=producers,
                )
            ),
            Applied,
        )
    assert isinstance(state.apply(ElectLeader("t", 0, NodeId(2), LeaderEpoch(1))), Applied)
    assert isinstance(
        state.apply(OpenSegment("t", 0, LeaderEpoch(2), LocalOffset(6), (NodeId(2), NodeId(3), NodeId(4)))), Applied
    )
    new_leader.open_segment(KEY, LeaderEpoch(2), SegmentId(2), 6, {ORIGIN: OriginSeq(6)}, NOW)
    writer.close()
    return state, new_leader


def _table_of_node_2(tmp_path: Path) -> ProducerStateTable:
    state, store = _chain_where_node_2_missed_the_last_segment(tmp_path)
    info = state.partition(*KEY)
    assert info is not None
    try:
        return leader_producers(store, info, SegmentId(2), ORIGIN, NOW + 20)
    finally:
        store.close()


def test_a_new_leader_that_missed_the_producers_last_segment_continues_its_sequence(tmp_path: Path) -> None:
    table = _table_of_node_2(tmp_path)
    assert table.check(PID, 0, 6, 6, NOW) == Append()  # the producer's next batch
    resent = table.check(PID, 0, 5, 5, NOW)  # a batch it resends: it was stored in segment 1, on other nodes
    assert isinstance(resent, Duplicate) and resent.result.base_offset == 5


def test_the_rule_before_issue_21_refused_the_producers_next_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule before issue 21: a new leader rebuilt its table from the copies it held (``history_at_open``
    ignoring the seal's snapshot). Node 2 then knows the producer only up to sequence 2."""
    monkeypatch.setattr(producer_snapshot, "history_at_open", lambda sealed, held: held())  # PLANTED
    monkeypatch.setattr("georep.server.site_cluster.history_at_open", producer_snapshot.history_at_open)
    monkeypatch.setattr("georep.server.cluster_member.history_at_open", producer_snapshot.history_at_open)
    table = _table_of_node_2(tmp_path)
    assert isinstance(table.check(PID, 0, 6, 6, NOW), OutOfOrderSequence)  # the spurious refusal the storm saw
