"""``ChainLog``: a partition a multi-node site's leader serves, over its segment copies (georep/storage/chain_log.py).

Durable means confirmed by the ack quorum: readers see nothing past the LAC, and the vector there advances only
as the LAC passes each batch. A segment this node holds no copy of is read from a member, through the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from georep.record.batch import iter_headers
from georep.replication.source import ReplicaSource
from georep.storage.chain_log import ChainLog, ChainSegment, SegmentElsewhere
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import LocalOffset, OriginSeq
from offsets.vector import VectorOffset
from tests.support.chains import EPOCH, KEY, A, chain_of
from tests.support.segments import make_batch
from topology.ids import NodeId, SegmentId


def test_readers_see_only_what_the_quorum_confirmed_and_the_vector_follows_the_lac(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, now_ms=0)
    try:
        log, _ = chain_of(store, held_first=True)
        for seq in (2, 5):
            b = make_batch(A, seq, [b"1", b"2", b"3"])
            log.append(b.header, b.body, 10)
        assert log.log_end_offset == 8 and log.vector() == {A: 8}
        assert log.flushed_offset == 2 and log.flushed_vector() == {A: 2}  # nothing confirmed yet
        assert log.advance_lac(5) and log.flushed_offset == 5 and log.flushed_vector() == {A: 5}
        assert not log.advance_lac(4), "the LAC never moves back"
        assert log.advance_lac(8) and log.flushed_vector() == {A: 8}
        # Lookups by coordinate go to the segment whose sealed end vector covers it.
        assert log.offset_for_origin_seq(A, OriginSeq(1)) == 0
        assert log.offset_for_origin_seq(A, OriginSeq(6)) == 5
        assert [e.base_offset for e in log.batch_entries()] == [0, 2, 5]
    finally:
        store.close()


def test_a_segment_held_elsewhere_is_named_then_served_from_the_cache(tmp_path: Path) -> None:
    holder = ReplicaStore(tmp_path / "member", now_ms=0)
    store = ReplicaStore(tmp_path / "leader", now_ms=0)
    try:
        _, first = chain_of(holder, held_first=True)
        log, _ = chain_of(store, held_first=False)
        with pytest.raises(SegmentElsewhere) as missing:
            log.read(LocalOffset(0), 1 << 20)
        assert missing.value.segment.ensemble == (1, 2) and missing.value.offset == 0
        # A lookup cannot look inside it: it answers the segment's base, where a reader dropping what its
        # vector covers starts exactly.
        assert log.offset_for_origin_seq(A, OriginSeq(1)) == 0
        log.cache_remote(SegmentId(0), 0, first)
        got = log.read(LocalOffset(0), 1 << 20)
        assert got.data == first and got.next_offset == 2
        assert log.read(LocalOffset(2), 1 << 20).data == b""  # the open segment, empty
    finally:
        store.close()
        holder.close()


def test_a_replication_source_stops_at_a_segment_held_elsewhere_keeping_what_it_gathered(tmp_path: Path) -> None:
    """A cross-site pull over a leader that lacks sealed segment 1: its cursor stops there without losing the
    batches of segment 0 it gathered in the same step, the range is read from a member (as a fetch does), and
    every batch reaches the destination once, in order."""
    here = ReplicaStore(tmp_path / "leader", now_ms=0)
    member = ReplicaStore(tmp_path / "member", now_ms=0)
    try:
        here.open_segment(KEY, EPOCH, SegmentId(0), 0, {}, 0)
        member.open_segment(KEY, EPOCH, SegmentId(1), 2, {A: OriginSeq(2)}, 0)
        here.open_segment(KEY, EPOCH, SegmentId(2), 5, {A: OriginSeq(5)}, 0)
        for store, sid, seq, n in ((here, 0, 0, 2), (member, 1, 2, 3)):
            b = make_batch(A, seq, [b"v%d" % i for i in range(n)])
            store.append_batch(KEY, EPOCH, SegmentId(sid), b.header, b.body, 5)
        chain = [
            ChainSegment(SegmentId(0), 0, 2, VectorOffset({A: 2}), (NodeId(1),)),
            ChainSegment(SegmentId(1), 2, 5, VectorOffset({A: 5}), (NodeId(2),)),
            ChainSegment(SegmentId(2), 5, None, None, (NodeId(1), NodeId(2))),
        ]
        log = ChainLog(KEY, here, chain, EPOCH, VectorOffset({A: 5}))
        b = make_batch(A, 5, [b"w0", b"w1", b"w2"])
        log.append(b.header, b.body, 5)
        assert log.advance_lac(8)
        source = ReplicaSource({KEY: log}, {KEY: ({}, ("a",))})
        sent: list[int] = []
        for _ in range(10):
            with log.deferring_elsewhere() as missing:
                step = source.step(0, 1 << 20)
            sent += [h.base_offset for c in step.chunks for h in iter_headers(c.batches)]
            for m in missing:  # what SiteCluster.read_elsewhere does, from the member's copy
                log.cache_remote(
                    m.segment.segment_id,
                    m.offset,
                    member.read(KEY, m.segment.segment_id, LocalOffset(m.offset), 1 << 20, 5).data,
                )
        assert sent == [0, 2, 5], "a batch was lost or sent twice around the segment held elsewhere"
        with pytest.raises(SegmentElsewhere):  # outside the context, a reader is told as before
            ChainLog(KEY, here, chain, EPOCH, VectorOffset({A: 5})).read(LocalOffset(2), 1 << 20)
    finally:
        here.close()
        member.close()
