"""The asyncio consumer: one Fetch stream per assigned partition, decoded in the client.

Each assigned partition has a fetcher task that reads its ``Fetch`` stream,
checks every batch's CRC-32C, decodes the records, drops those below the
requested position or covered by the start vector (the node sends whole
batches), and puts them on a small bounded queue, so memory stays bounded
while the application is slow. ``poll`` takes from those queues round-robin.

Decoding decompresses a batch into at most ``READ_RECORDS_BYTES_MAX`` (the
largest ``max_batch_bytes`` a topic may have) and checks its records as a site
does before it stores them. A batch that fails (stored before sites validated
batches) ends the records of its response: ``poll`` returns every record
before it, then raises :class:`InvalidData`, which names the batch and says
what to do; with ``skip_corrupt=True`` the fetcher skips the batch, notes it
in :attr:`Consumer.skipped`, and goes on after it.

A fetcher that loses its node reconnects with bounded exponential backoff and
resumes from the offset after the last batch it queued. A start offset
outside the log applies ``auto_offset_reset`` (``earliest`` or ``latest``),
or with ``"none"`` makes ``poll`` raise :class:`OffsetOutOfRange`.

**Follower reads** (a multi-node site; Kafka's KIP-392 ``client.rack``).
With ``read_from="leader"`` (the default) each partition is fetched at its
leader. With ``read_from="follower"`` it is fetched at one preferred node
(``prefer``: its address; by default the first bootstrap node that answers,
the one you point the consumer at as "nearby"), which serves it whether it
leads the partition or follows it (``READ_FROM_REPLICA``: sealed segments to
their seals, the open segment to the LAC its leader announced to it,
``cluster/follower_reads.py``). Where that node cannot serve (it is down, or
not in the open segment's ensemble) the fetcher falls back to the leader, and
tries the preferred node again after ``FOLLOWER_RETRY_S``. Local offsets are
the same on every node of a site, so a move between them loses and repeats
nothing.

``position(tp)`` is the next local offset ``poll`` will return from; it is
None until known (after ``seek_to_beginning``/``seek_to_end``/
``seek_to_vector`` it becomes known with the first answer). ``vector(tp)`` is
the vector offset of everything consumed: the start vector plus, per origin,
the origin seq after the last record returned. Hand it to a consumer at
another site (``seek_to_vector``) to continue there with no loss and no
duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import NamedTuple

import grpc

from georep.client.connection import Connection
from georep.client.errors import (
    CorruptData,
    DamagedData,
    GeorepError,
    InvalidData,
    InvalidRequest,
    NodeUnavailable,
    NotLeader,
    OffsetOutOfRange,
    Operation,
    from_rpc_error,
)
from georep.client.group import Committed, GroupMembership, GroupOptions, check_group
from georep.client.producer import parse_acks
from georep.proto import georep_pb2
from georep.proto.convert import vector_from_proto, vector_to_proto
from georep.record.batch import CorruptBatch, InvalidBatch, check_batch, decode_records
from georep.security.tls import TlsConfig
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import Coverage, VectorOffset

TopicPartition = tuple[str, int]

log = logging.getLogger(__name__)

OFFSET_RESETS = ("earliest", "latest", "none")
DAMAGED_RETRY_S = 1.0  # how often a fetch stopped at a quarantined batch asks again
READ_FROM = ("leader", "follower")
FOLLOWER_RETRY_S = 10.0  # after a fall back to the leader, the preferred node is tried again this much later


class ConsumerRecord(NamedTuple):
    topic: str
    partition: int
    offset: LocalOffset  # local offset at the node read from
    origin: Origin
    origin_seq: OriginSeq
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


class _Chunk:
    """Records decoded from one fetch response, and where the stream goes on."""

    __slots__ = ("records", "index", "next_offset", "error")

    def __init__(self, records: list[ConsumerRecord], next_offset: int, error: GeorepError | None = None) -> None:
        self.records = records
        self.index = 0
        self.next_offset = next_offset
        self.error = error


class _Start(NamedTuple):
    kind: str  # "offset", "earliest", "latest", "vector"
    offset: int = -1
    vector: VectorOffset | None = None
    hint_origin: str = ""  # with a vector: a committed local-offset hint, valid at that site@epoch only
    hint_offset: int = -1


class _PartitionState:
    __slots__ = ("tp", "start", "position", "base_vector", "consumed", "queue", "current", "fetcher", "served_by",
                 "leader", "fallback_until")  # fmt: skip

    def __init__(self, tp: TopicPartition, start: _Start, queue_max: int) -> None:
        self.tp = tp
        self.served_by = ""  # site@epoch whose local offsets `position` counts in
        self.leader = ""  # a multi-node site: the address of the node leading the partition, once it answered so
        self.fallback_until = 0.0  # read_from="follower": fetch at the leader until then (time.monotonic())
        self.start = start
        self.position: int | None = start.offset if start.kind == "offset" else None
        self.base_vector = start.vector or VectorOffset()
        self.consumed: dict[Origin, int] = {}
        self.queue: asyncio.Queue[_Chunk] = asyncio.Queue(queue_max)
        self.current: _Chunk | None = None
        self.fetcher: asyncio.Task[None] | None = None


class Skipped(NamedTuple):
    """A range of a partition a ``skip_corrupt`` consumer skipped, and why."""

    topic: str
    partition: int
    first_offset: int  # -1: not known (a quarantined batch met before any position)
    next_offset: int
    message: str
    kind: str  # "damaged" (quarantined at the node) or "invalid" (stored without validation)


class BadBatch(NamedTuple):
    """A batch of a fetch response that does not decode: the records before it are good."""

    base_offset: int
    next_offset: int  # -1 when its header cannot be trusted (a CRC failure)
    error: CorruptBatch


class Decoded(NamedTuple):
    records: list[ConsumerRecord]
    bad: BadBatch | None


def decode_response(
    topic: str, partition: int, buf: bytes, min_offset: int, vector: VectorOffset | None
) -> list[ConsumerRecord]:
    """:func:`decode_fetched`'s records; raises the first bad batch's error instead of returning it."""
    decoded = decode_fetched(topic, partition, buf, min_offset, vector)
    if decoded.bad is not None:
        raise decoded.bad.error
    return decoded.records


def decode_fetched(topic: str, partition: int, buf: bytes, min_offset: int, vector: VectorOffset | None) -> Decoded:
    """CRC-check and decode the batches of one fetch response, dropping records below ``min_offset`` and
    records ``vector`` covers; stops at the first batch that does not decode, returning the records before it."""
    out: list[ConsumerRecord] = []
    view = memoryview(buf)
    pos = 0
    end = len(buf)
    make = ConsumerRecord._make
    prefix = (topic, partition)
    while pos < end:
        try:
            header = check_batch(view, pos)
        except CorruptBatch as exc:
            return Decoded(out, BadBatch(-1, -1, exc))
        size = header.size_bytes
        if header.next_offset <= min_offset:
            pos += size
            continue
        skip_seq = -1
        if vector:
            coverage = vector.covers_batch(header.origin, header.base_origin_seq, header.last_origin_seq)
            if coverage is Coverage.ALL:
                pos += size
                continue
            if coverage is Coverage.PARTIAL:
                skip_seq = vector.get(header.origin)
        try:
            records = decode_records(view[pos : pos + size], header)
        except InvalidBatch as exc:
            return Decoded(out, BadBatch(header.base_offset, header.next_offset, exc))
        if header.base_offset < min_offset or skip_seq >= 0:
            records = [r for r in records if r.offset >= min_offset and r.origin_seq >= skip_seq]
        out.extend(make(prefix + r) for r in records)
        pos += size
    return Decoded(out, None)


class Consumer:
    """``consumer.assign([("t", 0)])``, then ``await consumer.poll()`` or ``async for record in consumer``."""

    def __init__(
        self,
        bootstrap: str | list[str],
        *,
        auto_offset_reset: str = "latest",
        max_bytes: int = 1 << 20,
        max_wait_ms: int = 500,
        queued_responses_max: int = 4,
        retry_backoff_ms: int = 100,
        retry_backoff_max_ms: int = 1_000,
        request_timeout_ms: int = 30_000,
        connect_timeout_ms: int = 5_000,
        group_id: str | None = None,
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5_000,
        session_timeout_ms: int = 10_000,
        assignor: str = "range",
        commit_acks: str = "leader",
        commit_wait_caught_up_ms: int = 5_000,
        client_id: str = "",
        skip_corrupt: bool = False,
        read_from: str = "leader",
        prefer: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self._tls = tls
        if auto_offset_reset not in OFFSET_RESETS:
            raise InvalidRequest(f"invalid auto_offset_reset {auto_offset_reset!r}: use earliest, latest or none")
        if read_from not in READ_FROM:
            raise InvalidRequest(f"invalid read_from {read_from!r}: use 'leader' (each partition at its leader) or "
                                 "'follower' (at the preferred node, which may follow the partition)")  # fmt: skip
        if prefer is not None and read_from != "follower":
            raise InvalidRequest("prefer names the node follower reads go to: give it with read_from='follower'")
        self._read_from = read_from
        # Fetch responses with records that a node not leading the partition served (read_from="follower").
        self.follower_reads = 0
        # read_from="follower": the node every partition is fetched at first (None: the bootstrap connection's).
        self._prefer = Connection(prefer, connect_timeout_ms, tls) if prefer is not None else None
        self._group: GroupMembership | None = None
        self._group_id = group_id
        self._group_options = GroupOptions(
            session_timeout_ms=session_timeout_ms, assignor=assignor, client_id=client_id,
            enable_auto_commit=enable_auto_commit, auto_commit_interval_ms=auto_commit_interval_ms,
            commit_acks=parse_acks(commit_acks), commit_wait_caught_up_ms=commit_wait_caught_up_ms,
        )  # fmt: skip
        self._connection = Connection(bootstrap, connect_timeout_ms, tls)
        self._connect_timeout_ms = connect_timeout_ms
        # A multi-node site serves each partition at its leader: one connection per leader address, shared by the
        # fetchers of the partitions it leads (the bootstrap connection serves the rest, and every other call).
        self._leader_connections: dict[str, Connection] = {}
        self._reset = auto_offset_reset
        self._skip_corrupt = skip_corrupt
        # With skip_corrupt: what was skipped, and why.
        self.skipped: list[Skipped] = []
        self._max_bytes = max_bytes
        self._max_wait_ms = max_wait_ms
        self._queue_max = queued_responses_max
        self._retry_backoff_ms = retry_backoff_ms
        self._retry_backoff_max_ms = max(retry_backoff_max_ms, retry_backoff_ms)
        self._request_timeout_s = request_timeout_ms / 1000
        self._states: dict[TopicPartition, _PartitionState] = {}
        self._subscribed: list[str] = []
        self._resolved_topics: set[str] = set()
        self._subscription_start: _Start | None = None  # a seek made before the subscription resolved
        self._data = asyncio.Event()
        self._rr = 0
        self._closed = False
        self._next_auto_commit = 0.0
        self._auto_commit: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> Consumer:
        await self._connection.connect()
        return self

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop fetching; in a group, commit (with auto-commit on) and leave it, so others take over at once."""
        if self._group is not None and not self._closed:
            if self._group_options.enable_auto_commit and self._group.member_id:
                try:
                    await self.commit()
                except GeorepError as exc:
                    log.warning("final commit of group %r failed: %s", self._group.group, exc.message)
            await self._group.leave()
        self._closed = True
        tasks = [s.fetcher for s in self._states.values() if s.fetcher is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._connection.close()
        for connection in self._leader_connections.values():
            await connection.close()
        if self._prefer is not None:
            await self._prefer.close()

    def _preferred(self, state: _PartitionState) -> Connection | None:
        """With read_from="follower", the preferred node's connection, unless ``state`` falls back to the leader."""
        if self._read_from != "follower" or time.monotonic() < state.fallback_until:
            return None
        return self._prefer if self._prefer is not None else self._connection

    def _fetch_connection(self, state: _PartitionState) -> Connection:
        preferred = self._preferred(state)
        if preferred is not None:
            return preferred
        if not state.leader:
            return self._connection
        connection = self._leader_connections.get(state.leader)
        if connection is None:
            connection = self._leader_connections[state.leader] = Connection(state.leader, self._connect_timeout_ms,
                                                                                      self._tls)
        return connection

    # --- assignment and positions ------------------------------------------------

    def _default_start(self) -> _Start:
        if self._subscription_start is not None:
            return self._subscription_start
        return _Start("latest") if self._reset == "latest" else _Start("earliest") if self._reset == "earliest" \
            else _Start("none")  # fmt: skip

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any earlier assignment or subscription)."""
        wanted = [(str(t), int(p)) for t, p in partitions]
        self._subscribed = []
        for tp in list(self._states):
            if tp not in wanted:
                self._drop(tp)
        for tp in wanted:
            if tp not in self._states:
                self._states[tp] = _PartitionState(tp, self._default_start(), self._queue_max)

    def subscribe(self, topics: Iterable[str], group: str | None = None) -> None:
        """Read the topics: with a group (here or ``group_id=``), the partitions the
        group's coordinator assigns to this member; without one, every partition."""
        if self._group is not None:
            raise InvalidRequest("this consumer already joined a group: close it and create another to resubscribe")
        self.assign([])
        self._subscribed = list(topics)
        self._resolved_topics = set()
        self._subscription_start = None
        if group is not None:
            self._group_id = group

    @property
    def site_origin(self) -> str:
        """``site@epoch`` of the node this consumer reads from now ("" before connecting)."""
        return self._connection.origin

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._states)

    def describe(self) -> str:
        """One line on where this consumer is: its site, its group membership, each partition's fetch."""
        parts = [f"at {self._connection.origin or self._connection.address or 'no site'}"]
        g = self._group
        if g is not None:
            parts.append(f"group {g.group} member {g.member_id or '-'} generation {g.generation} at {g.site or '-'}"
                         + (f" (last error: {g.error.message})" if g.error is not None else ""))  # fmt: skip
        for tp, s in sorted(self._states.items()):
            fetch = "no fetch" if s.fetcher is None else "fetch ended" if s.fetcher.done() else "fetching"
            parts.append(f"{tp[0]}/{tp[1]} position {s.position} from {s.served_by or '-'}, {fetch}")
        return ", ".join(parts)

    def _drop(self, tp: TopicPartition) -> None:
        state = self._states.pop(tp)
        if state.fetcher is not None:
            state.fetcher.cancel()

    def _restart(self, tp: TopicPartition, start: _Start) -> None:
        old = self._states.get(tp)
        if old is not None and old.fetcher is not None:
            old.fetcher.cancel()
        self._states[tp] = _PartitionState(tp, start, self._queue_max)

    def _tps(self, tps: Iterable[TopicPartition] | None) -> list[TopicPartition]:
        return list(self._states) if tps is None else [(str(t), int(p)) for t, p in tps]

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Continue ``tp`` from local ``offset`` (the batch holding it is fetched, earlier records dropped)."""
        self._restart(tp, _Start("offset", int(offset)))

    def seek_to_beginning(self, tps: Iterable[TopicPartition] | None = None) -> None:
        if tps is None and self._subscribed:
            # Partitions the subscription resolves later start here too.
            self._subscription_start = _Start("earliest")
        for tp in self._tps(tps):
            self._restart(tp, _Start("earliest"))

    def seek_to_end(self, tps: Iterable[TopicPartition] | None = None) -> None:
        if tps is None and self._subscribed:
            self._subscription_start = _Start("latest")
        for tp in self._tps(tps):
            self._restart(tp, _Start("latest"))

    def seek_to_vector(self, tp: TopicPartition, vector: VectorOffset) -> None:
        """Continue ``tp`` with exactly the records ``vector`` does not cover, at this or any site."""
        self._restart(tp, _Start("vector", -1, vector))

    def position(self, tp: TopicPartition) -> int | None:
        """The next local offset to be returned for ``tp``; None until known."""
        return self._states[tp].position

    def vector(self, tp: TopicPartition) -> VectorOffset:
        """The vector offset of everything consumed from ``tp``."""
        state = self._states[tp]
        if not state.consumed:
            return state.base_vector
        return state.base_vector.merge(VectorOffset(state.consumed))

    # --- groups and commits -------------------------------------------------------

    async def _apply_assignment(self, assignment: set[TopicPartition], moved: bool) -> None:
        """Called by the group membership with this member's new assignment."""
        assert self._group is not None
        for tp in list(self._states):
            if tp not in assignment:
                self._drop(tp)
        need = sorted(tp for tp in assignment if moved or tp not in self._states)
        committed = await self._group.fetch_committed(need) if need else {}
        for tp in need:
            c = committed.get(tp)
            if tp not in self._states:
                start = self._default_start() if c is None else \
                    _Start("vector", -1, c.vector, c.committed_by, c.hint_offset)  # fmt: skip
                self._states[tp] = _PartitionState(tp, start, self._queue_max)
            elif c is not None and not c.vector.dominated_by(self.vector(tp)):
                # Another member committed past what this one consumed (it owned the
                # partition meanwhile): go on after both.
                self._restart(tp, _Start("vector", -1, self.vector(tp).merge(c.vector)))
        self._start_fetchers()

    async def commit(self, offsets: dict[TopicPartition, VectorOffset] | None = None) -> None:
        """Commit the group's position: by default the vector of everything ``poll`` returned,
        for every assigned partition. Waits for the ack level of ``commit_acks``."""
        group = self._membership()
        if offsets is None:
            offsets = {tp: self.vector(tp) for tp in self._states}
            hints = {
                tp: s.position for tp, s in self._states.items()
                if s.position is not None and s.served_by == self._connection.origin
            }  # fmt: skip
        else:
            hints = {}
        await group.commit(offsets, hints, member=bool(self._subscribed))

    def commit_async(self, offsets: dict[TopicPartition, VectorOffset] | None = None) -> asyncio.Task[None]:
        """``commit`` in the background; await the task for its outcome."""
        return asyncio.create_task(self.commit(offsets), name="georep-commit")

    async def committed(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, Committed]:
        """The group's committed positions for ``tps``, as the connected site holds them."""
        await self._connection.connect()
        return await self._membership().fetch_committed([(str(t), int(p)) for t, p in tps])

    def _membership(self) -> GroupMembership:
        if self._group is None:
            group = check_group(self._group_id)
            self._group = GroupMembership(self, group, self._subscribed, self._group_options)
        return self._group

    def _maybe_auto_commit(self) -> None:
        if self._group is None or not self._group_options.enable_auto_commit or not self._group.member_id:
            return
        now = time.monotonic()
        if now < self._next_auto_commit or (self._auto_commit is not None and not self._auto_commit.done()):
            return
        self._next_auto_commit = now + self._group_options.auto_commit_interval_ms / 1000
        self._auto_commit = asyncio.create_task(self._auto_commit_once(), name="georep-auto-commit")

    async def _auto_commit_once(self) -> None:
        try:
            await self.commit()
        except GeorepError as exc:
            log.warning("auto-commit of group %r failed: %s", self._group_id, exc.message)

    # --- reading ---------------------------------------------------------------

    async def _ensure_started(self) -> None:
        if self._closed:
            raise GeorepError("poll() on a closed consumer")
        await self._connection.connect()
        if self._subscribed and self._group_id:
            group = self._membership()
            if not group.started:
                await group.start()
            if group.error is not None:
                error, group.error = group.error, None
                raise error
            self._maybe_auto_commit()
            self._start_fetchers()
            return
        for topic in self._subscribed:
            if topic in self._resolved_topics:
                continue
            try:
                description = await self._connection.unary(self._connection.stub.DescribeTopic(
                    georep_pb2.DescribeTopicRequest(name=topic), timeout=self._request_timeout_s
                ))
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, self._connection.address, operation=Operation.FETCH) from None
            for partition in range(description.partitions):
                tp = (topic, partition)
                if tp not in self._states:
                    self._states[tp] = _PartitionState(tp, self._default_start(), self._queue_max)
            self._resolved_topics.add(topic)
        self._start_fetchers()

    def _start_fetchers(self) -> None:
        for state in self._states.values():
            if state.fetcher is not None and state.fetcher.done() and state.current is None and state.queue.empty():
                # It ended on an error that poll() has raised by now: fetch again,
                # after what was consumed (Kafka's consumer also retries a fetch).
                state.fetcher = None
                if state.consumed or state.start.kind == "vector":
                    state.start = self._vector_start(state)
            if state.fetcher is None:
                if state.start.kind == "none":
                    raise InvalidRequest(
                        f"no position for {state.tp[0]}/{state.tp[1]} and auto_offset_reset='none': "
                        "call seek(), seek_to_beginning(), seek_to_end() or seek_to_vector() first"
                    )
                state.fetcher = asyncio.create_task(self._fetch(state), name=f"georep-fetch-{state.tp}")

    async def poll(self, timeout_ms: float = 1000, max_records: int = 500) -> list[ConsumerRecord]:
        """Up to ``max_records`` records, waiting at most ``timeout_ms`` for the first one."""
        await self._ensure_started()
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self._data.clear()
            out = self._take(max_records)
            if out:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._data.wait()

    def _take(self, max_records: int) -> list[ConsumerRecord]:
        out: list[ConsumerRecord] = []
        states = list(self._states.values())
        if not states or (self._group is not None and self._group.lapsed):
            return out  # a group member no coordinator answered for a session: its partitions may be others' now
        self._rr = (self._rr + 1) % len(states)
        for state in states[self._rr :] + states[: self._rr]:
            while len(out) < max_records:
                chunk = state.current
                if chunk is None:
                    try:
                        chunk = state.queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    if chunk.error is not None:
                        if out:
                            state.current = chunk  # raise it on the next poll, after these records
                            return out
                        raise chunk.error
                    state.current = chunk
                records = chunk.records
                take = records[chunk.index : chunk.index + max_records - len(out)]
                chunk.index += len(take)
                if take:
                    consumed = state.consumed
                    for record in take:
                        consumed[record.origin] = record.origin_seq + 1
                    out.extend(take)
                    state.position = take[-1].offset + 1
                if chunk.index >= len(records):
                    state.position = chunk.next_offset
                    state.current = None
        return out

    async def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        while True:
            for record in await self.poll(timeout_ms=self._max_wait_ms):
                yield record

    # --- the fetchers ----------------------------------------------------------

    def _request(self, state: _PartitionState, start: _Start, replica: bool = False) -> georep_pb2.FetchRequest:
        topic, partition = state.tp
        request = georep_pb2.FetchRequest(topic=topic, partition=partition, max_bytes=self._max_bytes,
                                          max_wait_ms=self._max_wait_ms)  # fmt: skip
        if replica:
            request.read_from = georep_pb2.READ_FROM_REPLICA
        if start.kind == "offset":
            request.offset = start.offset
        elif start.kind == "vector":
            assert start.vector is not None
            request.vector.CopyFrom(vector_to_proto(start.vector))
            if start.hint_origin:
                request.hint_origin = start.hint_origin
                request.hint_offset = start.hint_offset
        elif start.kind == "latest":
            request.position = georep_pb2.START_LATEST
        else:
            request.position = georep_pb2.START_EARLIEST
        return request

    def _vector_start(self, state: _PartitionState) -> _Start:
        """Where ``state`` continues at another site: after everything consumed."""
        while not state.queue.empty():
            state.queue.get_nowait()
        state.current = None
        state.position = None
        vector = self.vector(state.tp)
        if not vector and state.start.kind != "vector":
            # Nothing consumed yet, and a local offset means nothing at another site.
            kind = state.start.kind if state.start.kind in ("earliest", "latest") else self._reset
            return _Start("latest") if kind == "latest" else _Start("earliest")
        state.base_vector, state.consumed = vector, {}
        return _Start("vector", -1, vector)

    async def _put(self, state: _PartitionState, chunk: _Chunk) -> None:
        await state.queue.put(chunk)
        self._data.set()

    async def _latest_as_vector(self, state: _PartitionState) -> _Start:
        """"The end of the log" as a vector: positions and commits then mean the same at every site."""
        topic, partition = state.tp
        try:
            stub = await self._connection.connect()
            description = await self._connection.unary(stub.DescribeTopic(
                georep_pb2.DescribeTopicRequest(name=topic), timeout=self._request_timeout_s
            ))
        except (grpc.RpcError, GeorepError):
            return state.start  # the fetch reports the error, or retries
        states = [ps for ps in description.partition_states if ps.partition == partition]
        if not states:
            return state.start
        vector = vector_from_proto(states[0].vector)
        state.base_vector = vector
        return _Start("vector", -1, vector)

    async def _past_bad_batch(self, state: _PartitionState, records: list[ConsumerRecord], bad: BadBatch,
                              last_next: int, address: str) -> bool:  # fmt: skip
        """Hand out the records before a batch that does not decode, then skip it (True: the fetcher goes on after
        it) or report it (False: the fetcher stops; ``poll`` raises after the records)."""
        topic, partition = state.tp
        if records:
            await self._put(state, _Chunk(records, bad.base_offset))  # every record before it first
        if bad.next_offset < 0:  # a CRC failure: its header, so where it ends, cannot be trusted
            await self._put(state, _Chunk([], last_next, CorruptData(
                f"corrupt batch fetched from {topic}/{partition} at {address}: {bad.error}; the node's copy may be "
                "damaged, try another site")))  # fmt: skip
            return False
        message = (f"invalid batch at {topic}/{partition} offsets {bad.base_offset}..{bad.next_offset - 1}, served "
                   f"by {address}: {bad.error}. It was stored before georep validated batches")  # fmt: skip
        if not self._skip_corrupt:
            await self._put(state, _Chunk([], bad.base_offset, InvalidData(
                f"{message}; skip it (georep consume --skip-corrupt, Consumer(skip_corrupt=True)) or read it at a "
                "site that holds a valid copy", None, bad.next_offset)))  # fmt: skip
            return False
        self.skipped.append(Skipped(topic, partition, bad.base_offset, bad.next_offset, message, "invalid"))
        await self._put(state, _Chunk([], bad.next_offset))
        return True

    async def _fetch(self, state: _PartitionState) -> None:
        topic, partition = state.tp
        start = state.start
        if start.kind == "latest":
            start = await self._latest_as_vector(state)
        vector = start.vector
        min_offset = start.offset if start.kind == "offset" else -1
        last_next = -1
        reported_damage: int | None = None
        backoff_ms = self._retry_backoff_ms
        while True:
            connection = self._fetch_connection(state)
            preferred = connection is self._preferred(state)
            try:
                stub = await connection.connect()
            except NodeUnavailable:
                if preferred:  # the preferred node is down: fall back to the leader meanwhile
                    state.fallback_until = time.monotonic() + FOLLOWER_RETRY_S
                    continue
                state.leader = ""  # a partition leader that is gone: the bootstrap nodes name the next one
                await asyncio.sleep(backoff_ms / 1000)
                backoff_ms = min(backoff_ms * 2, self._retry_backoff_max_ms)
                continue
            generation = connection.generation
            if state.served_by and state.served_by != connection.origin:
                # Another site: its local offsets mean nothing here. Continue from
                # the vector of what was consumed, and drop what was fetched but
                # not yet returned (the new site sends it again).
                start = self._vector_start(state)
                vector, min_offset, last_next = start.vector, -1, -1
            state.served_by = connection.origin
            call = stub.Fetch(self._request(state, start, replica=preferred))
            try:
                async for response in call:
                    backoff_ms = self._retry_backoff_ms
                    records, bad = decode_fetched(topic, partition, response.batches, min_offset, vector)
                    if bad is not None:
                        if not await self._past_bad_batch(state, records, bad, last_next, connection.address):
                            return
                        start = _Start("offset", bad.next_offset)
                        min_offset = last_next = bad.next_offset
                        break  # fetch again from after it: the rest of this response was not decoded
                    next_offset = response.next_offset
                    if records and response.follower_read:
                        self.follower_reads += 1
                    if records or next_offset != last_next:
                        await self._put(state, _Chunk(records, next_offset))
                    last_next = next_offset
                    # Resume here after a reconnect; the vector filter stays on.
                    start = _Start("offset", next_offset)
                    min_offset = next_offset
                    if not preferred and self._read_from == "follower" and self._preferred(state) is not None:
                        break  # the fall back to the leader is over: the preferred node again
                continue  # the node ended the stream: open it again
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # The call was cancelled under us: another task closed the shared
                # channel to reconnect. Follow it to the new channel.
                await asyncio.sleep(backoff_ms / 1000)
                continue
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, connection.address, operation=Operation.FETCH)
                if isinstance(error, NotLeader):  # a multi-node site: fetch from the partition's leader
                    state.leader = error.leader if error.leader != connection.address else state.leader
                    if preferred:  # it cannot serve this (all) as a follower: the leader meanwhile
                        state.fallback_until = time.monotonic() + FOLLOWER_RETRY_S
                        continue
                    await asyncio.sleep(backoff_ms / 1000)
                    backoff_ms = min(backoff_ms * 2, self._retry_backoff_max_ms)
                    continue
                if isinstance(error, DamagedData) and (skip_to := error.next_offset) >= 0:
                    # Quarantined at this node until a peer's copy repairs it: skip it if asked, else report
                    # it once and keep trying (the repair may come).
                    at = start.offset if start.kind == "offset" else -1
                    if self._skip_corrupt:
                        self.skipped.append(Skipped(topic, partition, at, skip_to, error.message, "damaged"))
                        start, min_offset = _Start("offset", skip_to), skip_to
                        continue
                    if reported_damage != at:
                        reported_damage = at
                        await self._put(state, _Chunk([], last_next, DamagedData(error.message, error.code,
                                                                                 skip_to)))  # fmt: skip
                    await asyncio.sleep(DAMAGED_RETRY_S)
                    continue
                if isinstance(error, NodeUnavailable):
                    await asyncio.sleep(backoff_ms / 1000)
                    backoff_ms = min(backoff_ms * 2, self._retry_backoff_max_ms)
                    if preferred:
                        state.fallback_until = time.monotonic() + FOLLOWER_RETRY_S
                        continue
                    if state.leader:
                        state.leader = ""  # the leader went away: the bootstrap nodes name the next one
                        continue
                    with contextlib.suppress(GeorepError):
                        await self._connection.reconnect(generation)
                    continue
                if isinstance(error, OffsetOutOfRange) and self._reset != "none":
                    start = _Start(self._reset)
                    min_offset = -1
                    continue
                if isinstance(error, OffsetOutOfRange):
                    error = OffsetOutOfRange(
                        f"{error.message} ({topic}/{partition}, auto_offset_reset='none': "
                        "seek to a valid offset, or use seek_to_beginning/seek_to_end)", error.code)  # fmt: skip
                await self._put(state, _Chunk([], last_next, error))
                return
            finally:
                call.cancel()
