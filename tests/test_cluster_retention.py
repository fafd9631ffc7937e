"""Retention on a multi-node site: TrimChain (cluster/site_state.py) and its planner (cluster/retention.py)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cluster.retention import plan_retention
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    PartitionInfo,
    RefusalCode,
    RegisterNode,
    ReplaceMember,
    SealSegment,
    SegmentInfo,
    SiteState,
    TrimChain,
    command_from_dict,
)
from georep.metadata.topics import TopicSpec
from georep.record.batch import iter_headers
from georep.storage.api import OffsetOutOfRange
from georep.storage.replica_store import NEW_SUFFIX, ReplicaError, ReplicaStore, partition_dir_name
from offsets.coordinates import LocalOffset, Origin
from offsets.vector import VectorOffset
from tests.support.examples import examples
from tests.support.segments import make_batch
from tests.support.site_state import applied, refused
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))
E1 = LeaderEpoch(1)
A = Origin.parse("a@1")


def chain(
    segments: list[tuple[int, int | None, int | None]], config: dict[str, int] | None = None, open_last: bool = True
) -> SiteState:
    """Topic t (one partition) led by node 1, with one sealed segment per ``(records, size_bytes, max_ts)``, each
    record one origin seq of a@1, then an open segment (``open_last``)."""
    state = SiteState()
    for node in (N1, N2, N3, N4):
        applied(state, RegisterNode(node, f"10.0.0.{node}:9092"))
        applied(state, NodeHeartbeat(node, 1_000, 1 << 40, 0))
    applied(state, CreateTopic(TopicSpec("t", 1, config or {})))
    applied(state, ElectLeader("t", 0, N1, LeaderEpoch(0)))
    end = 0
    for i, (records, size, max_ts) in enumerate(segments):
        applied(state, OpenSegment("t", 0, E1, LocalOffset(end), (N1, N2, N3)))
        end += records
        applied(state, SealSegment("t", 0, E1, SegmentId(i), LocalOffset(end), VectorOffset({A: end}), size, max_ts))
    if open_last:
        applied(state, OpenSegment("t", 0, E1, LocalOffset(end), (N1, N2, N3)))
    return state


def part(state: SiteState) -> PartitionInfo:
    info = state.partition("t", 0)
    assert info is not None
    return info


# -- the command --------------------------------------------------------------------------------------------


def test_trim_chain_drops_a_sealed_prefix_and_moves_the_start_forward_only() -> None:
    state = chain([(5, 100, 10), (3, 60, 20), (4, 80, 30)])
    applied(state, TrimChain("t", 0, SegmentId(2)))
    info = part(state)
    assert [s.segment_id for s in info.segments] == [2, 3]
    assert info.segments[0].base_offset == 8, "the log start is the first kept segment's base"
    assert info.start_vector == VectorOffset({A: 8}), "the chain's start vector is the dropped prefix's end vector"
    assert info.sealed_vector_before(SegmentId(2)) == VectorOffset({A: 8})

    again = applied(state, TrimChain("t", 0, SegmentId(2)))
    assert again.changed is False, "a repeat is a no-op"
    assert applied(state, TrimChain("t", 0, SegmentId(1))).changed is False, "the start never moves back"
    refused(state, TrimChain("t", 0, SegmentId(9)), RefusalCode.LAST_SEGMENT)
    refused(state, TrimChain("nope", 0, SegmentId(1)), RefusalCode.UNKNOWN_TOPIC)
    refused(state, ReplaceMember("t", 0, SegmentId(0), N2, N4), RefusalCode.UNKNOWN_SEGMENT)

    # Trimming up to the open segment keeps it; the next roll goes on from it, ids and offsets unchanged.
    applied(state, TrimChain("t", 0, SegmentId(3)))
    applied(state, SealSegment("t", 0, E1, SegmentId(3), LocalOffset(14), VectorOffset({A: 14}), 50, 40))
    assert applied(state, OpenSegment("t", 0, E1, LocalOffset(14), (N1, N2))).segment_id == 4


def test_a_trimmed_state_survives_its_snapshot_and_older_snapshots_and_logs_still_read() -> None:
    state = chain([(5, 100, 10), (3, None, None)])
    applied(state, TrimChain("t", 0, SegmentId(1)))
    snap = json.loads(json.dumps(state.snapshot()))
    assert SiteState.restore(snap) == state
    assert part(SiteState.restore(snap)).start_vector == VectorOffset({A: 5})

    untrimmed = chain([(5, None, None)])
    snap = untrimmed.snapshot()
    assert "start_vector" not in snap["partitions"][0], "an untrimmed partition snapshots as before"
    assert "size_bytes" not in snap["partitions"][0]["segments"][0]

    old_seal = {
        "v": 1,
        "kind": "seal_segment",
        "topic": "t",
        "partition": 0,
        "epoch": 1,
        "segment_id": 0,
        "end_offset": 5,
        "end_vector": {"a@1": 5},
    }
    decoded = command_from_dict(old_seal)
    assert isinstance(decoded, SealSegment) and decoded.size_bytes is None and decoded.max_timestamp_ms is None
    assert decoded.to_dict() == old_seal, "a seal without size or timestamp encodes as before"
    trim = TrimChain("t", 0, SegmentId(3))
    assert command_from_dict(json.loads(json.dumps(trim.to_dict()))) == trim
    full = SealSegment("t", 0, E1, SegmentId(0), LocalOffset(5), VectorOffset({A: 5}), 123, 456)
    assert command_from_dict(json.loads(json.dumps(full.to_dict()))) == full


# -- the planner --------------------------------------------------------------------------------------------


def test_plan_retention_by_time_and_by_size() -> None:
    segs: list[tuple[int, int | None, int | None]] = [(5, 100, 1_000), (3, 100, 2_000), (4, 100, 3_000)]
    by_time = chain(segs, {"retention_ms": 1_000})
    assert plan_retention(by_time, now_ms=2_500) == [TrimChain("t", 0, SegmentId(1))]
    assert plan_retention(by_time, now_ms=3_001) == [TrimChain("t", 0, SegmentId(2))]
    assert plan_retention(by_time, now_ms=99_000) == [TrimChain("t", 0, SegmentId(3))], "never the open segment"
    assert plan_retention(by_time, now_ms=2_000) == []

    by_size = chain(segs, {"retention_bytes": 150})
    assert plan_retention(by_size, now_ms=0) == [TrimChain("t", 0, SegmentId(2))], "300 B -> 100 B"
    assert plan_retention(chain(segs, {"retention_bytes": 150}, open_last=False), now_ms=0) == [
        TrimChain("t", 0, SegmentId(2))
    ], "without an open segment the last sealed one stays"
    assert plan_retention(chain(segs), now_ms=99_000) == [], "no retention configured"
    assert plan_retention(chain(segs), now_ms=99_000, defaults={"retention_ms": 0}) == [
        TrimChain("t", 0, SegmentId(3))
    ], "the site's defaults apply"
    unknown: list[tuple[int, int | None, int | None]] = [(5, None, None), (3, 100, 2_000)]
    assert plan_retention(chain(unknown, {"retention_ms": 0, "retention_bytes": 0}), now_ms=99_000) == [], (
        "a segment sealed without size or timestamp is never dropped on a guess"
    )


SEGMENT = st.tuples(
    st.integers(0, 5), st.one_of(st.none(), st.integers(0, 500)), st.one_of(st.none(), st.integers(0, 10_000))
)


@settings(max_examples=examples(300), deadline=None)
@given(
    segments=st.lists(SEGMENT, max_size=8),
    open_last=st.booleans(),
    retention_ms=st.integers(-1, 10_000),
    retention_bytes=st.integers(-1, 2_000),
    now_ms=st.integers(0, 20_000),
    trims=st.integers(1, 3),
)
def test_plan_retention_properties(
    segments: list[tuple[int, int | None, int | None]],
    open_last: bool,
    retention_ms: int,
    retention_bytes: int,
    now_ms: int,
    trims: int,
) -> None:
    # An empty segment holds no batch: no size but 0, no timestamp.
    segments = [(n, 0 if n == 0 else size, None if n == 0 else ts) for n, size, ts in segments]
    if not segments and not open_last:
        return
    state = chain(segments, {"retention_ms": retention_ms, "retention_bytes": retention_bytes}, open_last)
    for _ in range(trims):  # planning again after applying its plan goes on from the new start, or stops
        before = part(state)
        plan = plan_retention(state, now_ms)
        note(f"plan {plan}")
        assert len(plan) <= 1
        for command in plan:
            assert isinstance(state.apply(command), Applied)
        check_trim(before, part(state), retention_ms, retention_bytes, now_ms)


def check_trim(
    before: PartitionInfo, after: PartitionInfo, retention_ms: int, retention_bytes: int, now_ms: int
) -> None:
    kept, dropped = after.segments, before.segments[: len(before.segments) - len(after.segments)]
    # A prefix goes, never the last segment, and the chain stays contiguous from its new start.
    assert kept == before.segments[len(dropped) :]
    assert kept and kept[-1] == before.segments[-1], "the last segment (the open one, if any) always stays"
    for prev, nxt in pairwise(kept):
        assert prev.end_offset == nxt.base_offset
    if dropped:
        assert kept[0].base_offset == dropped[-1].end_offset
        assert after.start_vector == dropped[-1].end_vector
    else:
        assert after.start_vector == before.start_vector
    if retention_ms < 0 and retention_bytes < 0:
        assert not dropped, "no retention, nothing dropped"
    # The partition's size is its sealed segments' (the open one's is not in the metadata); an unknown one
    # switches the size rule off.
    sealed_sizes = [s.size_bytes for s in before.segments if s.sealed]
    total = sum(size or 0 for size in sealed_sizes)

    def expired(segment: SegmentInfo) -> bool:
        if retention_ms < 0:
            return False
        if segment.max_timestamp_ms is None:
            return segment.size_bytes == 0  # empty: nothing to keep
        return segment.max_timestamp_ms < now_ms - retention_ms  # never one younger than retention_ms

    for segment in dropped:
        assert segment.sealed
        oversize = retention_bytes >= 0 and None not in sealed_sizes and total > retention_bytes
        assert expired(segment) or oversize, f"segment {segment.segment_id} dropped though neither rule allows it"
        total -= segment.size_bytes or 0
    # As much as the rules allow: the first kept segment (unless the last) breaks both.
    if len(kept) > 1:
        oversize = retention_bytes >= 0 and None not in sealed_sizes and total > retention_bytes
        assert not (expired(kept[0]) or oversize), f"segment {kept[0].segment_id} should have been dropped too"


# -- a node following a trim: its copies and its ChainLog -----------------------------------------------------


def test_a_trim_deletes_the_copies_before_it_and_moves_the_chain_logs_start(tmp_path: Path) -> None:
    from tests.support.chains import KEY, chain_of

    store = ReplicaStore(tmp_path, now_ms=0)
    try:
        log, _ = chain_of(store, held_first=True)
        b = make_batch(A, 2, [b"z"])
        log.append(b.header, b.body, 10)
        log.advance_lac(3)
        assert log.log_start_offset == 0 and log.read(LocalOffset(0), 1 << 20).data
        summary = store.seal_summary(KEY, SegmentId(0), {}, 2)
        newest = max(h.max_timestamp for h in iter_headers(store.read(KEY, SegmentId(0), LocalOffset(0), 1 << 20).data))
        assert (summary.end_vector, summary.max_timestamp_ms) == (VectorOffset({A: 2}), newest)
        assert summary.size_bytes == store.size_of(KEY, SegmentId(0)) > 0

        assert store.trim(KEY, SegmentId(1)) == [SegmentId(0)]
        assert store.segment_ids(KEY) == [SegmentId(1)]
        assert not (tmp_path / "replicas" / partition_dir_name(KEY) / "0000000000").exists()
        assert store.trim(KEY, SegmentId(1)) == [], "a repeat deletes nothing"
        assert log.log_start_offset == 2 and log.segment_count == 1
        with pytest.raises(OffsetOutOfRange):
            log.read(LocalOffset(0), 1 << 20)
        assert log.read(LocalOffset(2), 1 << 20).data, "the rest is served as before"
        with pytest.raises(ReplicaError, match="retention"):
            store.open_sealed_copy(KEY, SegmentId(0), 0, {}, 0)  # a repair planned before the trim
        assert store.copy(KEY, SegmentId(1)) is not None, "the open segment stays"
    finally:
        store.close()
    # A deletion a crash interrupted (renamed, not yet removed) is cleaned at the next start.
    partition = tmp_path / "replicas" / partition_dir_name(KEY)
    (partition / ("0000000000.trimmed" + NEW_SUFFIX)).mkdir()
    reopened = ReplicaStore(tmp_path, now_ms=0)
    try:
        assert reopened.segment_ids(KEY) == [SegmentId(1)]
        assert not any(p.name.endswith(NEW_SUFFIX) for p in partition.iterdir())
    finally:
        reopened.close()
