"""The node's partitions: the asyncio shell around the broker's pure decisions.

The decisions live in ``georep/broker/`` and the simulator drives the same
ones: :func:`~georep.broker.append.append_as_origin` takes a produced batch,
:class:`~georep.broker.acks.AckTable` says when its ack may go and when to
fsync, ``apply_chunk`` (``georep/replication/sink.py``) takes a replicated
chunk. This module adds what a process needs around them: partition logs on
disk, fsyncs in worker threads, replicated applies in a writer thread, and an
asyncio future per waiting ack, resolved by the table's effects. It raises
the domain errors of ``georep/broker/errors.py``; the gRPC layer maps them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import heapq
import itertools
import logging
import os
import re
import shutil
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from dedup.producer import ProducerStateTable
from georep.broker.acks import (
    LEADER,
    AckKind,
    Acks,
    AckTable,
    Effect,
    Fail,
    HeldChanged,
    Release,
    StartFlush,
    Token,
    check_acks,
)
from georep.broker.append import Produced, append_as_origin
from georep.broker.errors import BrokerError, InternalTopic, NotEnoughReplicas, NotLeader, UnknownPartition, WriteFailed
from georep.broker.retention_schedule import RetentionSchedule
from georep.metadata.kafka_config import SiteSettings, check_quorum
from georep.metadata.store import MetadataStore, SiteIdentity, TopicExists, UnknownTopic
from georep.metadata.topic_entry import TopicEntry
from georep.metadata.topics import (
    InvalidTopic,
    TopicSpec,
    parse_topic_config,
    validate_partitions,
    validate_topic_name,
)
from georep.record.validate import TimestampWindow
from georep.replication.sink import ApplyOutcome, CorruptChunk, InvalidChunk, apply_chunk
from georep.server import retention_run
from georep.server.group_flush import GroupFlush
from georep.server.retention_run import RetentionRun
from georep.storage import api as storage_api
from georep.storage.api import DamagedBatch, DiskFull, LogConfig, PartitionLog, ScrubStep
from georep.storage.deleted_dirs import DELETED_DIR, finish_removals
from georep.storage.durable_file import fsync_directory
from georep.storage.metadata_file import FileMetadataStore
from georep.storage.partition_dirs import partition_dir_name, topic_file_name
from georep.storage.private import FILE_MODE, private_dir
from georep.storage.recovery_checkpoint import RecoveryCheckpoint
from georep.storage.segment_log import SegmentLog, create_empty_log, sync_filesystem
from offsets.coordinates import LocalOffset, Origin
from offsets.held import HeldTable
from offsets.vector import VectorOffset
from topology.filters import INTERNAL_TOPIC_PREFIX, is_internal

log = logging.getLogger(__name__)

DEFAULT_TOPIC_CONFIG: dict[str, int] = {
    "segment_bytes_max": 1 << 30,
    "segment_ms": 7 * 24 * 3600 * 1000,
    "retention_ms": -1,
    "retention_bytes": -1,
    "flush_interval_ms": 0,
    "max_batch_bytes": 8 << 20,
    # Kafka 4.0's defaults: any age, at most an hour ahead (checked at the origin only: georep/record/validate.py)
    "message_timestamp_before_max_ms": -1,
    "message_timestamp_after_max_ms": 3600 * 1000,
}


CREATING_DIR = "creating"
FSYNC_THREADS = 4


def _consume_exception(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class Partition:
    """One topic-partition: its log, its producer state, and what readers wait on."""

    def __init__(
        self,
        topic: str,
        index: int,
        log_: PartitionLog,
        config: dict[str, int],
        origin: Origin,
        now_ms: int,
        producers: ProducerStateTable | None = None,
    ) -> None:
        self.topic = topic
        self.index = index
        self.key = (topic, index)
        self.log = log_
        self.config = config
        # A multi-node site's leader passes the table its chain's last seal carries (georep/server/site_cluster.py).
        # Otherwise it is rebuilt from the log at its first use, not at open: a start with 10,000 partitions read
        # every batch entry of each only for this. Safe, because only this site's own appends (which use the table
        # first) add batches the rebuild replays; replicated batches are not replayed.
        self._producers = producers
        self._origin = origin
        self._opened_ms = now_ms  # the rebuild expires what a rebuild at open would have
        self._appended: asyncio.Future[None] | None = None
        self._durable: asyncio.Future[None] | None = None
        # Told the key at every notify_durable: the replication streams and links that follow only what moved.
        self.durable_watchers: set[Callable[[tuple[str, int]], None]] = set()
        self.last_flush_mono_ms = 0
        # A partition of a multi-node site (georep/server/site_cluster.py): appends go on to the segment's writer,
        # which fsyncs the leader's copy itself; ``sealing`` says its segment takes no more appends.
        self.in_site: InSiteReplication | None = None
        self.sealing = False

    @property
    def producers(self) -> ProducerStateTable:
        """Each producer's last sequences here (idempotent produce), rebuilt from the log at the first use."""
        if self._producers is None:
            entries = self.log.batch_entries()
            self._producers = ProducerStateTable.rebuild(entries, now_ms=self._opened_ms, origin=self._origin)
        return self._producers

    def expire_producers(self, now_ms: int) -> int | None:
        """Forget producers idle past their expiry (nothing to do for a table not rebuilt yet); returns when the
        next one expires, unless a producer appends meanwhile (None: no producer is known)."""
        if self._producers is None:
            return None
        self._producers.expire(now_ms)
        return self._producers.next_expiry_ms()

    @property
    def fsync_per_batch(self) -> bool:
        return self.config["flush_interval_ms"] == 0

    def appended(self) -> asyncio.Future[None]:
        """A future resolved at the next append (for long-poll fetches)."""
        if self._appended is None or self._appended.done():
            self._appended = asyncio.get_running_loop().create_future()
        return self._appended

    def notify_append(self) -> None:
        if self._appended is not None and not self._appended.done():
            self._appended.set_result(None)

    def durable(self) -> asyncio.Future[None]:
        """A future resolved when ``log.flushed_offset`` next advances (readers see only flushed batches)."""
        if self._durable is None or self._durable.done():
            self._durable = asyncio.get_running_loop().create_future()
        return self._durable

    def notify_durable(self) -> None:
        if self._durable is not None and not self._durable.done():
            self._durable.set_result(None)
        for watch in tuple(self.durable_watchers):
            watch(self.key)


class InSiteReplication(Protocol):
    """A partition's segment writer, as the broker drives it (a multi-node site's leader node)."""

    def appended(self, end: int) -> None:
        """Batches were appended to the leader's copy up to ``end``: stream and fsync them."""

    def flush(self) -> None:
        """fsync the leader's copy (the writer reports it through ``Broker.own_flush_done``)."""


@dataclass(frozen=True, slots=True)
class NewTopics:
    """Topics :meth:`Broker.open_new_topics` made on disk (by name: the spec and its partitions' logs), and the
    ones it could not make."""

    opened: dict[str, tuple[TopicSpec, list[PartitionLog]]]
    failed: dict[str, Exception]


def _create_failed(name: str, exc: Exception) -> Exception:
    """What a create of ``name`` that the disk refused raises: nothing of the topic was kept."""
    full = isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
    if full:
        return DiskFull(
            f"cannot create topic {name!r}: {exc}; free disk space, then create it again (nothing of it was kept)"
        )
    return WriteFailed(f"cannot create topic {name!r}: {exc}; nothing of it was kept")


class SegmentLogs(NamedTuple):
    """A node's own partition logs in ``logs_dir``: their checkpoint, and how to open one, one at start, and a new
    one (unsynced: :meth:`Broker.open_new_topics` syncs the file system once for all of a create's)."""

    checkpoint: RecoveryCheckpoint
    open: Callable[[Path, LogConfig, int], PartitionLog]
    open_at_start: Callable[[Path, LogConfig, int], PartitionLog]
    create: Callable[[Path, LogConfig, int], PartitionLog]


def _segment_logs(logs_dir: Path) -> SegmentLogs:
    checkpoint = RecoveryCheckpoint.load(logs_dir)
    # One sync of the file system makes durable whatever a killed predecessor left in the page cache, so each
    # partition's open at start fsyncs only what it changes (10,000 partitions: seconds, not minutes). Only at
    # start: later opens are of directories this process may have written.
    sync_filesystem(logs_dir)
    return SegmentLogs(
        checkpoint,
        functools.partial(SegmentLog.open, points=checkpoint),
        functools.partial(SegmentLog.open, filesystem_synced=True, points=checkpoint),
        functools.partial(create_empty_log, points=checkpoint),
    )


@dataclass(frozen=True, slots=True)
class ReplicaApply:
    """What :meth:`Broker.append_replica` applied: each chunk's outcome, in order, up to the one that failed
    (``error``), or all of them; and the partitions the hop also fsynced (``synced``, after their last chunk)."""

    outcomes: list[ApplyOutcome]
    error: Exception | None = None
    synced: tuple[Partition, ...] = ()


# Chunks a replica writer hop applies between two of its syncfs: well under the handle cache's bound, so that a
# segment the hop wrote is synced (clean) before later chunks of the same hop evict it, which would fdatasync it.
SYNC_CHUNKS = 256


def _apply_chunks(
    chunks: Sequence[tuple[Partition, bytes]], now_ms: int, sync: Callable[[list[SegmentLog]], object] | None
) -> ReplicaApply:
    """The replica writer thread's part of ``Broker.append_replica``: stops at the first chunk that raises.

    ``sync`` (a :meth:`GroupFlush.sync_together`), if given, flushes the partitions written that fsync every
    batch, one syncfs per ``SYNC_CHUNKS`` chunks; a partition counts as synced only once its syncfs returned
    (a held report and the source read only what ``flushed_offset`` covers). A failed syncfs leaves the rest to
    the partitions' own flushes."""
    outcomes: list[ApplyOutcome] = []
    error: Exception | None = None
    written: dict[Partition, None] = {}
    synced: list[Partition] = []
    for p, batches in chunks:
        try:
            outcomes.append(apply_chunk(p.log, batches, now_ms, p.config["max_batch_bytes"]))
        except Exception as exc:  # the loop's side sorts it (_replica_error): the outcomes before it count
            error = exc
            break
        if sync is not None and outcomes[-1].appended_batches and _syncs_here(p):
            written[p] = None
            if len(written) >= SYNC_CHUNKS:
                sync = _sync(sync, written, synced)
    if sync is not None and written:
        _sync(sync, written, synced)
    return ReplicaApply(outcomes, error, tuple(synced))


def _syncs_here(p: Partition) -> bool:
    """A partition the replica writer flushes itself: this node's alone (not a segment of a multi-node site,
    which its segment writer flushes), fsynced per batch (not on an interval), and on the group's file system."""
    return p.in_site is None and p.config["flush_interval_ms"] <= 0 and isinstance(p.log, SegmentLog)


def _sync(
    sync: Callable[[list[SegmentLog]], object], written: dict[Partition, None], synced: list[Partition]
) -> Callable[[list[SegmentLog]], object] | None:
    """One syncfs of ``written``'s logs; then they are ``synced``. None after a failure: no more syncs this hop."""
    logs = [p.log for p in written if isinstance(p.log, SegmentLog)]
    try:
        sync(logs)
    except OSError as exc:
        log.error("replica writer: syncfs of %d partition(s) failed (%s); their own flushes try again", len(logs), exc)
        written.clear()
        return None
    synced += written
    written.clear()
    return sync


def _replica_error(p: Partition, exc: Exception) -> Exception:
    """A chunk's apply error as the puller reports it, naming the partition; a bug's is raised."""
    if isinstance(exc, (DiskFull, BrokerError)):
        return exc
    if isinstance(exc, InvalidChunk):
        return InvalidChunk(f"{p.topic}-{p.index}: {exc}")
    if isinstance(exc, CorruptChunk):
        return exc
    if isinstance(exc, OSError):
        return WriteFailed(f"write to {p.topic}-{p.index} failed: {exc}")
    raise exc


class Broker:
    def __init__(
        self,
        data_dir: Path,
        identity: SiteIdentity,
        defaults: dict[str, int] | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        open_log: Callable[[Path, LogConfig, int], PartitionLog] | None = None,
        metadata: MetadataStore | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.identity = identity
        self.origin = Origin(identity.site, identity.epoch)
        self.defaults = {**DEFAULT_TOPIC_CONFIG, **(defaults or {})}
        self.site = SiteSettings()  # a multi-node site's replication and quorum flags: what a topic may ask
        self.clock_ms = clock_ms
        self.logs_dir = data_dir / "logs"
        private_dir(self.logs_dir)
        # Opening at start, a create's logs (unsynced), all recovery points in one file: None with the caller's logs
        self._open_at_start: Callable[[Path, LogConfig, int], PartitionLog] | None = open_log
        self._create_log: Callable[[Path, LogConfig, int], PartitionLog] | None = None
        self.checkpoint: RecoveryCheckpoint | None = None
        if open_log is None:
            self.checkpoint, open_log, self._open_at_start, self._create_log = _segment_logs(self.logs_dir)
        self.open_log = open_log
        self.creating_dir = data_dir / CREATING_DIR  # topic creates under way (``_finish_creates``)
        self.creating: set[str] = set()  # names whose create is under way (files made in a worker thread)
        self.received_entries: dict[str, TopicEntry] = {}  # a topic sync's, while it creates from them
        # A multi-node site keeps its topics in its Raft metadata, and this node serves only the partitions it
        # leads, attached as it comes to lead them (``attach``); a one-node site opens every partition here.
        self.in_site = metadata is not None
        self.metadata: MetadataStore = metadata or FileMetadataStore(data_dir / "topics.json", identity.site, clock_ms)
        # Where to send a client for a partition this node does not lead (multi-node sites).
        self.leader_hint: Callable[[str, int], str] = lambda topic, index: ""
        self.unplaceable: Callable[[str, int], str | None] = lambda t, i: None  # why it can open no segment it leads
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.executor = ThreadPoolExecutor(max_workers=FSYNC_THREADS, thread_name_prefix="fsync")
        # Partitions flushed at the same time share one syncfs beyond FSYNC_THREADS at once (group_flush.py).
        self.flusher = GroupFlush(self.executor, self.logs_dir, FSYNC_THREADS)
        # Replicated chunks are applied here, off the event loop: the page-cache write was most of a pulling node's
        # loop time, and the loop can take in the next chunk meanwhile. One thread, so that two upstreams sending
        # the same origin during a failover never plan against the same vector at once.
        self.replica_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="apply")
        self.disk_full = False
        self.on_produce: Callable[[str, int, int], None] = lambda topic, records, size: None
        # Called with (name, partitions) for every topic this node opens: at startup, on CreateTopic, from replication
        self.on_topic: Callable[[str, int], None] = lambda name, partitions: None
        # Called with every partition this node opens or comes to lead (after its ack table knows it).
        self.on_open: Callable[[Partition], None] = lambda p: None
        # Bumped whenever ``partitions`` gains or loses one: who caches a view of it knows when to look again.
        self.partitions_version = 0
        # When acks may go, and when to fsync (georep/broker/acks.py); its held table serves acks=geo:N.
        self.acks = AckTable(identity.site, self.origin)
        self.on_held: Callable[[], None] = lambda: None  # the held table learned something: report it upstream
        # How many sites (this one included) this site's records of a topic reach; the
        # replicator replaces it from the topology. A standalone node reaches itself only.
        self.geo_reach: Callable[[str], int] = lambda topic: 1
        self._waiters: dict[Token, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        self._geo_timer: asyncio.TimerHandle | None = None
        self._geo_timer_due = 0
        # The periodic flush follows writes: a heap of (due, key) for the partitions written since their last
        # fsync, so an idle partition costs nothing per tick (``flush_due``, ``_flush_loop``).
        self._flush_heap: list[tuple[int, tuple[str, int]]] = []
        self._flush_scheduled: set[tuple[str, int]] = set()
        self.flush_wanted = asyncio.Event()  # set when the earliest due flush moved earlier
        # Retention visits the partitions written since its last run and those whose data falls due, not every
        # partition (georep/broker/retention_schedule.py).
        self.retention = RetentionSchedule()
        now = self.clock_ms()
        if not self.in_site:
            self._finish_creates()
        try:
            for spec in self.metadata.topics().values() if not self.in_site else ():
                self._open_topic(spec, now, starting=True)
        except BaseException:
            for p in self.partitions.values():
                p.log.close()
            raise
        if self.checkpoint is not None:
            self.checkpoint.started([partition_dir_name(t, i, self.topic(t).incarnation) for t, i in self.partitions])

    @property
    def held(self) -> HeldTable:
        """What each site is known to hold fsynced (the ack table's, for acks=geo:N)."""
        return self.acks.held

    # -- topics ---------------------------------------------------------------

    def _open_topic(self, spec: TopicSpec, now_ms: int, *, starting: bool = False) -> None:
        self._serve_topic(spec, self._open_logs(spec, now_ms, starting=starting), now_ms)

    def _open_logs(
        self, spec: TopicSpec, now_ms: int, *, starting: bool = False, first: int = 0, new: bool = False
    ) -> list[PartitionLog]:
        """Make and open ``spec``'s partition logs from index ``first`` (a growth opens only its new ones): files
        only, no table of the broker's (so a worker thread may do it). If one fails, the ones opened are closed and
        the error raised. ``starting``: the node's start-up, which opens through ``_open_at_start`` when it has
        one. ``new``: a create's, through ``_create_log`` when it has one, unsynced (the caller syncs)."""
        config = spec.effective(self.defaults)
        log_config = LogConfig(
            segment_bytes_max=config["segment_bytes_max"],
            segment_ms=config["segment_ms"],
            retention_ms=config["retention_ms"],
            retention_bytes=config["retention_bytes"],
            flush_interval_ms=config["flush_interval_ms"],
        )
        opener = self._open_at_start if starting and self._open_at_start is not None else self.open_log
        if new and self._create_log is not None:
            opener = self._create_log
        logs: list[PartitionLog] = []
        try:
            for i in range(first, spec.partitions):
                directory = self.logs_dir / partition_dir_name(spec.name, i, spec.incarnation)
                private_dir(directory)
                logs.append(opener(directory, log_config, now_ms))
        except BaseException:
            for plog in logs:
                plog.close()
            raise
        return logs

    def _serve_topic(self, spec: TopicSpec, logs: list[PartitionLog], now_ms: int, *, first: int = 0) -> None:
        """Serve ``spec``'s partitions from index ``first`` over ``logs`` (on the event loop: the broker's tables
        change)."""
        config = spec.effective(self.defaults)
        for i, plog in enumerate(logs, start=first):
            p = self.partitions[(spec.name, i)] = Partition(spec.name, i, plog, config, self.origin, now_ms)
            self.partitions_version += 1
            if plog.log_end_offset > plog.log_start_offset:  # its first visit learns when its data falls due
                self.retention.written(p.key)
            # (An empty log has nothing to delete nor producers to expire until its first write marks it: a create
            # of 10,000 partitions made the next run visit each, once.)
            p.durable_watchers.add(self.retention.written)
            self.acks.open_partition(p.key, p.fsync_per_batch, plog.flushed_offset, VectorOffset(plog.flushed_vector()))
            self.on_open(p)

    def check_new_topic(
        self, name: str, partitions: int, raw_config: dict[str, str], *, internal: bool = False
    ) -> TopicSpec:
        """The topic :meth:`create_topic` would create (a validate-only create asks this alone). Raises
        ``InternalTopic``, ``InvalidTopic`` or ``TopicExists``.

        Clients never create georep's internal topics: this is the one place that says so, as :meth:`append` is
        for their writes (georep's ``CreateTopic`` and Kafka's both come here). Only georep itself passes
        ``internal=True``: the group coordinator's commit topic, and topics a link replicates from a peer."""
        if is_internal(name) and not internal:
            raise InternalTopic(
                f"topic names starting with {INTERNAL_TOPIC_PREFIX!r} are reserved for georep: choose another name"
            )
        validate_topic_name(name)
        validate_partitions(partitions)
        spec = TopicSpec(name, partitions, parse_topic_config(raw_config))
        if not internal:  # a topic a link brings was checked at its own site, whose settings differ
            check_quorum(spec.config, self.site)
        if name in self.creating:
            raise TopicExists(name)
        try:
            self.metadata.get(name)  # not topics(): a copy of the whole table per create
        except UnknownTopic:
            # The incarnation its files are made for: the one the table will store (the next after a tombstone), in
            # directories of its own (a deleted incarnation's may still be on their way out).
            held = self.metadata.entries().get(name)
            received = self.received_entries.get(name)
            if received is not None:
                return dataclasses.replace(spec, incarnation=received.incarnation)
            return spec if held is None else dataclasses.replace(spec, incarnation=held.incarnation + 1)
        raise TopicExists(name)

    def create_topic(
        self, name: str, partitions: int, raw_config: dict[str, str], *, internal: bool = False
    ) -> TopicSpec:
        """Raises what :meth:`check_new_topic` raises, ``DiskFull`` or ``WriteFailed``."""
        (outcome,) = self.create_topics([(name, partitions, raw_config)], internal=internal)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def create_topics(
        self, requests: Sequence[tuple[str, int, dict[str, str]]], *, internal: bool = False
    ) -> list[TopicSpec | Exception]:
        """Create each of ``requests`` (name, partitions, config) or say why not, in their order: what
        :meth:`create_topic` returns or raises. A one-node site writes its topic table once for them all (not once
        per topic: a table of n topics is rewritten whole); a multi-node site commits one Raft command each."""
        outcomes, specs = self.check_new_topics(requests, internal=internal)
        if self.in_site:
            # The site's Raft metadata (blocking: the service calls this in a worker thread); each partition's
            # leader attaches it here once its first segment is open.
            for i, outcome in enumerate(outcomes):
                if isinstance(outcome, TopicSpec):
                    try:
                        self.metadata.create_topic(outcome)
                    except Exception as exc:  # each topic's own answer: what its single create raises
                        outcomes[i] = exc
            return outcomes
        self.creating.update(s.name for s in specs)
        try:
            failed = self.serve_new_topics(self.open_new_topics(specs))
        finally:
            self.creating.difference_update(s.name for s in specs)
        return [failed.get(o.name, o) if isinstance(o, TopicSpec) else o for o in outcomes]

    def check_new_topics(
        self, requests: Sequence[tuple[str, int, dict[str, str]]], *, internal: bool = False
    ) -> tuple[list[TopicSpec | Exception], list[TopicSpec]]:
        """What :meth:`check_new_topic` says of each request (a name asked twice: ``TopicExists`` the second
        time), and the topics to create."""
        outcomes: list[TopicSpec | Exception] = []
        specs: dict[str, TopicSpec] = {}
        for name, partitions, raw_config in requests:
            try:
                spec = self.check_new_topic(name, partitions, raw_config, internal=internal)
                if name in specs:
                    raise TopicExists(name)
            except (InternalTopic, InvalidTopic, TopicExists) as exc:
                outcomes.append(exc)
                continue
            outcomes.append(spec)
            specs[name] = spec
        return outcomes, list(specs.values())

    def open_new_topics(self, specs: list[TopicSpec]) -> NewTopics:
        """A one-node site's creates, on disk: their intents, then their partition logs, until the disk refuses
        one (that one and the next ones fail, with nothing of them left). Touches no table of the broker's, so it
        runs in a worker thread while the node serves (its names in :attr:`creating` first, on the event loop);
        :meth:`serve_new_topics` finishes them."""
        opened: dict[str, tuple[TopicSpec, list[PartitionLog]]] = {}
        failed: dict[str, Exception] = {}
        if not specs:
            return NewTopics(opened, failed)
        intents = {spec.name: self.creating_dir / topic_file_name(spec.name) for spec in specs}
        try:
            private_dir(self.creating_dir)
            for intent in intents.values():  # empty: its name is all it says, made durable by the directory's fsync
                os.close(os.open(intent, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE))
            fsync_directory(self.creating_dir)
        except OSError as exc:
            for spec in specs:
                self._remove_create(spec.name, intents[spec.name])
                failed[spec.name] = _create_failed(spec.name, exc)
            return NewTopics(opened, failed)
        now = self.clock_ms()
        refused: OSError | DiskFull | None = None
        for spec in specs:
            if refused is not None:  # the disk refused a topic: the next ones are not tried, for the same reason
                intents[spec.name].unlink(missing_ok=True)
                failed[spec.name] = _create_failed(spec.name, refused)
                continue
            try:
                opened[spec.name] = (spec, self._open_logs(spec, now, new=True))
            except (OSError, DiskFull) as exc:
                self._remove_create(spec.name, intents[spec.name])
                failed[spec.name] = _create_failed(spec.name, exc)
                refused = exc
        try:  # one sync of the file system for every log made (unsynced); if it fails, none of them is created
            if opened and self._create_log is not None:
                sync_filesystem(self.logs_dir)
        except OSError as exc:
            for name, (_spec, logs) in list(opened.items()):
                for plog in logs:
                    plog.close()
                self._remove_create(name, intents[name])
                failed[name] = _create_failed(name, exc)
                del opened[name]
        return NewTopics(opened, failed)

    def serve_new_topics(self, new: NewTopics) -> dict[str, Exception]:
        """Serve the topics :meth:`open_new_topics` opened and add them to the topic table (one write), on the
        event loop; the topics that failed, and why. A topic is in the table whole or not at all."""
        failed = dict(new.failed)
        self.creating.difference_update([*new.opened, *new.failed])
        if not new.opened:
            return failed
        assert isinstance(self.metadata, FileMetadataStore)
        now = self.clock_ms()
        for spec, logs in new.opened.values():
            self._serve_topic(spec, logs, now)
        specs = [spec for spec, _logs in new.opened.values()]
        try:
            self.metadata.create_topics(specs, self.received_entries)
        except (OSError, DiskFull) as exc:
            for spec in specs:
                self._undo_create(spec.name, spec.partitions, self.creating_dir / topic_file_name(spec.name))
                failed[spec.name] = _create_failed(spec.name, exc)
            return failed
        try:
            for spec in specs:
                (self.creating_dir / topic_file_name(spec.name)).unlink()
        except OSError as exc:  # the topics are whole; the next start sees them defined and drops the intents
            log.warning("topics created, but intents in %s stay until the next start: %s", self.creating_dir, exc)
        for spec in specs:
            self.on_topic(spec.name, spec.partitions)
        return failed

    def _remove_create(self, name: str, intent: Path) -> None:
        """What a create of ``name`` that never served left on disk (off the event loop too)."""
        try:
            self._remove_leftovers(name)
            intent.unlink(missing_ok=True)
        except OSError as exc:
            log.error(
                "the failed create of topic %r left files that could not be removed yet (%s): the next start "
                "removes them",
                name,
                exc,
            )

    # A topic create is made atomic on disk by an intent file (``creating/<topic>``), written and fsynced before the
    # first partition directory and removed once the topic is in the topic table. The partition directories cannot
    # appear at once (a rename into ``logs/`` per directory is no more atomic than a mkdir, and the Spark audit and
    # the operator expect them there), so the intent says which are a create's leftovers: a crash or a full disk
    # midway leaves an intent whose topic the table lacks, and its directories are removed (here, or at the next
    # start), so the create can be made again from nothing. A topic in the table is whole: its create finished.

    def _undo_create(self, name: str, partitions: int, intent: Path) -> None:
        """Close and remove what a failed create of ``name`` made (in memory and on disk); leftovers that cannot be
        removed now stay under the intent, for the next start."""
        for i in range(partitions):
            p = self.partitions.pop((name, i), None)
            self.partitions_version += 1
            if p is not None:
                self.acks.close_partition(p.key, WriteFailed(f"topic {name!r} was not created"))
                p.log.close()
        self._remove_create(name, intent)

    def _remove_leftovers(self, name: str) -> list[str]:
        """Remove the partition directories of ``name``, a topic the table lacks, that hold no batch; the ones
        removed. A directory holding batches is left (with an error): no create makes one."""
        pattern = re.compile(re.escape(topic_file_name(name)) + r"(@\d+)?-\d+")
        removed = []
        for directory in sorted(self.logs_dir.iterdir()):
            if not pattern.fullmatch(directory.name) or not directory.is_dir():
                continue
            if any(f.stat().st_size for f in directory.glob("*.log")):
                log.error(
                    "partition directory %s holds batches of topic %r, which is not in the topic table: left as "
                    "it is; move it away if the topic is not to be restored",
                    directory,
                    name,
                )
                continue
            shutil.rmtree(directory)
            removed.append(directory.name)
        if removed:
            fsync_directory(self.logs_dir)
            if self.checkpoint is not None:
                self.checkpoint.forget(removed)
        return removed

    def _finish_creates(self) -> None:
        """Roll back the creates a crash or a full disk interrupted (their intents whose topic the table lacks),
        after finishing the deletes one interrupted (so their directories are out of a create's way)."""
        finish_removals(self.logs_dir, self.data_dir / DELETED_DIR, self.metadata.entries(), self.checkpoint)
        if not self.creating_dir.is_dir():
            return
        defined = {topic_file_name(t) for t in self.metadata.topics()}
        for intent in sorted(self.creating_dir.iterdir()):
            name = urllib.parse.unquote(intent.name)
            if intent.name not in defined:
                removed = self._remove_leftovers(name)
                log.warning(
                    "the create of topic %r did not finish (the node stopped or the disk filled up midway): "
                    "removed its %d partition director%s; create the topic again",
                    name,
                    len(removed),
                    "y" if len(removed) == 1 else "ies",
                )
            intent.unlink()
        fsync_directory(self.creating_dir)

    def topic(self, name: str) -> TopicSpec:
        """Raises ``UnknownTopic``."""
        return self.metadata.get(name)

    def partition(self, topic: str, index: int) -> Partition:
        """Raises ``UnknownTopic``, ``UnknownPartition``, or ``NotLeader`` on a multi-node site's other nodes."""
        spec = self.topic(topic)
        p = self.partitions.get((topic, index))
        if p is None:
            if self.in_site and 0 <= index < spec.partitions:
                raise NotLeader(
                    topic, index, "another node of the site leads it, or none does yet", self.leader_hint(topic, index)
                )
            raise UnknownPartition(topic, index, spec.partitions)
        return p

    # -- partitions of a multi-node site ------------------------------------------------------------------

    def attach(
        self,
        spec: TopicSpec,
        index: int,
        log_: PartitionLog,
        in_site: InSiteReplication,
        lac: int,
        lac_vector: VectorOffset,
        producers: ProducerStateTable | None = None,
    ) -> Partition:
        """Serve ``spec``'s partition ``index``, which this node now leads, over ``log_`` (a ``ChainLog``), with the
        idempotent producers' table ``producers`` (else rebuilt from ``log_``'s batch index)."""
        config = spec.effective(self.defaults)
        p = Partition(spec.name, index, log_, config, self.origin, self.clock_ms(), producers)
        p.in_site = in_site
        old = self.partitions.get(p.key)
        if old is not None:
            self.detach(p.key, NotLeader(spec.name, index, "its segment changed"))
        self.partitions[p.key] = p
        self.partitions_version += 1
        self.retention.written(p.key)
        p.durable_watchers.add(self.retention.written)
        self.acks.open_partition(
            p.key, p.fsync_per_batch, lac, lac_vector, replicated_in_site=True, lac=lac, lac_vector=lac_vector
        )
        self.on_open(p)
        self.on_topic(spec.name, spec.partitions)
        p.notify_append()
        return p

    def detach(self, key: tuple[str, int], error: NotLeader) -> None:
        """Stop serving ``key``: its unconfirmed acks fail with ``error`` (the producer retries at the leader)."""
        p = self.partitions.pop(key, None)
        if p is None:
            return
        self.partitions_version += 1
        self._perform(self.acks.close_partition(key, error))
        p.notify_append()
        p.notify_durable()  # long-polling readers wake up and find the partition gone

    def quorum_advanced(self, key: tuple[str, int], lac: int, lac_vector: VectorOffset) -> None:
        """The ack quorum of ``key``'s open segment holds everything below ``lac``."""
        p = self.partitions.get(key)
        if p is None:
            return
        p.notify_durable()
        self._perform(self.acks.quorum_advanced(key, lac, lac_vector))

    def own_flush_done(self, key: tuple[str, int], flushed: int | None, error: str = "") -> None:
        """The leader's fsync of its own copy of ``key``'s open segment ended (``flushed``), or failed."""
        if key not in self.partitions:
            return
        if flushed is None:
            self._perform(self.acks.flush_failed(key, error))
            p = self.partitions.get(key)
            if p is not None:
                self._schedule_flush(p)
        else:
            self._perform(self.acks.flush_done(key, flushed, VectorOffset()))

    # -- produce --------------------------------------------------------------

    def append(
        self, topic: str, index: int, batch: bytes, acks: Acks = LEADER, *, internal: bool = False
    ) -> tuple[Partition, Produced]:
        """Take one producer batch as its origin (``append_as_origin``). Synchronous, so batches
        on one stream are appended in the order they arrived.

        Clients never write georep's internal topics (``topology.filters.is_internal``): this is the one place
        that says so, so every produce path meets it (gRPC ``Produce`` and ``ProduceStream``, the Kafka
        gateway). Only georep's own writers pass ``internal=True``: the group coordinator's commits."""
        if is_internal(topic) and not internal:
            raise InternalTopic(
                f"topic {topic!r} is internal to georep and clients cannot write to it: consumer "
                "positions are stored by a group's commit (georep consume --group, Consumer.commit, "
                "a Kafka client's commit)"
            )
        p = partition_to_write(self, topic, index)
        if p.sealing:
            raise NotLeader(
                topic, index, "its segment is being sealed; retry in a moment", self.leader_hint(topic, index)
            )
        if acks.kind is AckKind.GEO:  # the reach walks the topology: not for every batch of every other level
            check_acks(acks, topic, self.identity.site, self.geo_reach(topic))
        try:
            now = self.clock_ms()
            window = TimestampWindow(
                now, p.config["message_timestamp_before_max_ms"], p.config["message_timestamp_after_max_ms"]
            )
            produced = append_as_origin(
                p.log,
                p.producers,
                self.origin,
                batch,
                topic=topic,
                max_batch_bytes=p.config["max_batch_bytes"],
                now_ms=now,
                window=window,
            )
        except DiskFull:
            self.disk_full = True
            raise
        except OSError as exc:
            raise WriteFailed(f"write to {topic}-{index} failed: {exc}") from None
        if not produced.duplicate:
            self.disk_full = False
            if p.in_site is not None:
                p.in_site.appended(p.log.log_end_offset)
            p.notify_append()
            self._schedule_flush(p)
            self.on_produce(topic, produced.records, len(batch))
        return p, produced

    def ack_waiter(
        self, p: Partition, produced: Produced, acks: Acks = LEADER, timeout_ms: int = 0
    ) -> asyncio.Future[None] | None:
        """What the ack must wait for to be as durable as its level promises (``AckTable``); None: nothing."""
        token = next(self._tokens)
        r = produced.result
        effects = self.acks.wait(
            token, p.key, produced.end_offset, produced.origin, r.last_origin_seq, acks, self.clock_ms(), timeout_ms
        )
        if Release(token) in effects:
            self._perform(effects)
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume_exception)
        self._waiters[token] = fut
        self._perform(effects)
        if acks.kind is AckKind.GEO:  # only a geo waiter has a deadline
            self._arm_geo_timer()
        return fut

    async def produce(self, topic: str, index: int, batch: bytes, acks: Acks = LEADER, timeout_ms: int = 0) -> Produced:
        p, produced = self.append(topic, index, batch, acks)
        waiter = self.ack_waiter(p, produced, acks, timeout_ms)
        if waiter is not None:
            await waiter
        return produced

    def report_held(self, entries: list[tuple[str, str, int, VectorOffset]]) -> None:
        """Take in what other sites hold (``ReportHeld``); this site's own entry comes from its fsyncs."""
        self._perform(self.acks.held_reported(entries))

    # -- the ack table's effects ------------------------------------------------

    def _perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Release):
                fut = self._waiters.pop(effect.token, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif isinstance(effect, Fail):
                fut = self._waiters.pop(effect.token, None)
                if fut is not None and not fut.done():
                    fut.set_exception(effect.error)
            elif isinstance(effect, StartFlush):
                self._start_flush(effect.key)
            elif isinstance(effect, HeldChanged):
                self.on_held()

    def _start_flush(self, key: tuple[str, int]) -> None:
        p = self.partitions[key]
        if p.in_site is not None:
            p.in_site.flush()  # the segment writer fsyncs the copy it streams from, and reports own_flush_done
            return
        try:
            task = self.flusher.flush(p.log)
        except RuntimeError:  # the executor is shut down: the node is stopping
            self._perform(self.acks.close())
            return
        task.add_done_callback(lambda t: self._flush_done(p, t))

    def _flush_done(self, p: Partition, task: asyncio.Future[LocalOffset]) -> None:
        # A cancelled fsync (shutdown) must still release its waiters, with an error.
        exc = asyncio.CancelledError("fsync cancelled") if task.cancelled() else task.exception()
        if exc is not None:
            log.error("fsync of %s-%d failed: %s", p.topic, p.index, exc)
            self._perform(self.acks.flush_failed(p.key, str(exc) or type(exc).__name__))
            self._schedule_flush(p)  # the periodic flush tries again, as it did when it walked every partition
            return
        p.last_flush_mono_ms = int(time.monotonic() * 1000)
        p.notify_durable()
        self._perform(self.acks.flush_done(p.key, p.log.flushed_offset, VectorOffset(p.log.flushed_vector())))

    def _arm_geo_timer(self) -> None:
        """Expire geo waiters on time: one timer, at the table's next deadline."""
        deadline = self.acks.next_deadline_ms()
        if deadline is None or (self._geo_timer is not None and self._geo_timer_due <= deadline):
            return
        if self._geo_timer is not None:
            self._geo_timer.cancel()
        delay_s = max(0.0, (deadline - self.clock_ms()) / 1000) + 0.001
        self._geo_timer_due = deadline
        self._geo_timer = asyncio.get_running_loop().call_later(delay_s, self._geo_tick)

    def _geo_tick(self) -> None:
        self._geo_timer = None
        self._perform(self.acks.tick(self.clock_ms()))
        self._arm_geo_timer()

    # -- replication ----------------------------------------------------------

    async def append_replica(self, chunks: Sequence[tuple[str, int, bytes]]) -> ReplicaApply:
        """Apply replicated chunks, a pulled message's (docs/design.md, "Replication"), in order, in one hop of the
        replica writer thread: one hop per message, not per partition (issue 22). Stops at the first chunk that
        fails; ``error`` names it (``CorruptChunk``, ``DiskFull``, a ``BrokerError``), and the chunks before it
        stay applied. A bug's exception propagates.

        The hop also fsyncs the partitions it wrote that fsync every batch (``_apply_chunks``: one syncfs per
        ``SYNC_CHUNKS`` chunks); the others wait for the ack table's fsync or the periodic flush. Until a
        partition's batches are durable this site neither reports them held nor serves them onward.
        """
        todo: list[tuple[Partition, bytes]] = []
        error: Exception | None = None
        for topic, index, batches in chunks:
            try:
                p = self.partition(topic, index)
            except BrokerError as exc:
                error = exc
                break
            if p.sealing:  # a multi-node site's segment is being sealed: what would go in now would be cut
                hint = self.leader_hint(topic, index)
                error = NotLeader(topic, index, "its segment is being sealed; pull again in a moment", hint)
                break
            todo.append((p, batches))
        if not todo:
            return ReplicaApply([], error)
        flusher = self.flusher
        sync = flusher.sync_together if all(flusher.groupable(p.log) for p, _ in todo if _syncs_here(p)) else None
        applying = asyncio.get_running_loop().run_in_executor(
            self.replica_writer, _apply_chunks, todo, self.clock_ms(), sync
        )
        # What follows an apply runs as a callback, not after the await: a puller
        # that reopens its stream cancels this coroutine, but the thread appends
        # anyway, and those batches must still be fsynced and announced, or this
        # site would never serve them onward.
        applying.add_done_callback(lambda done: self._replica_applied([p for p, _ in todo], done))
        applied = await asyncio.shield(applying)
        if applied.error is None:
            return dataclasses.replace(applied, error=error)
        if isinstance(applied.error, DiskFull):
            self.disk_full = True
        failed = todo[len(applied.outcomes)][0]
        return dataclasses.replace(applied, error=_replica_error(failed, applied.error))

    def _replica_applied(self, ps: list[Partition], done: asyncio.Future[ReplicaApply]) -> None:
        if done.cancelled():
            return
        applied = done.result() if done.exception() is None else ReplicaApply([])
        if any(o.appended_batches for o in applied.outcomes):
            self.disk_full = False
        synced = set(applied.synced)
        for p in dict.fromkeys(ps):  # a message may carry two chunks of one partition
            if p in synced and self.partitions.get(p.key) is p:
                # The writer thread's syncfs made them durable: as a flush's end (_flush_done) says it.
                p.notify_append()
                p.last_flush_mono_ms = int(time.monotonic() * 1000)
                p.notify_durable()
                self._perform(self.acks.flush_done(p.key, p.log.flushed_offset, VectorOffset(p.log.flushed_vector())))
            if p.in_site is not None and self.partitions.get(p.key) is p:
                try:
                    p.in_site.appended(p.log.log_end_offset)
                except NotLeader as exc:  # the segment closed meanwhile: its seal keeps or cuts these batches
                    log.info("%s-%d: replicated batches applied as its segment closed: %s", *p.key, exc)
                    continue
            if p.log.log_end_offset > p.log.flushed_offset:
                # Also after an apply that failed midway (a full disk): what it appended before the failure is
                # whole, and must be fsynced and served onward like the rest.
                p.notify_append()
                self._schedule_flush(p)
                self._perform(self.acks.replicated(p.key, p.log.log_end_offset))

    # -- damage ---------------------------------------------------------------

    def damaged(self) -> dict[tuple[str, int], list[DamagedBatch]]:
        """The quarantined batches of every partition that has some: nothing to walk while no log anywhere has any
        (``georep.storage.api.quarantined``)."""
        out: dict[tuple[str, int], list[DamagedBatch]] = {}
        if not storage_api.quarantined:
            return out
        for key, p in sorted(self.partitions.items()):
            batches = p.log.damaged_batches()
            if batches:
                out[key] = batches
        return out

    async def repair(self, topic: str, index: int, base_offset: int, batch: bytes) -> DamagedBatch:
        """Put a peer's copy in place of a quarantined batch (in the writer thread: it writes and fsyncs)."""
        p = self.partition(topic, index)
        loop = asyncio.get_running_loop()
        repaired = await loop.run_in_executor(self.replica_writer, p.log.repair, base_offset, batch)
        p.notify_durable()  # readers waiting at the damaged batch go on
        return repaired

    async def scrub(self, key: tuple[str, int], offset: int, max_bytes: int) -> ScrubStep:
        """Check about ``max_bytes`` of ``key`` from ``offset`` (in a worker thread: it reads from disk)."""
        p = self.partition(*key)
        return await asyncio.get_running_loop().run_in_executor(self.executor, p.log.scrub, offset, max_bytes)

    # -- housekeeping ---------------------------------------------------------

    def _schedule_flush(self, p: Partition) -> None:
        """A partition that flushes on an interval was written: fsync it ``flush_interval_ms`` after its last."""
        interval = p.config["flush_interval_ms"]
        if interval <= 0 or p.key in self._flush_scheduled:
            return
        due = max(p.last_flush_mono_ms + interval, int(time.monotonic() * 1000))
        earliest = self._flush_heap[0][0] if self._flush_heap else None
        heapq.heappush(self._flush_heap, (due, p.key))
        self._flush_scheduled.add(p.key)
        if earliest is None or due < earliest:
            self.flush_wanted.set()

    def next_flush_due(self) -> int | None:
        """When (monotonic ms) the next written partition's periodic fsync is due, or None: nothing is."""
        return self._flush_heap[0][0] if self._flush_heap else None

    def flush_due(self, now_mono_ms: int) -> None:
        """fsync the written partitions whose ``flush_interval_ms`` has passed since their last fsync."""
        while self._flush_heap and self._flush_heap[0][0] <= now_mono_ms:
            _, key = heapq.heappop(self._flush_heap)
            self._flush_scheduled.discard(key)
            p = self.partitions.get(key)
            if p is None:
                continue  # deleted or no longer led meanwhile
            p.last_flush_mono_ms = now_mono_ms
            self._perform(self.acks.flush(p.key, p.log.log_end_offset))

    def enforce_retention(self) -> RetentionRun:
        """One retention run in one piece (``georep/server/retention_run.py``; the node's loop paces it)."""
        return retention_run.enforce(self)

    def close(self) -> None:
        """fsync and close every log, then write their recovery points, all in one checkpoint."""
        self._perform(self.acks.close())
        if self._geo_timer is not None:
            self._geo_timer.cancel()
        self.replica_writer.shutdown(wait=True)  # an apply still running finishes before its log closes
        for p in self.partitions.values():
            p.log.close()
        self.executor.shutdown(wait=True)
        self.flusher.close()
        if self.checkpoint is not None:
            retention_run.save_checkpoint(self.checkpoint)


def partition_to_write(broker: Broker, topic: str, index: int) -> Partition:
    """``broker.partition`` for a produce: on a multi-node site, a partition this node leads but can open no segment
    of (fewer live nodes than its topic's min_insync_replicas) raises ``NotEnoughReplicas`` saying why, rather than
    the ``NotLeader`` a reader gets (a producer retries either; this one tells what to do)."""
    if broker.in_site and (topic, index) not in broker.partitions and (why := broker.unplaceable(topic, index)):
        raise NotEnoughReplicas(why)
    return broker.partition(topic, index)
