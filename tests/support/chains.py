"""A partition's chain of segment copies on one node's store, for the ChainLog, follower-read and retention tests."""

from __future__ import annotations

from georep.storage.chain_log import ChainLog, ChainSegment
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from tests.support.segments import make_batch
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

A = Origin(SiteId("a"), 1)


KEY = ("t", 0)


EPOCH = LeaderEpoch(1)


def chain_of(store: ReplicaStore, held_first: bool) -> tuple[ChainLog, bytes]:
    """Segment 0 (offsets 0..2, sealed; held here only if ``held_first``) and segment 1, open, held here."""
    first = b""
    if held_first:
        store.open_segment(KEY, EPOCH, SegmentId(0), 0, {}, 0)
        b = make_batch(A, 0, [b"x", b"y"])
        stored = store.append_batch(KEY, EPOCH, SegmentId(0), b.header, b.body, 5)
        first = store.read(KEY, SegmentId(0), LocalOffset(0), 1 << 20).data
        assert stored.next_offset == 2
    store.open_segment(KEY, EPOCH, SegmentId(1), 2, {A: OriginSeq(2)}, 0)
    sealed = VectorOffset({A: 2})
    chain = [
        ChainSegment(SegmentId(0), 0, 2, sealed, (NodeId(1), NodeId(2))),
        ChainSegment(SegmentId(1), 2, None, None, (NodeId(3), NodeId(1))),
    ]
    return ChainLog(KEY, store, chain, EPOCH, sealed), first
