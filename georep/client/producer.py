"""The asyncio producer: accumulate records into batches, pipeline them over one ProduceStream.

``send`` is synchronous and cheap: it appends the record to its partition's
open batch and returns a future. One sender task closes batches (full,
lingered, or on flush), gives them their idempotent sequence, encodes them
once, and writes them to the producer's ``ProduceStream``, at most
``max_in_flight`` unanswered per partition. A reader task matches answers by
``correlation_id``. When the stream breaks, the producer reconnects with
bounded exponential backoff and re-sends every unanswered batch, in order,
with the same bytes; the node answers the ones it already stored with their
original result, so nothing is written twice (see ``delivery.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterable
from time import time_ns
from typing import Any, NamedTuple

import grpc
from crc32c import crc32c as _crc32c

from georep.client.accumulator import RECORD_OVERHEAD_BYTES, BatchState, ProducerBatch, RecordAccumulator, record_size
from georep.client.connection import Connection
from georep.client.delivery import PartitionDelivery
from georep.client.errors import (
    BatchTooLarge,
    DeliveryTimeout,
    GeorepError,
    InvalidRequest,
    NodeUnavailable,
    NotLeader,
    Operation,
    OutOfOrderSequence,
    ProducerClosed,
    RecordTooLarge,
    UnknownTopic,
    from_produce_error,
    from_rpc_error,
)
from georep.client.partitioner import StickyPartitioner, key_partition
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT
from georep.proto import georep_pb2, georep_pb2_grpc
from georep.proto.reasons import PRODUCE_BATCHES_MAX_METADATA, PRODUCE_BYTES_MAX_METADATA
from georep.record.batch import HEADER_BYTES, NO_PRODUCER_ID, RecordInput, encode_batch
from georep.record.compression import Compression
from georep.security.tls import TlsConfig
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from topology.ids import SiteId

_new_tuple = tuple.__new__

PRODUCER_ID_BITS = 62
IDEMPOTENT_IN_FLIGHT_MAX = 5  # the node remembers the last 5 batches per producer and partition
# Topics whose partition count is asked at once. A send to 20,000 new topics asked all 20,000 together: the node
# creates topics made on first use 1,000 at a time, so the last answers came after the request timeout, and each
# timeout reconnected the channel under the others (bench/first_use.py --topics 20000 never finished).
METADATA_IN_FLIGHT = 1_000


class RecordMetadata(NamedTuple):
    """Where an acknowledged record was stored."""

    topic: str
    partition: int
    offset: LocalOffset  # local offset at the node that acknowledged it
    origin: Origin
    origin_seq: OriginSeq
    timestamp_ms: int


def parse_acks(acks: str) -> tuple[georep_pb2.Acks.ValueType, int]:
    """``"leader"``, ``"all"`` or ``"geo:N"`` as (``Acks`` enum value, geo_sites)."""
    text = str(acks).strip().lower()
    if text in ("leader", "1"):
        return georep_pb2.ACKS_LEADER, 0
    if text in ("all", "-1"):
        return georep_pb2.ACKS_ALL, 0
    if text.startswith("geo:") and text[4:].isdigit() and int(text[4:]) >= 1:
        return georep_pb2.ACKS_GEO, int(text[4:])
    raise InvalidRequest(f"invalid acks {acks!r}: use 'leader', 'all' or 'geo:N' (N >= 1 sites)")


def _at_least_one(**settings: int) -> None:
    for name, value in settings.items():
        if value < 1:
            raise InvalidRequest(f"invalid {name} {value}: must be at least 1")


def new_producer_id() -> int:
    return secrets.randbits(PRODUCER_ID_BITS)


class _Route:
    """One ProduceStream to one node: the bootstrap connection's (key ``""``), or a partition leader's (key: its
    address). Each has its own connection, correlation ids and reconnect backoff."""

    __slots__ = (
        "key",
        "connection",
        "call",
        "reader",
        "generation",
        "broken_generation",
        "backoff_ms",
        "not_before_ms",
        "by_correlation",
        "batches_max",
        "bytes_max",
        "requests",
        "open",
        "open_bytes",
        "full",
    )

    def __init__(self, key: str, connection: Connection, backoff_ms: int) -> None:
        self.key = key
        self.connection = connection
        self.call: Any = None  # the current ProduceStream call
        self.reader: asyncio.Task[None] | None = None
        self.generation = 0  # of the connection the current stream runs on
        self.broken_generation: int | None = None  # set while the stream needs a reconnect
        self.backoff_ms = backoff_ms
        self.not_before_ms = 0.0
        self.by_correlation: dict[int, ProducerBatch] = {}
        # What the node takes in one request, from its stream's initial metadata: 0 until read (one batch a
        # request meanwhile, at most max_in_flight_requests of them), 1 for a node that does not know multi-batch
        # requests and says nothing (its first answer brings that metadata).
        self.batches_max = 0
        self.bytes_max = 0
        self.requests: dict[_Request, None] = {}  # written and not fully answered, oldest first
        self.open: list[ProducerBatch] = []  # taken for the next request, not yet written
        self.open_bytes = 0
        self.full: list[list[ProducerBatch]] = []  # requests packed to their bound, waiting for room in flight

    def learn_bounds(self, metadata: Any, batches_max: int) -> None:
        """What the node takes in one request (at most ``batches_max`` batches, the producer's own bound), from its
        stream's initial metadata; none said: one batch."""
        said = dict(metadata or ())
        self.batches_max, self.bytes_max = 1, 0
        with contextlib.suppress(KeyError, ValueError):
            batches = min(int(said[PRODUCE_BATCHES_MAX_METADATA]), batches_max)
            size = int(said[PRODUCE_BYTES_MAX_METADATA])
            if batches > 1 and size > 0:
                self.batches_max, self.bytes_max = batches, size


class _Request:
    """One ProduceStream message: when it was written, and how many of its batches are still unanswered."""

    __slots__ = ("sent_ms", "unanswered")

    def __init__(self, sent_ms: float, unanswered: int) -> None:
        self.sent_ms = sent_ms
        self.unanswered = unanswered


class Producer:
    """``async with Producer("127.0.0.1:7101") as p: await p.send("t", b"v")``."""

    def __init__(
        self,
        bootstrap: str | list[str],
        *,
        acks: str = "leader",
        batch_size: int = 65536,
        linger_ms: float = 5,
        compression: str = "none",
        max_in_flight: int = 5,
        max_in_flight_requests: int = 5,
        max_request_bytes: int = 1 << 20,
        max_request_batches: int = 1_000,
        delivery_timeout_ms: int = 120_000,
        request_timeout_ms: int = 30_000,
        retry_backoff_ms: int = 100,
        retry_backoff_max_ms: int = 1_000,
        enable_idempotence: bool = True,
        buffer_memory: int = 32 << 20,
        connect_timeout_ms: int = 5_000,
        tls: TlsConfig | None = None,
        allow_auto_create_topics: bool = True,
    ) -> None:
        self._acks, self._geo_sites = parse_acks(acks)
        self._auto_create = allow_auto_create_topics  # Kafka's allow.auto.create.topics (docs/topologies.md)
        self._tls = tls
        try:
            self._compression = Compression.parse(compression)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        requests = {"max_request_bytes": max_request_bytes, "max_request_batches": max_request_batches}
        _at_least_one(batch_size=batch_size, max_in_flight=max_in_flight, **requests)
        _at_least_one(max_in_flight_requests=max_in_flight_requests)
        if enable_idempotence and max_in_flight > IDEMPOTENT_IN_FLIGHT_MAX:
            raise InvalidRequest(
                f"max_in_flight {max_in_flight} is above {IDEMPOTENT_IN_FLIGHT_MAX}, the most an idempotent "
                "producer may have unanswered per partition: lower it or set enable_idempotence=False"
            )
        self._connection = Connection(bootstrap, connect_timeout_ms, tls)
        self._batch_size = batch_size
        self._max_in_flight = max_in_flight
        self._max_in_flight_requests = max_in_flight_requests
        self._max_request_bytes = max_request_bytes
        self._max_request_batches = max_request_batches
        self._delivery_timeout_ms = delivery_timeout_ms
        self._request_timeout_ms = request_timeout_ms
        self._retry_backoff_ms = retry_backoff_ms
        self._retry_backoff_max_ms = max(retry_backoff_max_ms, retry_backoff_ms)
        self._idempotent = enable_idempotence
        self.buffer_memory = buffer_memory
        self.producer_id = new_producer_id() if enable_idempotence else NO_PRODUCER_ID

        self._accumulator = RecordAccumulator(batch_size, linger_ms)
        self._sticky = StickyPartitioner(secrets.randbelow(1 << 16))
        self._sticky_partitions = self._sticky.current  # read on the hot path
        self._open_batches = self._accumulator.open
        self._partition_counts: dict[str, int] = {}
        self._metadata_slots = asyncio.Semaphore(METADATA_IN_FLIGHT)
        self._max_batch_bytes: dict[str, int] = {}  # per topic, from its effective config
        self._pending_metadata: dict[str, list[tuple[RecordInput, asyncio.Future[RecordMetadata], int | None]]] = {}
        self._metadata_tasks: dict[str, asyncio.Task[None]] = {}
        self._deliveries: dict[tuple[str, int], PartitionDelivery] = {}
        # The deliveries with batches queued or in flight: what the sender walks, so its work per wake follows the
        # partitions being written, not every partition ever written (10,000 of them for a topic that wide).
        self._busy: dict[tuple[str, int], PartitionDelivery] = {}
        self._outstanding: set[ProducerBatch] = set()  # opened and not yet acked or failed
        self._next_correlation = 0
        self._buffered_bytes = 0

        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._space: asyncio.Event | None = None
        self._sender: asyncio.Task[None] | None = None
        # One ProduceStream per node sent to: the bootstrap connection's (key ""), and on a multi-node site one
        # per partition leader the metadata names (key: its address), as Kafka clients hold one per broker.
        self._routes: dict[str, _Route] = {"": _Route("", self._connection, retry_backoff_ms)}
        self._leaders: dict[tuple[str, int], str] = {}  # partition -> leader address (multi-node sites only)
        self._connect_timeout_ms = connect_timeout_ms
        self._flushing = 0
        self._closing = False
        self._closed = False

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> Producer:
        """Connect (raises :class:`NodeUnavailable` if no bootstrap node answers) and start sending."""
        if self._sender is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        await self._connection.connect()
        self._sender = asyncio.create_task(self._run_sender(), name="georep-producer-sender")
        return self

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, timeout_s: float | None = None) -> None:
        """Send what is buffered (waiting at most ``timeout_s``), then release the connection."""
        if self._closed:
            return
        self._closing = True
        try:
            if self._sender is not None and not self._sender.done():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout_s):
                        await self.flush()
        finally:
            self._closed = True
            if self._sender is not None:
                self._wakeup.set()  # type: ignore[union-attr]
                self._sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._sender
            for task in list(self._metadata_tasks.values()):
                task.cancel()
            for route in self._routes.values():
                self._close_stream(route)
            error = ProducerClosed("the producer was closed before this record was delivered")
            for batch in list(self._outstanding):
                self._fail_batch(batch, error)
            for topic in list(self._pending_metadata):
                self._fail_pending(topic, error)
            for route in self._routes.values():
                await route.connection.close()

    # --- sending -------------------------------------------------------------

    def send(
        self,
        topic: str,
        value: bytes | str | None,
        key: bytes | str | None = None,
        partition: int | None = None,
        headers: Iterable[tuple[str, bytes | None]] | None = None,
        timestamp_ms: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue one record; the future resolves to its :class:`RecordMetadata` once acknowledged.

        Non-blocking. Call :meth:`flush` (or await the futures) to wait for delivery,
        and :meth:`wait_for_buffer` in long loops to bound the memory used.
        """
        loop = self._loop
        if loop is None or self._closing:
            raise ProducerClosed("send() on a producer that is not started or is closing")
        future: asyncio.Future[RecordMetadata] = loop.create_future()
        if isinstance(value, str):
            value = value.encode()
        if isinstance(key, str):
            key = key.encode()
        header_list = tuple(headers) if headers else ()
        # tuple.__new__ skips RecordInput's Python-level __new__: half the cost.
        record: RecordInput = _new_tuple(
            RecordInput, (key, value, header_list, time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms)
        )
        count = self._partition_counts.get(topic)
        if count is None:
            self._defer(topic, record, future, partition)
            return future
        # The hot path, inlined: a record without headers or explicit partition that
        # fits in its partition's open batch. Everything else goes through _append.
        if partition is None and not header_list:
            # crc32c(key) % count is key_partition(), inlined
            partition = self._sticky_partitions.get(topic) if key is None else _crc32c(key) % count
            batch = self._open_batches.get((topic, partition))  # type: ignore[arg-type]
            size = (
                RECORD_OVERHEAD_BYTES + (len(key) if key is not None else 0) + (len(value) if value is not None else 0)
            )
            # < not <=: a record that fills the batch goes through _append, which marks it full for the sender
            if batch is not None and batch.size_bytes + size < batch.capacity:
                batch.records.append(record)
                batch.futures.append(future)
                batch.size_bytes += size
                self._buffered_bytes += size
                return future
            if key is None:
                partition = None
        self._append(topic, count, record, future, partition)
        return future

    def _append(
        self, topic: str, count: int, record: RecordInput, future: asyncio.Future[RecordMetadata], partition: int | None
    ) -> None:
        size = record_size(record.key, record.value, record.headers)
        limit = self._max_batch_bytes.get(topic, MAX_BATCH_BYTES_LIMIT)
        if HEADER_BYTES + size > limit:
            future.set_exception(
                RecordTooLarge(
                    f"a record of {size} bytes makes a batch of {HEADER_BYTES + size} bytes, above the "
                    f"max_batch_bytes={limit} of topic {topic!r}; nothing was sent. Split the record, or give the "
                    f"topic a larger max_batch_bytes (up to {MAX_BATCH_BYTES_LIMIT}: georep topic create {topic} "
                    "--config max_batch_bytes=N, or the node's --max-batch-bytes for new topics)"
                )
            )
            return
        accumulator = self._accumulator
        if partition is None:
            if record.key is not None:
                partition = key_partition(record.key, count)
            else:
                partition = self._sticky.partition(topic, count)
                batch = accumulator.open.get((topic, partition))
                if batch is not None and batch.size_bytes + size > batch.capacity:
                    accumulator.close(batch)
                    self._sticky.on_batch_closed(topic, partition, count)
                    partition = self._sticky.partition(topic, count)
                    self._wakeup.set()  # type: ignore[union-attr]
        elif not 0 <= partition < count:
            future.set_exception(
                InvalidRequest(f"partition {partition} does not exist: topic {topic!r} has partitions 0..{count - 1}")
            )
            return
        self._buffered_bytes += size
        opened = accumulator.append(
            topic,
            partition,
            record,
            future,
            size,
            self._loop.time() * 1000,  # type: ignore[union-attr]
            max_batch_bytes=limit,
        )
        if opened is not None:
            opened.done = self._loop.create_future()  # type: ignore[union-attr]
            self._outstanding.add(opened)
            self._wakeup.set()  # type: ignore[union-attr]

    def _defer(
        self, topic: str, record: RecordInput, future: asyncio.Future[RecordMetadata], partition: int | None
    ) -> None:
        self._pending_metadata.setdefault(topic, []).append((record, future, partition))
        if topic not in self._metadata_tasks:
            self._metadata_tasks[topic] = asyncio.create_task(self._fetch_metadata(topic))

    async def _fetch_metadata(self, topic: str) -> None:
        """Learn ``topic``'s partition count (``DescribeTopic``, creating the topic where the site's
        ``auto_create`` says so), then place the records that waited for it; or fail them, each with the reason
        (a failure nobody foresaw too, rather than leave their futures unresolved). Retried on a node that went
        away until ``delivery_timeout_ms``. At most ``METADATA_IN_FLIGHT`` at once, the stub taken inside the
        slot: a channel replaced while a request waited for its slot is never used."""
        deadline = time.monotonic() + self._delivery_timeout_ms / 1000
        backoff_ms, timeout_s = self._retry_backoff_ms, self._request_timeout_ms / 1000
        try:
            while True:
                generation = self._connection.generation
                try:
                    async with self._metadata_slots:
                        stub = await self._connection.connect()
                        generation = self._connection.generation
                        description = await _describe(self._connection, stub, topic, self._auto_create, timeout_s)
                    break
                except NodeUnavailable as exc:
                    if time.monotonic() + backoff_ms / 1000 > deadline:
                        late = f"no partition count for topic {topic!r} within delivery_timeout_ms: {exc}"
                        self._fail_pending(topic, DeliveryTimeout(late))
                        return
                    await asyncio.sleep(backoff_ms / 1000)
                    backoff_ms = min(backoff_ms * 2, self._retry_backoff_max_ms)
                    with contextlib.suppress(GeorepError):
                        await self._connection.reconnect(generation)
                except GeorepError as exc:
                    if isinstance(exc, UnknownTopic) and "topic create" not in exc.message:
                        hint = f"{exc.message} (create it with 'georep topic create {topic} --partitions N')"
                        exc = UnknownTopic(hint, exc.code)
                    self._fail_pending(topic, exc)
                    return
            self._learn(topic, description)
            for record, future, partition in self._pending_metadata.pop(topic, []):
                if not future.done():
                    self._append(topic, description.partitions, record, future, partition)
        except Exception as exc:
            self._fail_pending(topic, exc)
            raise
        finally:
            self._metadata_tasks.pop(topic, None)

    async def partitions_for(self, topic: str) -> int:
        """The partition count of ``topic`` (cached); raises :class:`UnknownTopic` if it does not exist."""
        count = self._partition_counts.get(topic)
        if count is not None:
            return count
        stub = await self._connection.connect()
        description = await _describe(self._connection, stub, topic, self._auto_create, self._request_timeout_ms / 1000)
        self._learn(topic, description)
        return int(description.partitions)

    def _learn(self, topic: str, description: georep_pb2.TopicDescription) -> None:
        self._partition_counts[topic] = description.partitions
        with contextlib.suppress(KeyError, ValueError):
            self._max_batch_bytes[topic] = int(description.config["max_batch_bytes"])
        for leader in description.leaders:  # a multi-node site: send each partition to its leader
            if leader.address:
                self._leaders[(topic, leader.partition)] = leader.address
        if description.leaders:
            self._wakeup.set()  # type: ignore[union-attr]

    def _refresh_leaders(self, topic: str) -> None:
        """Ask the site again who leads ``topic``'s partitions (a leader went away, or refused: NOT_LEADER)."""
        if topic not in self._metadata_tasks and not self._closed:
            self._metadata_tasks[topic] = asyncio.create_task(self._fetch_metadata(topic))

    def _route_for(self, delivery: PartitionDelivery) -> _Route:
        address = self._leaders.get((delivery.topic, delivery.partition), "")
        route = self._routes.get(address)
        if route is None:
            connection = Connection(address, self._connect_timeout_ms, self._tls)
            route = self._routes[address] = _Route(address, connection, self._retry_backoff_ms)
        return route

    def _fail_pending(self, topic: str, error: Exception) -> None:
        for _, future, _ in self._pending_metadata.pop(topic, []):
            if not future.done():
                future.set_exception(error)

    async def flush(self) -> None:
        """Send every buffered record now and wait until each is acknowledged or failed."""
        while self._metadata_tasks:
            await asyncio.gather(*list(self._metadata_tasks.values()), return_exceptions=True)
        waiting = [b.done for b in self._outstanding]
        if not waiting:
            return
        if self._sender is None or self._sender.done():
            raise ProducerClosed("flush() on a producer that is not running")
        self._flushing += 1
        self._wakeup.set()  # type: ignore[union-attr]
        try:
            await asyncio.gather(*waiting)
        finally:
            self._flushing -= 1

    @property
    def reconnects(self) -> int:
        """How many times the producer replaced a connection after losing a node."""
        return sum(max(route.connection.generation - 1, 0) for route in self._routes.values())

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records sent but not yet acknowledged or failed."""
        return self._buffered_bytes

    async def wait_for_buffer(self) -> None:
        """Wait while more than ``buffer_memory`` bytes are buffered (back-pressure for long loops)."""
        while self._buffered_bytes > self.buffer_memory and self._sender is not None and not self._sender.done():
            self._space.clear()  # type: ignore[union-attr]
            self._wakeup.set()  # type: ignore[union-attr]
            await self._space.wait()  # type: ignore[union-attr]

    # --- completing batches -------------------------------------------------

    def _finish(self, batch: ProducerBatch) -> None:
        self._outstanding.discard(batch)
        self._buffered_bytes -= batch.size_bytes - HEADER_BYTES
        if batch.done is not None and not batch.done.done():
            batch.done.set_result(None)
        if self._buffered_bytes <= self.buffer_memory and self._space is not None:
            self._space.set()

    def _fail_batch(self, batch: ProducerBatch, error: Exception) -> None:
        batch.state = BatchState.FAILED
        batch.error = error
        for future in batch.futures:
            if not future.done():
                future.set_exception(error)
        self._finish(batch)

    def _complete_batch(self, batch: ProducerBatch, response: georep_pb2.ProduceResponse) -> None:
        topic, partition = batch.topic, batch.partition
        base = response.base_offset
        seq = response.base_origin_seq
        origin = Origin(SiteId(response.origin_site), response.origin_epoch)
        for i, (future, record) in enumerate(zip(batch.futures, batch.records, strict=True)):
            if not future.done():
                future.set_result(
                    RecordMetadata(
                        topic, partition, LocalOffset(base + i), origin, OriginSeq(seq + i), record.timestamp_ms
                    )
                )
        self._finish(batch)

    # --- the sender ------------------------------------------------------------

    def _delivery(self, topic: str, partition: int) -> PartitionDelivery:
        key = (topic, partition)
        delivery = self._deliveries.get(key)
        if delivery is None:
            delivery = self._deliveries[key] = PartitionDelivery(
                topic, partition, self.producer_id, self._max_in_flight
            )
        return delivery

    def _forget_idle(self) -> None:
        """Drop the deliveries with nothing queued or in flight from the sender's walk (``enqueue`` adds back)."""
        for key in [key for key, d in self._busy.items() if d.idle]:
            del self._busy[key]

    def _fresh_id(self) -> int:
        return new_producer_id() if self._idempotent else NO_PRODUCER_ID

    def _resolve_rounds(self) -> None:
        for delivery in list(self._busy.values()):
            if delivery.round_complete():
                for batch in delivery.resolve(self._fresh_id()):
                    self._fail_batch(
                        batch,
                        batch.error
                        or OutOfOrderSequence(f"node reported a sequence gap for {batch.topic}/{batch.partition}"),
                    )

    def _expire(self, now_ms: float) -> None:
        timeout = self._delivery_timeout_ms
        for delivery in list(self._busy.values()):
            for batch in delivery.expire(now_ms, timeout, self._fresh_id()):
                self._fail_batch(
                    batch,
                    DeliveryTimeout(
                        f"{len(batch.records)} records for {batch.topic}/{batch.partition} were not acknowledged "
                        f"within delivery_timeout_ms={timeout}; they may or may not be stored "
                        f"(last error: node at {self._connection.address or ','.join(self._connection.addresses)} "
                        "unreachable or not answering)"
                    ),
                )

    async def _run_sender(self) -> None:
        wakeup = self._wakeup
        assert wakeup is not None and self._loop is not None
        loop = self._loop
        try:
            while not self._closed:
                wakeup.clear()
                now = loop.time() * 1000
                force = self._flushing > 0 or self._closing or self._buffered_bytes > self.buffer_memory
                room = None if force else linger_room(self._routes.values(), self._max_in_flight_requests)
                for batch in self._accumulator.close_lingered(now, force, room):
                    count = self._partition_counts.get(batch.topic, 1)
                    self._sticky.on_batch_closed(batch.topic, batch.partition, count)
                for batch in self._accumulator.take_closed():
                    delivery = self._delivery(batch.topic, batch.partition)
                    delivery.enqueue(batch)
                    self._busy[(batch.topic, batch.partition)] = delivery
                self._forget_idle()
                self._resolve_rounds()
                timeout_s: float | None = None
                wanted = {id(r): r for r in (self._route_for(d) for d in self._busy.values() if d.queue)}
                for route in wanted.values():
                    if route.call is None:
                        wait_s = await self._open_route(route, now)
                        if wait_s is not None:
                            timeout_s = wait_s if timeout_s is None else min(timeout_s, wait_s)
                if any(route.call is not None for route in self._routes.values()):
                    retry_in_s = await self._send_ready()
                    check_s = self._check_request_timeouts(loop.time() * 1000)
                    for wait_s in (retry_in_s, check_s):
                        if wait_s is not None:
                            timeout_s = wait_s if timeout_s is None else min(timeout_s, wait_s)
                # Lingered and kept open for want of room: an answer wakes the sender. Only what close_lingered
                # held back says so; the clock does not (time passes in this loop, and a batch that fell due
                # meanwhile, with room for it, would never be closed).
                deadline = None if self._accumulator.held_for_room else self._accumulator.next_linger_deadline_ms()
                if deadline is not None:
                    wait = max(deadline - loop.time() * 1000, 0) / 1000
                    timeout_s = wait if timeout_s is None else min(timeout_s, wait)
                if wakeup.is_set():
                    continue
                # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a
                # cancellation that races with the event, and close() would hang.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout_s):
                        await wakeup.wait()
        except BaseException as exc:
            # close() cancels the sender and fails what is left itself; any other
            # way out would leave flush() and the futures waiting forever.
            if not self._closed:
                error = GeorepError(f"the producer's sender stopped: {exc!r}")
                for batch in list(self._outstanding):
                    self._fail_batch(batch, error)
            raise

    async def _open_route(self, route: _Route, now_ms: float) -> float | None:
        """Open ``route``'s stream (reconnecting after a break, with backoff); seconds to wait before trying again
        if it cannot open now."""
        self._expire(now_ms)
        if route.not_before_ms > now_ms:
            return (route.not_before_ms - now_ms) / 1000
        try:
            if route.broken_generation is not None:
                await route.connection.reconnect(route.broken_generation)
            stub = await route.connection.connect()
        except GeorepError:
            route.broken_generation = route.connection.generation
            route.not_before_ms = now_ms + route.backoff_ms
            if route.key:
                # A leader that is gone: the site names another one within its session timeout. Ask again at
                # every retry, without growing the backoff, so its partitions move on as soon as it does.
                for topic in sorted({t for (t, _p), a in self._leaders.items() if a == route.key}):
                    self._refresh_leaders(topic)
            else:
                route.backoff_ms = min(route.backoff_ms * 2, self._retry_backoff_max_ms)
            return route.backoff_ms / 1000
        route.generation = route.connection.generation
        route.call = stub.ProduceStream()
        route.reader = asyncio.create_task(self._read(route, route.call), name="georep-producer-reader")
        return None

    def _check_request_timeouts(self, now_ms: float) -> float | None:
        """Break a stream if a request got no full answer long after the node's own ack timeout."""
        limit = self._request_timeout_ms + max(1000, self._request_timeout_ms // 10)
        soonest: float | None = None
        for route in list(self._routes.values()):
            oldest = next(iter(route.requests), None)
            if oldest is None:
                continue
            if now_ms - oldest.sent_ms > limit:
                self._stream_broken(route, route.call)
                if self._wakeup is not None:
                    self._wakeup.set()
                return 0
            wait = (oldest.sent_ms + limit - now_ms) / 1000
            soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    async def _send_ready(self) -> float | None:
        """Write what may go now; returns seconds until a partition in retry backoff may send.

        To a node that takes multi-batch requests, every ready batch bound for it goes in one request (several
        when one reaches ``max_request_batches`` or ``max_request_bytes``), and at most
        ``max_in_flight_requests`` requests are unanswered per node, as Kafka's
        max.in.flight.requests.per.connection: what cannot go waits, and goes packed in the next request."""
        loop = self._loop
        assert loop is not None
        now = loop.time() * 1000
        retry_in_s: float | None = None
        for route in list(self._routes.values()):  # what was taken before stays ahead of what is taken now
            if route.call is not None and (route.open or route.full) and not await self._write_packed(route):
                return None
        packing: dict[str, _Route] = {}
        for delivery in list(self._busy.values()):
            if delivery.blocked or not delivery.queue:
                continue
            route = self._route_for(delivery)
            if route.call is None:
                continue
            if delivery.not_before_ms > now:
                wait = (delivery.not_before_ms - now) / 1000
                retry_in_s = wait if retry_in_s is None else min(retry_in_s, wait)
                continue
            if route.batches_max == 1:  # a node that takes one batch a message: as before, unbounded
                for batch in delivery.take_sendable():
                    if not await self._write(route, [batch]):
                        return None
                continue
            packing[route.key] = route
            while len(route.requests) + len(route.full) < self._max_in_flight_requests:
                taken = delivery.take_sendable(1)
                if not taken:
                    break
                self._pack(route, taken[0])
        for route in packing.values():
            if not await self._write_packed(route):
                return None
        return retry_in_s

    def _pack(self, route: _Route, batch: ProducerBatch) -> None:
        """Put a taken batch in ``route``'s next request, closing that one first if the batch would not fit."""
        if batch.data is None:
            batch.data = self._encode(batch)
        size = len(batch.data)
        bytes_max = min(self._max_request_bytes, route.bytes_max)
        if route.open and (len(route.open) >= max(route.batches_max, 1) or route.open_bytes + size > bytes_max):
            route.full.append(route.open)
            route.open, route.open_bytes = [], 0
        route.open.append(batch)
        route.open_bytes += size

    async def _write_packed(self, route: _Route) -> bool:
        """Write ``route``'s packed requests while it has room in flight (a node that turned out to take one batch a
        request: all of them, as before); False if the stream broke."""
        bound = self._max_in_flight_requests if route.batches_max != 1 else len(route.requests) + len(route.full) + 1
        while route.full and len(route.requests) < bound:
            if not await self._write(route, route.full.pop(0)):
                return False
        if route.open and not route.full and len(route.requests) < bound:
            batches, route.open, route.open_bytes = route.open, [], 0
            return await self._write(route, batches)
        return True

    async def _write(self, route: _Route, batches: list[ProducerBatch]) -> bool:
        """Write ``batches`` as one request (multi-batch unless the node takes one a message); False if the stream
        broke."""
        call = route.call
        sent_ms = self._loop.time() * 1000  # type: ignore[union-attr]
        request = _Request(sent_ms, len(batches))
        message = georep_pb2.ProduceRequest(
            acks=self._acks, geo_sites=self._geo_sites, ack_timeout_ms=self._request_timeout_ms
        )
        for batch in batches:
            if batch.data is None:
                batch.data = self._encode(batch)
            self._next_correlation += 1
            batch.correlation_id = self._next_correlation
            batch.sent_ms = sent_ms
            batch.request = request
            route.by_correlation[batch.correlation_id] = batch
            if route.batches_max <= 1:
                message.correlation_id = batch.correlation_id
                message.topic = batch.topic
                message.partition = batch.partition
                message.batch = batch.data
            else:
                message.batches.add(
                    correlation_id=batch.correlation_id, topic=batch.topic, partition=batch.partition, batch=batch.data
                )
        route.requests[request] = None
        try:
            await call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError, RuntimeError):
            self._stream_broken(route, call)
            return False
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from a pending write when the call
            # is cancelled locally: the reader saw the stream end and
            # _close_stream() cancelled it. That is a broken stream, not a
            # cancellation of the sender, unless close() is cancelling us.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self._stream_broken(route, call)
            return False
        return call is route.call

    def _encode(self, batch: ProducerBatch) -> bytes:
        if self._idempotent:
            return encode_batch(
                batch.records,
                producer_id=batch.producer_id,
                producer_epoch=0,
                base_sequence=batch.base_sequence or 0,
                compression=self._compression,
            )
        return encode_batch(batch.records, compression=self._compression)

    def _stream_broken(self, route: _Route, call: Any) -> None:
        if call is None or call is not route.call:
            return
        route.broken_generation = route.generation
        route.not_before_ms = self._loop.time() * 1000 + route.backoff_ms  # type: ignore[union-attr]
        route.backoff_ms = min(route.backoff_ms * 2, self._retry_backoff_max_ms)
        sent = {(b.topic, b.partition) for b in route.by_correlation.values()}
        self._close_stream(route)
        for key, delivery in self._busy.items():
            if key in sent or self._route_for(delivery) is route:
                delivery.on_stream_broken()
        self._resolve_rounds()
        if self._wakeup is not None:
            self._wakeup.set()

    def _close_stream(self, route: _Route) -> None:
        call, route.call = route.call, None
        route.by_correlation.clear()
        route.requests.clear()
        route.open, route.open_bytes, route.full = [], 0, []  # taken, never written: resent as the stream reopens
        route.batches_max, route.bytes_max = 0, 0  # until the next stream's node says what it takes
        if call is not None:
            call.cancel()
        reader, route.reader = route.reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()

    async def _read(self, route: _Route, call: Any) -> None:
        try:
            metadata = await call.initial_metadata()
            if call is route.call:
                route.learn_bounds(metadata, self._max_request_batches)
                self._wakeup.set()  # type: ignore[union-attr]
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                if call is not route.call:
                    return
                self._on_response(route, response)
        except asyncio.CancelledError:
            if call is not route.call:
                return
            raise
        except grpc.RpcError as exc:
            if call is route.call and exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._refused_oversized(
                    route, from_rpc_error(exc, route.connection.address, operation=Operation.PRODUCE)
                )
        self._stream_broken(route, call)

    def _refused_oversized(self, route: _Route, error: GeorepError) -> None:
        """gRPC refused a message above the node's size limit, and ended the stream. The largest unanswered batch
        is above it (the refused one is unanswered, and none is larger), so it fails for good; the rest resend."""
        in_flight = [b for b in route.by_correlation.values() if b.state is BatchState.IN_FLIGHT]
        if not in_flight or not isinstance(error, BatchTooLarge):
            return
        batch = max(in_flight, key=lambda b: len(b.data or b""))
        self._deliveries[(batch.topic, batch.partition)].on_failed(batch, error)
        self._fail_batch(batch, error)

    def _on_response(self, route: _Route, response: georep_pb2.ProduceResponse) -> None:
        if response.results:  # several answers in one message
            for one in response.results:
                self._on_answer(route, one)
        else:
            self._on_answer(route, response)
        self._wakeup.set()  # type: ignore[union-attr]

    def _on_answer(self, route: _Route, response: georep_pb2.ProduceResponse) -> None:
        batch = route.by_correlation.pop(response.correlation_id, None)
        if batch is None:
            return
        request = batch.request
        if request is not None:
            request.unanswered -= 1
            if request.unanswered <= 0:
                route.requests.pop(request, None)
        if batch.state is not BatchState.IN_FLIGHT:
            return
        delivery = self._deliveries[(batch.topic, batch.partition)]
        if not response.HasField("error") or response.error.code == 0:
            route.backoff_ms = self._retry_backoff_ms
            delivery.on_success(batch)
            self._complete_batch(batch, response)
        else:
            error = from_produce_error(response.error, route.connection.address)
            if isinstance(error, NotLeader):  # a multi-node site moved the partition: follow it, then resend
                key = (batch.topic, batch.partition)
                if error.leader:
                    self._leaders[key] = error.leader
                else:
                    self._leaders.pop(key, None)
                    self._refresh_leaders(batch.topic)
            now_ms = self._loop.time() * 1000  # type: ignore[union-attr]
            if delivery.on_error(batch, error, now_ms, self._retry_backoff_ms):
                self._fail_batch(batch, error)
            if delivery.round_complete():
                self._resolve_rounds()


async def _describe(
    connection: Connection, stub: georep_pb2_grpc.NodeAsyncStub, topic: str, auto_create: bool, timeout_s: float
) -> georep_pb2.TopicDescription:
    """A producer's metadata request for ``topic`` (``auto_create``: Kafka's allow_auto_topic_creation)."""
    request = georep_pb2.DescribeTopicRequest(name=topic, allow_auto_create=auto_create)
    try:
        return await connection.unary(stub.DescribeTopic(request, timeout=timeout_s))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, connection.address, operation=Operation.PRODUCE) from None


def linger_room(routes: Iterable[_Route], max_in_flight: int) -> int | None:
    """How many lingered batches to close now: as many as the nodes' requests have room for (None: no bound).

    Kafka's accumulator keeps a lingered batch open, still taking records, until the sender drains it for a
    node with room in flight. So under load a batch grows to what arrived while the node was busy rather than
    close at ``linger_ms`` and wait, closed, behind the requests in flight: with records sent to 10,000
    partitions in turn, a batch closed at 5 ms holds one record, and each batch costs the node, its
    replicas and this sender the same whatever it holds. Only a node that takes multi-batch requests, with
    its stream open, bounds it; any other route (opening, one batch a request) leaves it unbounded, as
    before, so a batch is never held back behind a stream that is not there to answer and wake the sender.
    """
    room = 0
    for route in routes:
        if route.call is None or route.batches_max <= 1:
            return None
        free = max_in_flight - len(route.requests) - len(route.full)
        if free > 0:
            room += free * route.batches_max - len(route.open)
    return max(room, 0)
