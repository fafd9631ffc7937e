"""A node's copies of the segments whose ensembles it is a member of. Shell.

Inside a multi-node site (ARCHITECTURE.md, "Inside a site: the segment
cluster") a partition is a chain of segments, each stored by its own ensemble
of nodes. This module is one node's side of that: it keeps each segment it
was sent as its own :class:`~georep.storage.segment_log.SegmentLog`, whose
first offset is the segment's base, so a node holds segments 3 and 7 of a
partition without 4 to 6. Layout, under the node's data dir::

    replicas/<quoted topic>[@<incarnation>]-<partition>/
        guard.json               the partition's ReplicaGuard state, replaced durably
        0000000003/              segment 3: a SegmentLog starting at the segment's base offset
        0000000007/              segment 7
        0000000008.new/          a segment being created; removed at startup
    deleted-replicas/            copies of deleted topic incarnations on their way out; emptied at startup

**Incarnations.** A topic deleted and created again is a new incarnation (docs/design.md, "Topic changes across
sites"); its copies live in directories of their own (``@k`` for k > 0, ``georep/storage/partition_dirs.py``),
with a guard of their own, so the copies of two incarnations never mix: segment 0 of incarnation 1 is never taken
for segment 0 of incarnation 0. The store holds one incarnation per partition, the one ``incarnation_of`` (the
node's view of the site's metadata) names when a leader or a repair opens, fences or seals a copy: one of an
earlier incarnation is moved out first. :meth:`ReplicaStore.remove_deleted` moves out every copy the entries say
was deleted (the node's tick after a delete, and its start, after a stop or a crash in the middle of a removal).

**Decisions are the member's.** Whether an append, a fence, a copy or a seal
is allowed (leader epochs, sealed segments, contiguity) is decided by
:mod:`cluster.member` (``judge_append``, ``judge_fence``, ``judge_copy``)
over :class:`cluster.quorum.ReplicaGuard`, the rules the cluster simulators
apply too; this module carries the verdicts out on disk: a batch the member
holds already is stored no second time (the leader resent it), a gap raises
``NotContiguous`` (the leader resends from the end it names), a refusal raises
``Fenced`` or ``SegmentSealed``. As the guard requires, its state is written durably (``guard.json``,
fsynced, replaced atomically) before the call that changed it returns: a
member that restarts never accepts a deposed leader it had fenced, nor appends
to a segment it had sealed.

**Copies are byte for byte.** A batch arrives with the leader's 24-byte local
prefix (base offset, append time) and is stored with it unchanged, so every
replica of a segment holds the same bytes, which the audit compares.

**Cut only after the seal.** :meth:`ReplicaStore.seal` records the seal
first and then cuts a copy longer than the sealed end (``cluster/recovery.py``:
until the seal is committed a later recovery may still count that tail).

**Repair copies sealed segments in.** A repair (``cluster/repair.py``)
copies a sealed segment to a node that joins its ensemble, or fills a member
that holds less than the sealed end. No leader writes a sealed segment, so
the guard's leader checks do not apply: :meth:`ReplicaStore.open_sealed_copy`
records the seal in the guard first (so no deposed leader can append to the
copy afterwards), and :meth:`ReplicaStore.append_sealed_copy` takes only
whole batches whose CRCs check, at the copy's end, and none past the sealed
end. The bytes they append are counted (``bytes_moved.json``,
:mod:`georep.storage.moved_bytes`): what ``georep cluster status`` shows as
bytes moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from cluster import member as membership
from cluster.quorum import Fenced, GuardState, NotContiguous, ReplicaGuard, SegmentSealed
from georep.metadata.topic_entry import TopicEntry, incarnation_deleted
from georep.record.batch import REWRITTEN_BYTES, BatchHeader, CorruptBatch, iter_headers
from georep.storage.announced_lac import AnnouncedLacs
from georep.storage.api import BatchEntry, BytesLike, LogConfig, ReadResult
from georep.storage.deleted_dirs import deleted_incarnation_dirs, move_to_deleted, remove_moved
from georep.storage.durable_file import fsync_directory, replace_file
from georep.storage.moved_bytes import MovedBytes
from georep.storage.partition_dirs import parse_incarnation_dir
from georep.storage.partition_dirs import partition_dir_name as incarnation_dir_name
from georep.storage.private import DIR_MODE, private_dir
from georep.storage.segment import U32_MAX
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.log_prefix import vector_below
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, SegmentId

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"
DELETED_REPLICAS_DIR = "deleted-replicas"
GUARD_FILE = "guard.json"
GUARD_FORMAT = 1
VECTOR_READ_BYTES = 1 << 20
NEW_SUFFIX = ".new"
# A replica's log is one segment file (up to 4 GiB, the format's limit): the ensemble decides when a segment
# ends, not the node's roll settings.
REPLICA_LOG_CONFIG = LogConfig(segment_bytes_max=U32_MAX, segment_ms=1 << 62)

PartitionKey = tuple[str, int]


class ReplicaError(Exception):
    """A replica operation that cannot be done; the message says what to do."""


class UnknownSegment(ReplicaError):
    def __init__(self, key: PartitionKey, segment_id: int) -> None:
        super().__init__(
            f"this node holds no copy of segment {segment_id} of {key[0]}-{key[1]}: ask a member of "
            "the segment's ensemble (the site's metadata lists them)"
        )


class IncarnationMismatch(ReplicaError):
    """A call about a topic incarnation this node's view of the site's metadata does not hold live; nothing was
    done. The caller tries again once the views agree (this node's lags) or stops (the incarnation was deleted)."""


class CorruptReplicaChunk(ReplicaError):
    """Bytes sent for a segment that are not whole, valid batches; nothing of them was stored."""


class PastSealedEnd(ReplicaError):
    """A repair copy sent a batch that ends past the segment's sealed end; nothing of the chunk was stored."""


@dataclasses.dataclass(frozen=True, slots=True)
class HeldCopy:
    """One segment copy on this node, as the repair controller asks for it (``ListSegments``)."""

    key: PartitionKey
    segment_id: SegmentId
    end_offset: LocalOffset
    flushed_offset: LocalOffset
    size_bytes: int


def partition_dir_name(key: PartitionKey, incarnation: int = 0) -> str:
    return incarnation_dir_name(key[0], key[1], incarnation)


def _whole_batches(key: PartitionKey, segment_id: int, chunk: bytes, then: str) -> list[BatchHeader]:
    """The headers of ``chunk``, which must be whole, CRC-valid batches back to back; else
    :class:`CorruptReplicaChunk` naming the segment and what happens ``then`` (nothing is stored)."""
    try:
        headers = iter_headers(chunk, verify=True)
    except CorruptBatch as exc:
        raise CorruptReplicaChunk(
            f"segment {segment_id} of {key[0]}-{key[1]}: {exc}; nothing was stored, {then}"
        ) from None
    if sum(h.size_bytes for h in headers) != len(chunk):
        raise CorruptReplicaChunk(
            f"segment {segment_id} of {key[0]}-{key[1]}: the chunk ends inside a batch; nothing was stored, {then}"
        )
    return headers


def _segment_dir_name(segment_id: int) -> str:
    return f"{segment_id:010d}"


def _refused(refuse: membership.Refuse, epoch: LeaderEpoch, segment_id: SegmentId, guard: ReplicaGuard) -> Exception:
    """The error a member answers for the judgment ``refuse`` (the leader of ``epoch`` stops writing)."""
    sealed = guard.state.sealed_through
    if refuse.why == "sealed" and sealed is not None:
        return SegmentSealed(segment_id, sealed)
    return Fenced(epoch, refuse.fenced_epoch)


@dataclasses.dataclass(frozen=True, slots=True)
class SealSummary:
    """What a seal records of a copy below its end (``ReplicaStore.seal_summary``)."""

    end_vector: VectorOffset
    size_bytes: int
    max_timestamp_ms: int | None  # None: no batch below the end


class PartitionReplicas:
    """One partition's segments on this node, and its guard. ``lock`` is held for each call on the partition."""

    def __init__(
        self,
        key: PartitionKey,
        directory: Path,
        guard: ReplicaGuard,
        segments: dict[SegmentId, SegmentLog],
        made: bool = True,
        incarnation: int = 0,
    ) -> None:
        self.key = key
        self.incarnation = incarnation  # the topic's incarnation these copies are of (their directory's name)
        self.directory = directory
        self.guard = guard
        self.segments = segments
        self.lock = threading.Lock()
        self.made = made  # its directory exists and is durable (a leader's first call creates it)

    def segment(self, segment_id: SegmentId) -> SegmentLog:
        found = self.segments.get(segment_id)
        if found is None:
            raise UnknownSegment(self.key, segment_id)
        return found

    def persist_guard(self) -> None:
        doc = {"format": GUARD_FORMAT, **dataclasses.asdict(self.guard.state)}
        replace_file(self.directory / GUARD_FILE, (json.dumps(doc, sort_keys=True) + "\n").encode())


def _read_guard(directory: Path) -> ReplicaGuard:
    path = directory / GUARD_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ReplicaGuard()
    except (OSError, ValueError) as exc:
        # Starting with an empty fence could accept a deposed leader: refuse to guess.
        raise ReplicaError(
            f"{path} is unreadable ({exc}): this node cannot know which leaders it fenced. Restore "
            "the file, or remove this node's replicas directory and let the site repair its "
            "segments onto it again"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != GUARD_FORMAT:
        raise ReplicaError(
            f"{path} has format {doc.get('format') if isinstance(doc, dict) else doc!r}; this build "
            f"reads {GUARD_FORMAT}"
        )
    sealed = doc.get("sealed_through")
    return ReplicaGuard(
        GuardState(LeaderEpoch(int(doc["fenced_epoch"])), None if sealed is None else SegmentId(int(sealed)))
    )


class ReplicaStore:
    """Every segment copy a node holds. Thread-safe: each call holds its partition's lock, and the store's lock
    only to find the partition. A failover opens thousands of copies, each a few fsyncs: under one store-wide
    lock the executor's threads synced one at a time, and every other call waited behind them."""

    def __init__(self, data_dir: Path, now_ms: int) -> None:
        self.root = data_dir / REPLICAS_DIR
        private_dir(self.root)
        self.moved = MovedBytes(data_dir)  # bytes repair copies appended here (append_sealed_copy)
        self.lacs = AnnouncedLacs()  # what leaders confirmed of the open segments copied here: follower reads
        self._lock = threading.Lock()  # guards the dicts below, never held across disk work
        self._partitions: dict[PartitionKey, PartitionReplicas] = {}
        # Retention (TrimChain): per partition, the first segment its chain keeps, as this node last saw it.
        self._trimmed_before: dict[PartitionKey, SegmentId] = {}
        self._gaps = membership.GapReports()  # a gap is logged once per end, not once per batch past it
        # The topic's live incarnation as the node's view of the metadata has it (the member sets it): what a copy
        # opened, fenced or sealed from now on belongs to (module docstring).
        # None: deleted in this view (every call about the topic is refused).
        self.incarnation_of: Callable[[str], int | None] = lambda topic: 0
        self.deleted_dir = data_dir / DELETED_REPLICAS_DIR
        if self.deleted_dir.is_dir():  # a removal a stop interrupted: its copies were out of every partition's way
            remove_moved(sorted(self.deleted_dir.iterdir()))
        try:
            for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
                parsed = parse_incarnation_dir(directory.name)
                if parsed is None:
                    continue
                key, incarnation = (parsed[0], parsed[1]), parsed[2]
                held = self._partitions.get(key)
                if held is not None and held.incarnation > incarnation:
                    continue  # an earlier incarnation's copies: remove_deleted moves them out
                if held is not None:
                    for seg in held.segments.values():
                        seg.close()
                self._partitions[key] = self._open_partition(key, directory, now_ms, incarnation)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open_partition(key: PartitionKey, directory: Path, now_ms: int, incarnation: int = 0) -> PartitionReplicas:
        segments: dict[SegmentId, SegmentLog] = {}
        for child in sorted(directory.iterdir()):
            if child.name.endswith(NEW_SUFFIX):
                log.info("removing %s: a segment copy whose creation did not finish", child)
                shutil.rmtree(child)
            elif child.is_dir() and child.name.isdigit():
                segments[SegmentId(int(child.name))] = SegmentLog.open(child, REPLICA_LOG_CONFIG, now_ms)
        return PartitionReplicas(key, directory, _read_guard(directory), segments, incarnation=incarnation)

    # -- what a node holds -------------------------------------------------------------------------------

    def partitions(self) -> list[PartitionKey]:
        with self._lock:
            return sorted(self._partitions)

    def segment_ids(self, key: PartitionKey) -> list[SegmentId]:
        with self._existing(key) as p:
            return sorted(p.segments) if p else []

    def guard_state(self, key: PartitionKey) -> GuardState:
        with self._existing(key) as p:
            return p.guard.state if p else GuardState()

    def end_offset(self, key: PartitionKey, segment_id: SegmentId) -> LocalOffset:
        return self._segment(key, segment_id).log_end_offset

    def flushed_offset(self, key: PartitionKey, segment_id: SegmentId) -> LocalOffset:
        return self._segment(key, segment_id).flushed_offset

    def size_of(self, key: PartitionKey, segment_id: SegmentId) -> int:
        """The bytes of this node's copy of ``segment_id``."""
        return self._segment(key, segment_id).size_bytes

    def size_bytes(self) -> int:
        return sum(row.size_bytes for row in self.held())

    def held(self) -> list[HeldCopy]:
        """Every segment copy this node holds of its topic's live incarnation, by partition and segment id."""
        out: list[HeldCopy] = []
        for p in self._live():
            with p.lock:
                out += (
                    HeldCopy(p.key, sid, seg.log_end_offset, seg.flushed_offset, seg.size_bytes)
                    for sid, seg in sorted(p.segments.items())
                )
        return out

    def _live(self) -> list[PartitionReplicas]:
        """Every partition whose copies are of its topic's live incarnation, in key order (the others are deleted:
        their removal pass comes). One look at the view per topic, not per partition."""
        live: dict[str, int | None] = {}
        out = []
        for p in self._every():
            topic = p.key[0]
            if topic not in live:
                live[topic] = self.incarnation_of(topic)
            if live[topic] == p.incarnation:
                out.append(p)
        return out

    def _every(self) -> list[PartitionReplicas]:
        """Every partition, in key order (walk them one lock at a time)."""
        with self._lock:
            return [p for _, p in sorted(self._partitions.items())]

    def _segment(self, key: PartitionKey, segment_id: SegmentId) -> SegmentLog:
        """A copy this node holds (reads and fsyncs never create anything). Raises :class:`UnknownSegment`."""
        with self._existing(key) as p:
            if p is None:
                raise UnknownSegment(key, segment_id)
            return p.segment(segment_id)

    @contextlib.contextmanager
    def _existing(self, key: PartitionKey) -> Iterator[PartitionReplicas | None]:
        """``key``'s replicas under their lock, or None if this node has none."""
        with self._lock:
            p = self._partitions.get(key)
        if p is None:
            yield None
            return
        with p.lock:
            yield p

    @contextlib.contextmanager
    def _locked(self, key: PartitionKey, current: bool = True) -> Iterator[PartitionReplicas]:
        """``key``'s replicas under their lock, created empty for a leader's first call (the directory is made under
        the partition's lock, so other partitions' calls do not wait for its fsync). ``current``: of the topic's
        live incarnation, an earlier one's copies moved out first (appends skip the look: they follow an open)."""
        stale: PartitionReplicas | None = None
        with self._lock:
            p = self._partitions.get(key)
            incarnation = self.incarnation_of(key[0]) if current or p is None else p.incarnation
            if incarnation is None:
                raise IncarnationMismatch(
                    f"topic {key[0]!r} was deleted (this node's view of the site's metadata says so): nothing of "
                    f"{key[0]}-{key[1]} is written here"
                )
            if p is not None and p.incarnation < incarnation:
                stale, p = p, None
            if p is None:
                directory = self.root / partition_dir_name(key, incarnation)
                p = self._partitions[key] = PartitionReplicas(
                    key, directory, ReplicaGuard(), {}, made=False, incarnation=incarnation
                )
        if stale is not None:
            self._move_out([stale], "a later incarnation of the topic is written here")
        with p.lock:
            if not p.made:
                p.directory.mkdir(mode=DIR_MODE, exist_ok=True)
                fsync_directory(self.root)
                p.made = True
            yield p

    # -- the leader's calls --------------------------------------------------------------------------------

    def open_segment(
        self,
        key: PartitionKey,
        epoch: LeaderEpoch,
        segment_id: SegmentId,
        base_offset: int,
        start_vector: dict[Origin, OriginSeq],
        now_ms: int,
    ) -> None:
        """Start this node's copy of a new segment, empty at ``base_offset`` (its vector goes on from
        ``start_vector``, the end vector of the segment before it). Opening an existing copy again changes nothing.

        The member judges it as a recovery's copy (``cluster.member.judge_copy``: ``Fenced``, ``SegmentSealed``),
        so a deposed leader's stream is refused at its first request, not only at its first batch.
        """
        with self._locked(key) as p:
            before = p.guard.state
            refused = membership.judge_copy(p.guard, epoch, segment_id)
            if refused is not None:
                raise _refused(refused, epoch, segment_id, p.guard)
            if p.guard.state != before:
                p.persist_guard()
            if segment_id in p.segments:
                return
            final = p.directory / _segment_dir_name(segment_id)
            building = final.with_name(final.name + NEW_SUFFIX)
            if building.exists():
                shutil.rmtree(building)
            SegmentLog.create_at(building, REPLICA_LOG_CONFIG, base_offset, start_vector, now_ms).close()
            building.rename(final)
            fsync_directory(p.directory)
            # create_at made every file durable and the rename is: nothing for the open to sync (a failover opens
            # thousands of copies, and each fsync waits for a shared disk)
            p.segments[segment_id] = SegmentLog.open(final, REPLICA_LOG_CONFIG, now_ms, filesystem_synced=True)

    def append(self, key: PartitionKey, epoch: LeaderEpoch, segment_id: SegmentId, chunk: bytes) -> LocalOffset:
        """Append the leader's batches (whole batches, back to back, with their local prefixes) to this node's
        copy of ``segment_id``. Returns the copy's new end (not yet fsynced: :meth:`flush`).

        Each batch is judged by ``cluster.member.judge_append``: one this copy holds already (the leader resent it
        from the end it last knew) is stored no second time. Raises :class:`CorruptReplicaChunk` (nothing stored),
        :class:`UnknownSegment`, ``Fenced``, ``SegmentSealed`` or ``NotContiguous`` (a gap) at the first batch
        it refuses; the batches before that one stay appended, and ``NotContiguous`` says where the leader must
        resend from.
        """
        headers = _whole_batches(key, segment_id, chunk, "the leader resends")
        view = memoryview(chunk)
        with self._locked(key, current=False) as p:
            seg = p.segment(segment_id)
            at = 0
            for h in headers:
                end = seg.log_end_offset
                verdict = membership.judge_append(
                    p.guard, epoch, (key[0], key[1], segment_id), h.base_offset, end, self._gaps
                )
                if isinstance(verdict, membership.Refuse):
                    raise _refused(verdict, epoch, segment_id, p.guard)
                if isinstance(verdict, membership.Gap):
                    if verdict.report:
                        log.warning(
                            "segment %d of %s-%d: a batch at offset %d is past this copy's end %d; the "
                            "leader resends from there",
                            segment_id,
                            *key,
                            h.base_offset,
                            end,
                        )
                    raise NotContiguous(segment_id, h.base_offset, end)
                if isinstance(verdict, membership.Take):
                    if verdict.persist:
                        p.persist_guard()
                    seg.append(h, [view[at + REWRITTEN_BYTES : at + h.size_bytes]], h.append_time_ms)
                at += h.size_bytes
            return seg.log_end_offset

    def append_batch(
        self,
        key: PartitionKey,
        epoch: LeaderEpoch,
        segment_id: SegmentId,
        header: BatchHeader,
        body: Sequence[BytesLike],
        append_time_ms: int,
    ) -> BatchHeader:
        """The leader's own append of one batch (stamped by its broker) to its copy of the open ``segment_id``, at
        the copy's end; returns the header as stored. Judged as a member's append (``judge_append``), so a leader
        that a newer one fenced writes nothing (``Fenced``)."""
        with self._locked(key, current=False) as p:
            seg = p.segment(segment_id)
            end = seg.log_end_offset
            verdict = membership.judge_append(p.guard, epoch, (key[0], key[1], segment_id), end, end, self._gaps)
            if isinstance(verdict, membership.Refuse):
                raise _refused(verdict, epoch, segment_id, p.guard)
            if isinstance(verdict, membership.Take) and verdict.persist:
                p.persist_guard()
            return seg.append(header, body, append_time_ms)

    # -- repair's calls --------------------------------------------------------------------------------------

    def open_sealed_copy(
        self,
        key: PartitionKey,
        segment_id: SegmentId,
        base_offset: int,
        start_vector: dict[Origin, OriginSeq],
        now_ms: int,
    ) -> LocalOffset:
        """A repair is about to copy sealed ``segment_id`` here: record the seal in the guard (so that no leader
        appends to it from now on), create the copy empty at ``base_offset`` if this node has none, and return the
        copy's end, from which :meth:`append_sealed_copy` goes on. The fence epoch does not change."""
        with self._locked(key) as p:
            sealed = p.guard.state.sealed_through
            if sealed is None or sealed < segment_id:
                p.guard.seal(p.guard.fenced_epoch, segment_id)
                p.persist_guard()
            existing = p.segments.get(segment_id)
            if existing is not None:
                return existing.log_end_offset
            if segment_id < self.trimmed_before(key):
                raise ReplicaError(
                    f"segment {segment_id} of {key[0]}-{key[1]} was dropped by retention: nothing to copy"
                )
            final = p.directory / _segment_dir_name(segment_id)
            building = final.with_name(final.name + NEW_SUFFIX)
            if building.exists():
                shutil.rmtree(building)
            SegmentLog.create_at(building, REPLICA_LOG_CONFIG, base_offset, start_vector, now_ms).close()
            building.rename(final)
            fsync_directory(p.directory)
            seg = p.segments[segment_id] = SegmentLog.open(final, REPLICA_LOG_CONFIG, now_ms, filesystem_synced=True)
            return seg.log_end_offset

    def append_sealed_copy(
        self, key: PartitionKey, segment_id: SegmentId, end_offset: int, chunk: bytes
    ) -> LocalOffset:
        """Append whole batches of sealed ``segment_id`` (as its members store them, local prefixes included) read
        from another member, at this copy's end; returns the new end (not yet fsynced: :meth:`flush`).

        Every batch's CRC is checked first (``iter_headers(verify=True)``), and a batch ending past ``end_offset``
        (the sealed end) is refused: :class:`CorruptReplicaChunk` and :class:`PastSealedEnd` store nothing.
        A chunk that does not start at the copy's end raises ``NotContiguous`` (resend from the end it names).
        Call :meth:`open_sealed_copy` first: a copy whose seal the guard does not know is refused
        (``ReplicaError``), since a leader may still be appending to it.
        """
        headers = _whole_batches(key, segment_id, chunk, "the repair copies it again")
        if headers and headers[-1].next_offset > end_offset:
            raise PastSealedEnd(
                f"segment {segment_id} of {key[0]}-{key[1]} is sealed at offset {end_offset}, but the "
                f"copy sent a batch ending at {headers[-1].next_offset}: the source's copy is longer "
                "than the seal (it has not cut its tail yet); copy from another member"
            )
        view = memoryview(chunk)
        with self._locked(key) as p:
            seg = p.segment(segment_id)
            sealed = p.guard.state.sealed_through
            if sealed is None or sealed < segment_id:
                raise ReplicaError(
                    f"segment {segment_id} of {key[0]}-{key[1]} is not sealed on this node: open the "
                    "copy with open_sealed_copy first"
                )
            if headers and headers[0].base_offset != seg.log_end_offset:
                raise NotContiguous(segment_id, headers[0].base_offset, seg.log_end_offset)
            at = 0
            for h in headers:
                seg.append(h, [view[at + REWRITTEN_BYTES : at + h.size_bytes]], h.append_time_ms)
                at += h.size_bytes
            end = seg.log_end_offset
        self.moved.add(at)  # bytes moved between nodes: only repair copies come here
        return end

    def copy(self, key: PartitionKey, segment_id: SegmentId) -> SegmentLog | None:
        """This node's copy of ``segment_id`` for lookups (its origin index, its batches' entries), or None. Read it
        through :meth:`read`: a seal may replace the object."""
        with self._existing(key) as p:
            return p.segments.get(segment_id) if p is not None else None

    def flush(self, key: PartitionKey, segment_id: SegmentId) -> LocalOffset:
        """fsync this node's copy of ``segment_id``; returns the end it holds fsynced (what the member acks)."""
        seg = self._segment(key, segment_id)
        return seg.flush()  # outside the lock: an fsync is slow, and the log has its own lock

    def fence(self, key: PartitionKey, epoch: LeaderEpoch) -> dict[SegmentId, LocalOffset]:
        """A new leader fences this node at ``epoch`` (``Fenced`` if older than the fence). Returns the end of
        every segment copy, each fsynced first: what recovery counts (``cluster/recovery.py``)."""
        with self._locked(key) as p:
            before = p.guard.state
            refused = membership.judge_fence(p.guard, epoch)
            if refused is not None:
                raise Fenced(epoch, refused.fenced_epoch)
            if p.guard.state != before:
                p.persist_guard()
            segments = dict(p.segments)
        return {sid: seg.flush() for sid, seg in sorted(segments.items())}

    def learn_seal(self, key: PartitionKey, epoch: LeaderEpoch, through: SegmentId) -> None:
        """The site's metadata shows ``key``'s segments up to ``through`` sealed (``cluster.member.seals_to_learn``):
        the guard refuses them from now on, whether or not this node holds a copy (a deposed leader cannot open
        one here). Raises ``Fenced`` for an epoch older than the fence."""
        with self._locked(key) as p:
            before = p.guard.state
            p.guard.seal(epoch, through)
            if p.guard.state != before:
                p.persist_guard()

    def guard_states(self) -> dict[PartitionKey, GuardState]:
        """Every partition's guard state on this node (of its topic's live incarnation)."""
        out: dict[PartitionKey, GuardState] = {}
        for p in self._live():
            with p.lock:
                out[p.key] = p.guard.state
        return out

    def seal(
        self, key: PartitionKey, epoch: LeaderEpoch, segment_id: SegmentId, end_offset: int, now_ms: int
    ) -> LocalOffset:
        """``segment_id`` was sealed at ``end_offset`` by the leader of ``epoch`` (the seal is committed in the
        site's metadata). Records it, then cuts this node's copy if it is longer. Returns the copy's end, which
        is below ``end_offset`` if this copy is short (repair fills it: ``cluster/repair.py``)."""
        with self._locked(key) as p:
            before = p.guard.state
            p.guard.seal(epoch, segment_id)
            if p.guard.state != before:
                p.persist_guard()
            seg = p.segments.get(segment_id)
            if seg is None:
                return LocalOffset(0)
            if seg.log_end_offset > end_offset:
                log.info(
                    "segment %d of %s-%d: cutting this copy from offset %d back to the sealed end %d",
                    segment_id,
                    key[0],
                    key[1],
                    seg.log_end_offset,
                    end_offset,
                )
                directory = seg.directory
                seg.close()
                p.segments[segment_id] = seg = SegmentLog.cut(directory, REPLICA_LOG_CONFIG, end_offset, now_ms)
            return seg.log_end_offset

    # -- reads -----------------------------------------------------------------------------------------------

    def read(
        self,
        key: PartitionKey,
        segment_id: SegmentId,
        offset: LocalOffset,
        max_bytes: int,
        end_offset: int | None = None,
    ) -> ReadResult:
        """Whole batches of this node's copy from ``offset``, as stored; with ``end_offset``, only those that start
        below it (a read up to the LAC or a sealed end, a copy of a range)."""
        seg = self._segment(key, segment_id)
        result = seg.read(offset, max_bytes)
        if end_offset is None or result.next_offset <= end_offset:
            return result
        keep = 0
        for h in iter_headers(result.data):
            if h.base_offset >= end_offset:
                break
            keep += h.size_bytes
            offset = LocalOffset(h.next_offset)
        return ReadResult(result.data[:keep], offset)

    def vector_at(
        self, key: PartitionKey, segment_id: SegmentId, start: Mapping[Origin, int], end_offset: int
    ) -> VectorOffset:
        """The partition's vector at ``end_offset`` of this copy: ``start`` (the vector at the segment's base, the end
        vector of the segment before it) advanced by every batch below ``end_offset``. What a seal records."""
        return self.seal_summary(key, segment_id, start, end_offset).end_vector

    def seal_summary(
        self, key: PartitionKey, segment_id: SegmentId, start: Mapping[Origin, int], end_offset: int
    ) -> SealSummary:
        """What a seal at ``end_offset`` records of this copy: the vector there (:meth:`vector_at`), and for
        retention the bytes of the batches below it and their newest producer timestamp."""
        vector = VectorOffset(start)
        size = 0
        newest: int | None = None
        offset = self._segment(key, segment_id).log_start_offset
        while offset < end_offset:
            result = self.read(key, segment_id, offset, VECTOR_READ_BYTES, end_offset)
            if not result.data:
                raise ReplicaError(
                    f"segment {segment_id} of {key[0]}-{key[1]}: this copy ends at {offset}, short of {end_offset}"
                )
            headers = list(iter_headers(result.data))
            vector = vector_below(vector.to_dict(), headers, end_offset)
            for h in headers:
                size += h.size_bytes
                newest = h.max_timestamp if newest is None else max(newest, h.max_timestamp)
            offset = result.next_offset
        return SealSummary(vector, size, newest)

    def batch_entries(
        self, key: PartitionKey, segment_id: SegmentId, end_offset: int | None = None
    ) -> list[BatchEntry]:
        """The index entries of this node's copy of ``segment_id`` (no log reads), in log order; with ``end_offset``,
        those of the batches below it: what a seal folds into the producers' table
        (``cluster/producer_snapshot.py``)."""
        seg = self._segment(key, segment_id)
        entries = seg.batch_entries()
        return entries if end_offset is None else [e for e in entries if e.base_offset < end_offset]

    def entries_before(self, key: PartitionKey, segment_id: SegmentId) -> list[BatchEntry]:
        """The index entries of every copy this node holds of ``key``'s segments before ``segment_id``, in chain
        order: a producers' table from what this node holds, for a chain whose last seal carries none
        (``cluster.producer_snapshot.history_at_open``)."""
        out: list[BatchEntry] = []
        for sid in self.segment_ids(key):
            if sid < segment_id:
                out += self.batch_entries(key, sid)
        return out

    # -- retention -------------------------------------------------------------------------------------------

    def trimmed_before(self, key: PartitionKey) -> SegmentId:
        """The first segment of ``key``'s chain as this node last saw retention trim it (0: never trimmed)."""
        with self._lock:
            return self._trimmed_before.get(key, SegmentId(0))

    def trim(self, key: PartitionKey, first_segment: SegmentId) -> list[SegmentId]:
        """Retention committed that ``key``'s chain starts at ``first_segment``: from now on reads below it are out
        of range (``ChainLog.log_start_offset``), and this node's copies of the segments before it are deleted.
        Returns the ids of the copies deleted. Each goes by a rename to a ``.new`` name first, so a crash in the
        middle leaves a directory the next start removes, never a half-deleted copy."""
        with self._lock:
            if first_segment > self._trimmed_before.get(key, SegmentId(0)):
                self._trimmed_before[key] = first_segment
        with self._existing(key) as p:
            if p is None:
                return []
            gone = {sid: seg for sid, seg in p.segments.items() if sid < first_segment}
            for sid in gone:
                del p.segments[sid]
        for sid, seg in sorted(gone.items()):
            directory = seg.directory
            seg.close()
            doomed = directory.with_name(directory.name + ".trimmed" + NEW_SUFFIX)
            directory.rename(doomed)
            fsync_directory(p.directory)
            shutil.rmtree(doomed)
            log.info(
                "segment %d of %s-%d: retention dropped it from the chain; deleted this node's copy",
                sid,
                key[0],
                key[1],
            )
        return sorted(gone)

    def check_incarnation(self, key: PartitionKey, incarnation: int) -> None:
        """Raise :class:`IncarnationMismatch` unless ``incarnation`` is the one of ``key``'s topic this node's view
        holds live: what a member checks of every call a leader, a recovery or a repair makes of it. Copies of an
        earlier incarnation still here are moved out first, so the call never reads nor writes them."""
        held = self.incarnation_of(key[0])
        if held != incarnation:
            now = "deleted" if held is None else f"incarnation {held}"
            raise IncarnationMismatch(
                f"a call about incarnation {incarnation} of topic {key[0]!r}, which this node's view of the site's "
                f"metadata holds as {now}: refused; the caller tries again once the views agree"
            )
        with self._lock:
            stale = self._partitions.get(key)
            if stale is None or stale.incarnation >= held:
                return
            del self._partitions[key]
        self._move_out([stale], "a later incarnation of the topic is asked for here")

    def remove_deleted(self, entries: Mapping[str, TopicEntry]) -> list[str]:
        """Move out and remove every copy of a topic incarnation ``entries`` (the site's) hold deleted, open or
        not: at or below a tombstone, or below the live incarnation. Never one of a live incarnation, nor of a
        topic the entries do not know. The directories removed."""
        with self._lock:
            gone = [
                p
                for _, p in sorted(self._partitions.items())
                if incarnation_deleted(entries.get(p.key[0]), p.incarnation)
            ]
            for p in gone:
                del self._partitions[p.key]
                self._trimmed_before.pop(p.key, None)
        self._move_out(gone, "its topic incarnation was deleted")
        names: list[str] = [p.directory.name for p in gone]
        for incarnation, left in deleted_incarnation_dirs(self.root, entries).items():  # not open: an earlier one
            remove_moved(move_to_deleted(self.root, self.deleted_dir, left, incarnation))
            names += left
        return sorted(names)

    def _move_out(self, gone: Sequence[PartitionReplicas], why: str) -> None:
        """Close the copies of ``gone`` (no longer in the store), move their directories into ``deleted-replicas/``
        (durably: from there they are out of every partition's way) and remove them."""
        for p in gone:
            with p.lock:
                for seg in p.segments.values():
                    seg.close()
                p.segments.clear()
            self.lacs.forget(p.key)
            if p.made:
                remove_moved(move_to_deleted(self.root, self.deleted_dir, [p.directory.name], p.incarnation))
            log.warning("removed this node's copies of %s-%d (incarnation %d): %s", *p.key, p.incarnation, why)

    def close(self) -> None:
        with self._lock:
            every = list(self._partitions.values())
            self._partitions.clear()
        for p in every:
            with p.lock:
                for seg in p.segments.values():
                    seg.close()
