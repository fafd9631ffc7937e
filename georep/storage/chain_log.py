"""A partition of a multi-node site, as its leader node serves it: a chain of segments. Shell.

Inside a multi-node site a partition is a chain of segments, each stored by
its own ensemble (ARCHITECTURE.md, "Inside a site"; docs/cluster.md). The
leader node's broker needs the partition as one ``PartitionLog``, so that
the origin append (``georep/broker/append.py``), the fetch cursor, the
replication source and the apply of replicated chunks run unchanged. A
:class:`ChainLog` is that view, over the leader's
:class:`~georep.storage.replica_store.ReplicaStore` and the site's metadata:

* **Appends** go to the leader's copy of the open segment, through the
  store's guard, so a leader that a newer one fenced appends nothing. The
  broker then tells the segment's writer, which streams the copy to the
  other members (``georep/server/ensemble.py``).
* **What counts as durable is the LAC.** ``flushed_offset`` is the last add
  confirmed: what ``min_insync_replicas`` members hold fsynced, and
  ``flushed_vector`` the partition's vector there. Readers, consumers and
  other sites are served only below ``flushed_offset`` (the rule that on a
  one-node site serves only fsynced batches), so nothing a reader saw can be
  cut by a new leader's recovery. ``flush`` is this node's own fsync, one
  member's share of the quorum.
* **The vector at the LAC** is the sealed end vector of the segment before
  the open one (from the metadata), advanced by each appended batch as the
  LAC passes its end. The batches above the LAC are kept as (end offset,
  origin, next seq) only: no batch is read back.
* **Reads** go to the copy of the segment that holds the offset. A segment
  this node holds no copy of (placement spreads a partition's segments over
  the site) raises :class:`SegmentElsewhere`, which names its members; the
  node reads it from one of them (``georep/server/site_cluster.py``) and puts
  the bytes in :meth:`ChainLog.cache_remote`, and the read is tried again.
  Sealed segments never change, so a cached range stays right.
* **Lookups by coordinate** use each sealed segment's end vector to find the
  segment that holds an origin seq, then that segment's origin index when
  this node holds it, or the segment's base (a reader starting there drops
  what its vector covers, so starting early is exact, only slower).

**Follower reads.** :class:`FollowerLog` is the same chain as a node that
does not lead the partition serves it to consumers: read-only, and served
only below :func:`cluster.follower_reads.follower_bound` (sealed segments to
their seals, the open one to the LAC its leader announced to this node).

A ``ChainLog`` lives as long as one open segment: when the leader rolls or
loses the partition, the broker drops it and builds the next one from the
new metadata. So its chain never changes under it, but for its start:
retention drops a prefix of sealed segments through the metadata
(``TrimChain``), the node records it in its store as it deletes its copies
(``ReplicaStore.trim``), and ``log_start_offset`` follows at once, so reads
below it are out of range as after a one-node site's retention.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cluster.follower_reads import FollowerBound, SegmentBounds, follower_bound
from georep.record.batch import BatchHeader, iter_headers
from georep.storage.api import (
    BatchEntry,
    BytesLike,
    DamagedBatch,
    OffsetOutOfRange,
    ReadResult,
    ScrubStep,
    SegmentBatches,
    StorageError,
)
from georep.storage.replica_store import PartitionKey, ReplicaStore
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

REMOTE_CACHE_BYTES = 64 << 20  # per partition: ranges of segments read from other nodes


class SegmentElsewhere(StorageError):
    """A read reached a segment this node holds no copy of; ``members`` hold it."""

    def __init__(self, key: PartitionKey, segment: ChainSegment, offset: int) -> None:
        super().__init__(
            f"segment {segment.segment_id} of {key[0]}-{key[1]} (offsets {segment.base_offset}.."
            f"{segment.end_offset}) is on nodes {list(segment.ensemble)}, not this one"
        )
        self.segment = segment
        self.offset = offset


@dataclass(frozen=True, slots=True)
class ChainSegment:
    """One segment of the chain, from the site's metadata."""

    segment_id: SegmentId
    base_offset: int
    end_offset: int | None  # exclusive; None for the open segment
    end_vector: VectorOffset | None  # the partition's vector at end_offset (sealed segments)
    ensemble: tuple[NodeId, ...]


class ChainLog:
    """One partition led by this node, over its chain of segments; see the module docstring."""

    def __init__(
        self,
        key: PartitionKey,
        store: ReplicaStore,
        chain: Sequence[ChainSegment],
        epoch: LeaderEpoch,
        lac_vector: VectorOffset,
    ) -> None:
        if not chain or chain[-1].end_offset is not None:
            raise ValueError(f"{key}: a chain log needs an open segment at its end")
        if store.copy(key, chain[-1].segment_id) is None:
            raise ValueError(f"{key}: this node holds no copy of the open segment {chain[-1].segment_id}")
        self._init_chain(key, store, chain, epoch, lac_vector)

    def _init_chain(
        self,
        key: PartitionKey,
        store: ReplicaStore,
        chain: Sequence[ChainSegment],
        epoch: LeaderEpoch,
        lac_vector: VectorOffset,
    ) -> None:
        self.key = key
        self.store = store
        self.chain = tuple(chain)
        self.open = self.chain[-1]
        self.epoch = epoch
        self._lac = self.open.base_offset
        self._lac_vector = lac_vector
        # Produced batches are appended on the event loop and replicated ones in the broker's writer thread: each
        # append and its entry above the LAC go together, so the entries stay in offset order.
        self._lock = threading.Lock()
        self._above_lac: collections.deque[tuple[int, Origin, int]] = collections.deque()
        self._remote: collections.OrderedDict[tuple[SegmentId, int], ReadResult] = collections.OrderedDict()
        self._remote_bytes = 0
        self._deferring = threading.local()
        self._chain_start: VectorOffset | None = None  # the vector below the chain's first segment, if known

    # -- the quorum ------------------------------------------------------------------------------------------

    def advance_lac(self, lac: int) -> bool:
        """The ack quorum holds everything below ``lac``; True if that moved the LAC."""
        with self._lock:
            if lac <= self._lac:
                return False
            self._lac = lac
            while self._above_lac and self._above_lac[0][0] <= lac:
                _, origin, next_seq = self._above_lac.popleft()
                self._lac_vector = self._lac_vector.advanced(origin, next_seq)
            return True

    @property
    def flushed_offset(self) -> LocalOffset:
        return LocalOffset(self._lac)

    def flushed_vector(self) -> dict[Origin, OriginSeq]:
        return self._lac_vector.to_dict()

    def lac_vector(self) -> VectorOffset:
        return self._lac_vector

    # -- PartitionLog: sizes and vectors ---------------------------------------------------------------------

    @property
    def damage_found_total(self) -> int:
        return sum(c.damage_found_total for c in self._copies())

    @property
    def repaired_total(self) -> int:
        return sum(c.repaired_total for c in self._copies())

    def _live_chain(self) -> tuple[ChainSegment, ...]:
        """The chain without the segments retention dropped since it was built (``ReplicaStore.trim``); the last
        segment always stays."""
        first = self.store.trimmed_before(self.key)
        if self.chain[0].segment_id >= first:
            return self.chain
        return tuple(s for s in self.chain[:-1] if s.segment_id >= first) + (self.chain[-1],)

    @property
    def log_start_offset(self) -> LocalOffset:
        # Retention moves it forward (TrimChain): fetches below it get OffsetOutOfRange, as on a one-node site.
        return LocalOffset(self._live_chain()[0].base_offset)

    @property
    def log_end_offset(self) -> LocalOffset:
        return self.store.end_offset(self.key, self.open.segment_id)

    @property
    def size_bytes(self) -> int:
        return sum(c.size_bytes for c in self._copies())

    @property
    def segment_count(self) -> int:
        return len(self._live_chain())

    def vector(self) -> dict[Origin, OriginSeq]:
        return self._open_copy().vector()

    def _open_copy(self) -> SegmentLog:
        copy = self.store.copy(self.key, self.open.segment_id)
        if copy is None:
            raise StorageError(
                f"{self.key[0]}-{self.key[1]}: this node's copy of segment {self.open.segment_id} is gone"
            )
        return copy

    def _copies(self) -> list[SegmentLog]:
        out: list[SegmentLog] = []
        for segment in self.chain:
            copy = self.store.copy(self.key, segment.segment_id)
            if copy is not None:
                out.append(copy)
        return out

    # -- PartitionLog: writes --------------------------------------------------------------------------------

    def append(self, header: BatchHeader, body: Sequence[BytesLike], append_time_ms: int) -> BatchHeader:
        with self._lock:
            stored = self.store.append_batch(self.key, self.epoch, self.open.segment_id, header, body, append_time_ms)
            self._above_lac.append((stored.next_offset, stored.origin, stored.last_origin_seq + 1))
        return stored

    def flush(self) -> LocalOffset:
        """This node's fsync of the open segment (one member's share of the LAC); returns its fsynced end."""
        return self.store.flush(self.key, self.open.segment_id)

    retention_due_ms: int | None = None  # never: the site's metadata trims the chain (below)

    def enforce_retention(self, now_ms: int) -> int:
        # A site's retention drops whole sealed segments through its metadata (cluster/retention.py, TrimChain),
        # and each node deletes its copies of them (ReplicaStore.trim): never one node's copies on its own.
        return 0

    def close(self) -> None:
        pass  # the store owns the copies

    # -- PartitionLog: reads ---------------------------------------------------------------------------------

    def _segment_at(self, offset: int) -> ChainSegment:
        for segment in self.chain:
            if segment.end_offset is None or offset < segment.end_offset:
                return segment
        return self.open

    def read(self, offset: LocalOffset, max_bytes: int) -> ReadResult:
        end = self.log_end_offset
        if not self.log_start_offset <= offset <= end:
            raise OffsetOutOfRange(offset, self.log_start_offset, end)
        segment = self._segment_at(offset)
        if segment.end_offset is not None and segment.end_offset == offset:
            return ReadResult(b"", LocalOffset(offset))
        cached = self._remote.get((segment.segment_id, offset))
        if cached is not None:
            self._remote.move_to_end((segment.segment_id, offset))
            return cached
        try:
            if self.store.copy(self.key, segment.segment_id) is None:
                raise SegmentElsewhere(self.key, segment, offset)
            try:
                result = self.store.read(self.key, segment.segment_id, offset, max_bytes, segment.end_offset)
            except OffsetOutOfRange:
                raise SegmentElsewhere(self.key, segment, offset) from None  # this copy is short: repair fills it
            if not result.data and segment.end_offset is not None:
                raise SegmentElsewhere(self.key, segment, offset)
        except SegmentElsewhere as missing:
            noted: list[SegmentElsewhere] | None = getattr(self._deferring, "missing", None)
            if noted is None:
                raise
            noted.append(missing)
            return ReadResult(b"", LocalOffset(offset))
        return result

    @contextlib.contextmanager
    def deferring_elsewhere(self) -> Iterator[list[SegmentElsewhere]]:
        """Within it (on this thread), a read that reaches a segment held elsewhere returns nothing at that offset
        and is noted in the yielded list, instead of raising :class:`SegmentElsewhere`. For a reader that gathers
        several reads into one answer (the replication source's cursors): it stops there keeping what it had
        gathered, and the caller reads the noted ranges from a member (``cache_remote``) before it reads again."""
        missing: list[SegmentElsewhere] = []
        self._deferring.missing = missing
        try:
            yield missing
        finally:
            self._deferring.missing = None

    def cache_remote(self, segment_id: SegmentId, offset: int, data: bytes) -> None:
        """Keep ``data`` (whole batches of sealed ``segment_id`` from ``offset``, read from a member) for reads."""
        if not data:
            return
        headers = iter_headers(data, verify=True)
        result = ReadResult(data, LocalOffset(headers[-1].next_offset))
        self._remote[(segment_id, offset)] = result
        self._remote_bytes += len(data)
        while self._remote_bytes > REMOTE_CACHE_BYTES and len(self._remote) > 1:
            _, dropped = self._remote.popitem(last=False)
            self._remote_bytes -= len(dropped.data)

    def offset_for_origin_seq(self, origin: Origin, seq: OriginSeq) -> LocalOffset | None:
        for segment in self._live_chain():
            ends = segment.end_vector.get(origin) if segment.end_vector is not None else None
            if segment.end_offset is not None and (ends is None or ends <= seq):
                continue  # the segment ends before the seq
            copy = self.store.copy(self.key, segment.segment_id)
            if copy is None:
                return LocalOffset(segment.base_offset)
            found = copy.offset_for_origin_seq(origin, seq)
            if found is not None or segment.end_offset is None:
                return found
        return None

    def offset_for_timestamp(self, timestamp_ms: int) -> LocalOffset | None:
        for segment in self._live_chain():
            copy = self.store.copy(self.key, segment.segment_id)
            if copy is None:
                continue  # a segment held elsewhere: its timestamps are not indexed here
            found = copy.offset_for_timestamp(timestamp_ms)
            if found is not None and (segment.end_offset is None or found < segment.end_offset):
                return found
        return None

    def batch_entries(self) -> list[BatchEntry]:
        out: list[BatchEntry] = []
        for copy in self._copies():
            out += copy.batch_entries()
        return out

    def segment_at(self, offset: int) -> SegmentBatches:
        """From this node's copy of the chain segment holding ``offset``: the copy was created at the partition's
        vector at its base (``ReplicaStore``), so its start vectors are the partition's. A segment held elsewhere
        answers only at its base, from the end vector of the segment before it; inside it this raises
        :class:`SegmentElsewhere` rather than guess."""
        start, end = self.log_start_offset, self.log_end_offset
        if not start <= offset <= end:
            raise OffsetOutOfRange(offset, start, end)
        segment = self._segment_at(offset)
        copy = self.store.copy(self.key, segment.segment_id)
        if copy is not None and copy.log_start_offset <= offset <= copy.log_end_offset:
            return copy.segment_at(offset)
        if offset == segment.base_offset:
            i = self.chain.index(segment)
            before = self.chain[i - 1].end_vector if i else self._chain_start
            if before is not None:
                return SegmentBatches(LocalOffset(offset), before.to_dict(), [])
        raise SegmentElsewhere(self.key, segment, offset)

    # -- damage ----------------------------------------------------------------------------------------------

    def damaged_batches(self) -> list[DamagedBatch]:
        out: list[DamagedBatch] = []
        for copy in self._copies():
            out += copy.damaged_batches()
        return out

    def repair(self, base_offset: int, batch: bytes) -> DamagedBatch:
        segment = self._segment_at(base_offset)
        copy = self.store.copy(self.key, segment.segment_id)
        if copy is None:
            raise SegmentElsewhere(self.key, segment, base_offset)
        return copy.repair(base_offset, batch)

    def scrub(self, offset: int, max_bytes: int) -> ScrubStep:
        segment = self._segment_at(offset)
        copy = self.store.copy(self.key, segment.segment_id)
        if copy is None:
            return ScrubStep(segment.end_offset or self.log_end_offset, 0, [])
        return copy.scrub(max(offset, copy.log_start_offset), max_bytes)


class FollowerLog(ChainLog):
    """A partition as a node that does not lead it serves it to consumers: follower reads. Read-only.

    What it may serve is :func:`cluster.follower_reads.follower_bound` of this node's view, recomputed at every
    look (``flushed_offset``): sealed segments up to their sealed ends, from this node's copies or, for one it
    holds no whole copy of, from a member (:class:`SegmentElsewhere`, as the leader reads); the open segment up to
    the LAC its leader last announced to this node (``ReplicaStore.lacs``) and this node's copy. ``FetchCursor``
    serves only below ``flushed_offset``, so the rule is all a fetch sees. ``log_end_offset`` is the bound too (a
    "latest" start there is never past what a recovery may cut); :meth:`known_end` is the furthest this node can
    tell the partition reaches: a reader past it goes to the leader, which knows. Writes, the quorum and the
    flushed vector belong to the leader's :class:`ChainLog` and raise here. Like a ``ChainLog`` it lives for one
    chain: the fetch builds a new one when the metadata's chain changes (a roll, a seal).
    """

    def __init__(
        self,
        key: PartitionKey,
        store: ReplicaStore,
        chain: Sequence[ChainSegment],
        me: NodeId,
        start_vector: VectorOffset | None = None,
    ) -> None:
        """``start_vector``: the chain's start (the metadata's, past what retention trimmed); the vector of a
        chain whose sealed segments are all gone, read at a node without a copy of the open segment."""
        if not chain:
            raise ValueError(f"{key}: a follower log needs a chain of at least one segment")
        last_sealed = next((s for s in reversed(chain) if s.end_offset is not None), None)
        end_vector = last_sealed.end_vector if last_sealed is not None else None
        self._sealed_vector = end_vector if end_vector is not None else start_vector or VectorOffset()
        # Not ChainLog.__init__: a follower may hold no copy of the open segment, and leads no epoch (0: none).
        self._init_chain(key, store, chain, LeaderEpoch(0), self._sealed_vector)
        self._chain_start = start_vector
        self.me = me
        self._bounds = tuple(SegmentBounds(s.segment_id, s.base_offset, s.end_offset, s.ensemble) for s in chain)

    def _open_copy_end(self) -> int | None:
        if self.open.end_offset is not None or self.store.copy(self.key, self.open.segment_id) is None:
            return None
        return int(self.store.end_offset(self.key, self.open.segment_id))

    def bound(self) -> FollowerBound:
        lac = self.store.lacs.get(self.key, self.open.segment_id) if self.open.end_offset is None else None
        return follower_bound(self._bounds, self.me, self._open_copy_end(), lac)

    @property
    def flushed_offset(self) -> LocalOffset:
        return LocalOffset(self.bound().end)

    @property
    def log_end_offset(self) -> LocalOffset:
        # What it serves, not its copy's end: a "latest" start there is never past a point a recovery may cut.
        return LocalOffset(self.bound().end)

    def known_end(self) -> int:
        """The furthest this node can tell the partition reaches (its copy of the open segment, else its bound):
        a reader past it goes to the leader, which knows whether that offset exists."""
        copy_end = self._open_copy_end()
        return max(self.bound().end, copy_end if copy_end is not None else 0)

    def vector(self) -> dict[Origin, OriginSeq]:
        if self._open_copy_end() is not None:
            return self._open_copy().vector()
        return self._sealed_vector.to_dict()

    def flushed_vector(self) -> dict[Origin, OriginSeq]:
        raise StorageError(
            f"{self.key[0]}-{self.key[1]}: a follower's view has no flushed vector (its leader's "
            "ChainLog serves replication)"
        )

    def advance_lac(self, lac: int) -> bool:
        raise StorageError(f"{self.key[0]}-{self.key[1]}: a follower learns the LAC from its leader's announcements")

    def append(self, header: BatchHeader, body: Sequence[BytesLike], append_time_ms: int) -> BatchHeader:
        raise StorageError(f"{self.key[0]}-{self.key[1]}: a follower's view takes no appends; the leader does")

    def flush(self) -> LocalOffset:
        raise StorageError(f"{self.key[0]}-{self.key[1]}: a follower's view has nothing to fsync")

    def read(self, offset: LocalOffset, max_bytes: int) -> ReadResult:
        segment = self._segment_at(offset)
        if segment.end_offset is None and self.store.copy(self.key, segment.segment_id) is None:
            # Never read an open segment from another member: its copy may hold what no quorum confirmed.
            raise OffsetOutOfRange(offset, self.log_start_offset, self.flushed_offset)
        return super().read(offset, max_bytes)
