"""The node's partitions: produce, fetch and offsets over ``PartitionLog`` instances.

The broker handles batches as bytes plus a parsed 109-byte header. It never
decodes records. Appends run on the event loop thread (they go to the page
cache); fsyncs run in worker threads and are shared by every ack waiting on
them (group commit). An ack is released only once what it promises is
persisted (docs/design.md, "Produce").
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.metadata import FileMetadataStore, SiteIdentity, TopicExists, UnknownTopic
from cluster.topics import InvalidTopic, TopicSpec, parse_topic_config, validate_partitions, validate_topic_name
from dedup.producer import Append, AppendResult, Duplicate, InvalidSequence, ProducerStateTable
from georep.record.batch import HEADER_BYTES, CorruptBatch, compute_crc, parse_header, stamp_origin
from georep.replication.sink import ApplyOutcome, CorruptChunk, apply_chunk
from georep.storage.api import DiskFull, LogConfig, OffsetOutOfRange, PartitionLog, start_offset_for_vector
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.held import HeldTable
from offsets.vector import VectorOffset

log = logging.getLogger(__name__)

ACKS_GEO = 2  # georep.v1.Acks.ACKS_GEO
GEO_ACK_TIMEOUT_MS_DEFAULT = 30_000

DEFAULT_TOPIC_CONFIG: dict[str, int] = {
    "segment_bytes_max": 1 << 30,
    "segment_ms": 7 * 24 * 3600 * 1000,
    "retention_ms": -1,
    "retention_bytes": -1,
    "flush_interval_ms": 0,
    "max_batch_bytes": 8 << 20,
}


class BrokerError(Exception):
    """An error a client caused or must act on, with the gRPC status it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _err(code: grpc.StatusCode, message: str) -> BrokerError:
    return BrokerError(code, message)


def _consume_exception(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


def partition_dir_name(topic: str, partition: int) -> str:
    return f"{urllib.parse.quote(topic, safe='')}-{partition}"


@dataclass(frozen=True, slots=True)
class _GeoWait:
    seq: int  # the batch's last origin seq
    sites: int
    future: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class Produced:
    result: AppendResult
    origin: Origin
    duplicate: bool


class Partition:
    """One topic-partition: its log, its producer state and its waiters."""

    def __init__(
        self, topic: str, index: int, log_: PartitionLog, config: dict[str, int], origin: Origin, now_ms: int
    ) -> None:
        self.topic = topic
        self.index = index
        self.log = log_
        self.config = config
        self.producers = ProducerStateTable.rebuild(log_.batch_entries(), now_ms=now_ms, origin=origin)
        self._appended: asyncio.Future[None] | None = None
        self._durable: asyncio.Future[None] | None = None
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._flushing = False
        self.last_flush_mono_ms = 0
        # Called with the vector of everything an fsync just made durable.
        self.on_durable: Callable[[Partition, dict[Origin, OriginSeq]], None] = lambda p, vector: None

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
        """A future resolved when ``log.flushed_offset`` next advances (replication serves only flushed batches)."""
        if self._durable is None or self._durable.done():
            self._durable = asyncio.get_running_loop().create_future()
        return self._durable

    def _notify_durable(self) -> None:
        if self._durable is not None and not self._durable.done():
            self._durable.set_result(None)

    def flushed(self, end_offset: int, executor: ThreadPoolExecutor) -> asyncio.Future[None]:
        """Resolves once everything below ``end_offset`` is fsynced."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.log.flushed_offset >= end_offset:
            fut.set_result(None)
            return fut
        self._flush_waiters.append((end_offset, fut))
        if not self._flushing:
            self._start_flush(executor)
        return fut

    def _start_flush(self, executor: ThreadPoolExecutor) -> None:
        self._flushing = True
        # Everything in this vector was written before the fsync starts, so the
        # fsync makes it durable (the log updates its vector after the write).
        vector = self.log.vector()
        try:
            task = asyncio.get_running_loop().run_in_executor(executor, self.log.flush)
        except RuntimeError as exc:  # the executor is shut down: the node is stopping
            self._flushing = False
            waiters, self._flush_waiters = self._flush_waiters, []
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(_err(grpc.StatusCode.UNAVAILABLE, f"node stopping ({exc}); retry"))
            return
        task.add_done_callback(lambda t: self._flush_done(t, executor, vector))

    def _flush_done(
        self, task: asyncio.Future[LocalOffset], executor: ThreadPoolExecutor, vector: dict[Origin, OriginSeq]
    ) -> None:
        self._flushing = False
        # A cancelled fsync (shutdown) must still release its waiters, with an error.
        exc = asyncio.CancelledError("fsync cancelled") if task.cancelled() else task.exception()
        waiters, self._flush_waiters = self._flush_waiters, []
        if exc is not None:
            log.error("fsync of %s-%d failed: %s", self.topic, self.index, exc)
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(_err(grpc.StatusCode.INTERNAL, f"fsync failed: {exc}; the batch was not acked"))
            return
        flushed = task.result()
        self._notify_durable()
        self.on_durable(self, vector)
        for end, fut in waiters:
            if end <= flushed:
                if not fut.done():
                    fut.set_result(None)
            else:
                self._flush_waiters.append((end, fut))
        if self._flush_waiters:
            self._start_flush(executor)

    async def flush_if_dirty(self, executor: ThreadPoolExecutor) -> None:
        if self.log.flushed_offset < self.log.log_end_offset and not self._flushing:
            await self.flushed(self.log.log_end_offset, executor)


class Broker:
    def __init__(
        self,
        data_dir: Path,
        identity: SiteIdentity,
        defaults: dict[str, int] | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        open_log: Callable[[Path, LogConfig, int], PartitionLog] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.identity = identity
        self.origin = Origin(identity.site, identity.epoch)
        self.defaults = {**DEFAULT_TOPIC_CONFIG, **(defaults or {})}
        self.clock_ms = clock_ms
        if open_log is None:
            from georep.storage.segment_log import SegmentLog

            open_log = SegmentLog.open
        self.open_log = open_log
        self.logs_dir = data_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.metadata = FileMetadataStore(data_dir / "topics.json")
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fsync")
        # Replicated chunks are applied here, off the event loop: the page-cache
        # write was most of a pulling node's loop time, and the loop can take in
        # the next chunk meanwhile. One thread, so that two upstreams sending the
        # same origin during a failover never plan against the same vector at once.
        self.replica_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="apply")
        self.disk_full = False
        self.on_produce: Callable[[str, int, int], None] = lambda topic, records, size: None
        # Called with (name, partitions) for every topic this node opens: at
        # startup, on CreateTopic, and when replication creates one.
        self.on_topic: Callable[[str, int], None] = lambda name, partitions: None
        # What each site holds fsynced (offsets/held.py), for acks=geo:N.
        self.held = HeldTable()
        self.on_held: Callable[[], None] = lambda: None  # the table learned something: report it upstream
        # How many sites (this one included) this site's records of a topic reach; the
        # replicator replaces it from the topology. A standalone node reaches itself only.
        self.geo_reach: Callable[[str], int] = lambda topic: 1
        self._geo_waiters: dict[tuple[str, int], list[_GeoWait]] = {}
        now = self.clock_ms()
        for spec in self.metadata.topics().values():
            self._open_topic(spec, now)

    # -- topics ---------------------------------------------------------------

    def _open_topic(self, spec: TopicSpec, now_ms: int) -> None:
        config = spec.effective(self.defaults)
        log_config = LogConfig(
            segment_bytes_max=config["segment_bytes_max"],
            segment_ms=config["segment_ms"],
            retention_ms=config["retention_ms"],
            retention_bytes=config["retention_bytes"],
            flush_interval_ms=config["flush_interval_ms"],
        )
        for i in range(spec.partitions):
            plog = self.open_log(self.logs_dir / partition_dir_name(spec.name, i), log_config, now_ms)
            p = self.partitions[(spec.name, i)] = Partition(spec.name, i, plog, config, self.origin, now_ms)
            p.on_durable = self._durable
            self.held.update(self.identity.site, spec.name, i, VectorOffset(plog.vector()))

    def create_topic(self, name: str, partitions: int, raw_config: dict[str, str]) -> TopicSpec:
        try:
            validate_topic_name(name)
            validate_partitions(partitions)
            spec = TopicSpec(name, partitions, parse_topic_config(raw_config))
        except InvalidTopic as exc:
            raise _err(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            # The partition directories come first: a crash in between leaves
            # empty directories that the next create reuses, never a topic
            # without its logs.
            if name in self.metadata.topics():
                raise TopicExists(name)
            self._open_topic(spec, self.clock_ms())
            self.metadata.create_topic(spec)
        except TopicExists as exc:
            raise _err(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        except OSError as exc:
            raise _err(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot create topic {name!r}: {exc}") from None
        self.on_topic(name, partitions)
        return spec

    def topic(self, name: str) -> TopicSpec:
        try:
            return self.metadata.get(name)
        except UnknownTopic as exc:
            raise _err(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def partition(self, topic: str, index: int) -> Partition:
        spec = self.topic(topic)
        p = self.partitions.get((topic, index))
        if p is None:
            raise _err(
                grpc.StatusCode.NOT_FOUND,
                f"topic {topic!r} has partitions 0..{spec.partitions - 1}; partition {index} does not exist",
            )
        return p

    # -- produce --------------------------------------------------------------

    def append(self, topic: str, index: int, batch: bytes, acks: int, geo_sites: int) -> tuple[Partition, Produced]:
        """Validate and append one producer batch as its origin. Synchronous, so
        batches on one stream are appended in the order they arrived."""
        p = self.partition(topic, index)
        if acks == ACKS_GEO:
            self._check_geo_sites(topic, geo_sites)
        limit = p.config["max_batch_bytes"]
        if len(batch) > limit:
            raise _err(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch of {len(batch)} bytes exceeds max_batch_bytes={limit} for topic {topic!r}: "
                "lower the producer's batch_size or raise the topic's max_batch_bytes",
            )
        try:
            header = parse_header(batch)
        except CorruptBatch as exc:
            raise _err(grpc.StatusCode.INVALID_ARGUMENT, f"malformed batch: {exc}") from None
        if header.size_bytes != len(batch):
            raise _err(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed batch: its header says {header.size_bytes} bytes but the request holds {len(batch)}; "
                "send exactly one batch per request",
            )
        if compute_crc(batch) != header.crc:
            raise _err(
                grpc.StatusCode.DATA_LOSS,
                "batch CRC-32C mismatch: the batch was corrupted in transit or by the producer; resend it",
            )
        if header.stamped:
            raise _err(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch already carries origin {header.origin} seq {header.base_origin_seq}: producers send "
                "unstamped batches and the receiving site stamps them",
            )
        now = self.clock_ms()
        decision = p.producers.check(
            header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence, now
        )
        if isinstance(decision, Duplicate):
            return p, Produced(decision.result, self.origin, True)
        if isinstance(decision, InvalidSequence):
            raise _err(grpc.StatusCode.INVALID_ARGUMENT, decision.message())
        if not isinstance(decision, Append):
            raise _err(grpc.StatusCode.FAILED_PRECONDITION, decision.message())
        next_seq = p.log.vector().get(self.origin, 0)
        head, _ = stamp_origin(batch, self.origin, next_seq)
        stamped = parse_header(head)
        try:
            stored = p.log.append(stamped, (memoryview(head)[24:], memoryview(batch)[HEADER_BYTES:]), now)
        except DiskFull as exc:
            self.disk_full = True
            raise _err(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except OSError as exc:
            raise _err(grpc.StatusCode.INTERNAL, f"write to {topic}-{index} failed: {exc}") from None
        self.disk_full = False
        result = AppendResult(
            stored.base_offset, stored.base_origin_seq, stored.last_origin_seq, stored.append_time_ms
        )
        p.producers.record(header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence,
                           result, now)  # fmt: skip
        p.notify_append()
        self.on_produce(topic, header.records_count, len(batch))
        return p, Produced(result, self.origin, False)

    def _check_geo_sites(self, topic: str, geo_sites: int) -> None:
        if geo_sites < 1:
            raise _err(grpc.StatusCode.INVALID_ARGUMENT,
                       f"acks=geo:{geo_sites}: N must be at least 1 (the origin site counts)")  # fmt: skip
        reach = self.geo_reach(topic)
        if geo_sites > reach:
            raise _err(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"acks=geo:{geo_sites} needs {geo_sites} sites, but records of topic {topic!r} from site "
                f"{self.identity.site} reach only {reach} site(s) over the topology's links and their filters: "
                f"use acks=geo:{reach} or less, or change the topology",
            )

    def ack_waiter(
        self, p: Partition, produced: Produced, acks: int = 0, geo_sites: int = 0, timeout_ms: int = 0
    ) -> asyncio.Future[None] | None:
        """What the ack must wait for to be as durable as its level promises; None: nothing.

        A single-node site has no in-site replicas, so ``acks=all`` promises
        what ``acks=leader`` does: the leader's log, fsynced when the topic
        fsyncs per batch. ``acks=geo:N`` waits until N sites, this one
        included, hold the batch fsynced (``HeldTable``), or fails with
        ``DEADLINE_EXCEEDED`` after ``timeout_ms``; the batch stays written.
        """
        r = produced.result
        local = None
        if p.fsync_per_batch:
            local = p.flushed(r.base_offset + (r.last_origin_seq - r.base_origin_seq) + 1, self.executor)
        if acks != ACKS_GEO or geo_sites <= 1:
            return local
        return self._geo_waiter(p, r.last_origin_seq, geo_sites, timeout_ms or GEO_ACK_TIMEOUT_MS_DEFAULT, local)

    def _geo_waiter(
        self, p: Partition, seq: int, sites: int, timeout_ms: int, local: asyncio.Future[None] | None
    ) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        out: asyncio.Future[None] = loop.create_future()
        key = (p.topic, p.index)
        self._geo_waiters.setdefault(key, []).append(_GeoWait(seq, sites, out))

        def expire() -> None:
            if out.done():
                return
            holding = self.held.sites_holding(p.topic, p.index, self.origin, seq)
            out.set_exception(_err(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"acks=geo:{sites} not reached within {timeout_ms} ms: {len(holding)} site(s) "
                f"({', '.join(holding) or 'none'}) hold {p.topic}/{p.index} origin seq {seq} of {self.origin}. "
                f"The batch stays written at site {self.identity.site} and replicates when the links allow; "
                "a retry by the same producer is deduplicated, so retrying is safe",
            ))  # fmt: skip

        def local_done(f: asyncio.Future[None]) -> None:
            exc = asyncio.CancelledError("fsync cancelled") if f.cancelled() else f.exception()
            if exc is not None and not out.done():
                out.set_exception(exc)

        timer = loop.call_later(timeout_ms / 1000, expire)
        out.add_done_callback(lambda _f: timer.cancel())
        out.add_done_callback(_consume_exception)
        if local is not None:
            local.add_done_callback(local_done)
        self._check_geo(p.topic, p.index)
        return out

    def _check_geo(self, topic: str, index: int) -> None:
        waiters = self._geo_waiters.get((topic, index))
        if not waiters:
            return
        keep = []
        for w in waiters:
            if w.future.done():
                continue
            if len(self.held.sites_holding(topic, index, self.origin, w.seq)) >= w.sites:
                w.future.set_result(None)
            else:
                keep.append(w)
        self._geo_waiters[(topic, index)] = keep

    def _durable(self, p: Partition, vector: dict[Origin, OriginSeq]) -> None:
        if self.held.update(self.identity.site, p.topic, p.index, VectorOffset(vector)):
            self._check_geo(p.topic, p.index)
            self.on_held()

    def report_held(self, entries: list[tuple[str, str, int, VectorOffset]]) -> None:
        """Take in what other sites hold (``ReportHeld``); this site's own entry comes from its fsyncs."""
        changed: set[tuple[str, int]] = set()
        for site, topic, index, vector in entries:
            if site != self.identity.site and self.held.update(site, topic, index, vector):
                changed.add((topic, index))
        for topic, index in sorted(changed):
            self._check_geo(topic, index)
        if changed:
            self.on_held()

    async def produce(
        self, topic: str, index: int, batch: bytes, acks: int, geo_sites: int, timeout_ms: int = 0
    ) -> Produced:
        p, produced = self.append(topic, index, batch, acks, geo_sites)
        waiter = self.ack_waiter(p, produced, acks, geo_sites, timeout_ms)
        if waiter is not None:
            await waiter
        return produced

    # -- replication ----------------------------------------------------------

    async def append_replica(self, topic: str, index: int, batches: bytes) -> ApplyOutcome:
        """Apply one replicated chunk (docs/design.md, "Replication") in the replica writer thread.

        Nothing waits for an fsync here: the partition's flush policy makes the
        batches durable (the next flush covers them), and until it does, this
        site does not serve them onward either.
        """
        p = self.partition(topic, index)
        applying = asyncio.get_running_loop().run_in_executor(
            self.replica_writer, apply_chunk, p.log, batches, self.clock_ms()
        )
        # What follows an apply runs as a callback, not after the await: a puller
        # that reopens its stream cancels this coroutine, but the thread appends
        # anyway, and those batches must still be fsynced and announced, or this
        # site would never serve them onward.
        applying.add_done_callback(lambda done: self._replica_applied(p, done))
        try:
            outcome = await asyncio.shield(applying)
        except CorruptChunk as exc:
            raise _err(grpc.StatusCode.DATA_LOSS, str(exc)) from None
        except DiskFull as exc:
            self.disk_full = True
            raise _err(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except OSError as exc:
            raise _err(grpc.StatusCode.INTERNAL, f"write to {topic}-{index} failed: {exc}") from None
        return outcome

    def _replica_applied(self, p: Partition, done: asyncio.Future[ApplyOutcome]) -> None:
        if done.cancelled() or done.exception() is not None or not done.result().appended_batches:
            return
        p.notify_append()
        if p.fsync_per_batch:
            # Nobody awaits this: it only starts (or joins) the partition's
            # group fsync. Errors are logged by _flush_done.
            p.flushed(p.log.log_end_offset, self.executor).add_done_callback(_consume_exception)

    # -- fetch ----------------------------------------------------------------

    def start_offset_for_vector(self, p: Partition, vector: dict[Origin, int]) -> LocalOffset:
        """The smallest local offset holding a record the vector does not cover."""
        return start_offset_for_vector(p.log, vector)

    def read(self, p: Partition, offset: LocalOffset, max_bytes: int) -> tuple[bytes, LocalOffset]:
        try:
            res = p.log.read(offset, max_bytes)
        except OffsetOutOfRange as exc:
            raise _err(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from None
        return res.data, res.next_offset

    # -- housekeeping ---------------------------------------------------------

    async def flush_due(self, now_mono_ms: int) -> None:
        """fsync the partitions whose ``flush_interval_ms`` has passed since their last fsync."""
        due = []
        for p in self.partitions.values():
            interval = p.config["flush_interval_ms"]
            if interval > 0 and now_mono_ms - p.last_flush_mono_ms >= interval:
                p.last_flush_mono_ms = now_mono_ms
                due.append(p.flush_if_dirty(self.executor))
        await asyncio.gather(*due)

    def enforce_retention(self) -> int:
        now = self.clock_ms()
        deleted = 0
        for p in self.partitions.values():
            deleted += p.log.enforce_retention(now)
            p.producers.expire(now)
        return deleted

    def close(self) -> None:
        self.replica_writer.shutdown(wait=True)  # an apply still running finishes before its log closes
        for p in self.partitions.values():
            p.log.close()
        self.executor.shutdown(wait=True)
