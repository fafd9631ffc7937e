"""A consumer's fetcher: one ``Fetch`` stream per assigned partition, decoded in the client, and what ``poll``
takes from them.

Each partition has a fetch task that reads its stream, decodes each response (``georep/client/fetched.py``) and
puts the records on the partition's small bounded queue (``georep/client/subscription.py``), so memory stays
bounded while the application is slow; :meth:`Fetcher.take` takes from the queues round-robin.

A batch that does not decode (stored before sites validated batches) ends the records of its response: ``poll``
returns every record before it, then raises :class:`InvalidData`, which names the batch and says what to do; with
``skip_corrupt=True`` the task skips the batch, notes it in :attr:`Fetcher.skipped`, and goes on after it. A batch
quarantined at the node (``DamagedData``) is reported once and asked for again every ``DAMAGED_RETRY_S`` (a peer's
copy may repair it), or skipped likewise.

A task that loses its node reconnects with bounded exponential backoff and resumes from the offset after the last
response it queued; at another site (the connection failed over), from the vector of what was consumed. A start
offset outside the log applies ``auto_offset_reset`` (``earliest`` or ``latest``), or with ``"none"`` makes
``poll`` raise :class:`OffsetOutOfRange`.

**Follower reads** (a multi-node site; Kafka's KIP-392 ``client.rack``). With ``read_from="leader"`` each
partition is fetched at its leader (the node a ``NotLeader`` names). With ``read_from="follower"`` it is fetched at
one preferred node, which serves it whether it leads the partition or follows it (``READ_FROM_REPLICA``: sealed
segments to their seals, the open segment to the LAC its leader announced, ``cluster/follower_reads.py``). Where
that node cannot serve (it is down, or not in the open segment's ensemble) the task falls back to the leader, and
tries the preferred node again after ``FOLLOWER_RETRY_S``. Local offsets are the same on every node of a site, so
a move between them loses and repeats nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

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
from georep.client.fetched import BadBatch, ConsumerRecord, decode_fetched
from georep.client.subscription import Chunk, PartitionState, Start, SubscriptionState
from georep.proto import georep_pb2
from georep.proto.convert import vector_from_proto, vector_to_proto
from georep.security.tls import TlsConfig

DAMAGED_RETRY_S = 1.0  # how often a fetch stopped at a quarantined batch asks again
READ_FROM = ("leader", "follower")
FOLLOWER_RETRY_S = 10.0  # after a fall back to the leader, the preferred node is tried again this much later


class Skipped(NamedTuple):
    """A range of a partition a ``skip_corrupt`` consumer skipped, and why."""

    topic: str
    partition: int
    first_offset: int  # -1: not known (a quarantined batch met before any position)
    next_offset: int
    message: str
    kind: str  # "damaged" (quarantined at the node) or "invalid" (stored without validation)


@dataclass(frozen=True, slots=True)
class FetchOptions:
    max_bytes: int = 1 << 20
    max_wait_ms: int = 500
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 1_000
    request_timeout_s: float = 30.0
    connect_timeout_ms: int = 5_000
    read_from: str = "leader"
    skip_corrupt: bool = False


class Fetcher:
    def __init__(
        self,
        subscription: SubscriptionState,
        connection: Connection,
        options: FetchOptions,
        prefer: Connection | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.subscription = subscription
        self.connection = connection  # the bootstrap connection: every call but the fetches a leader serves
        self.options = options
        self.prefer = prefer  # read_from="follower": the node every partition is fetched at first (None: bootstrap)
        self.tls = tls
        self.follower_reads = 0  # fetch responses with records that a node not leading the partition served
        self.skipped: list[Skipped] = []  # with skip_corrupt: what was skipped, and why
        self.data = asyncio.Event()  # set whenever a queue gets a chunk
        # A multi-node site serves each partition at its leader: one connection per leader address, shared by the
        # fetchers of the partitions it leads.
        self._leaders: dict[str, Connection] = {}
        self._rr = 0

    # -- tasks ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """A fetch task for every partition that has none, or whose task ended on an error ``poll`` has raised."""
        subscription = self.subscription
        for state in subscription.states.values():
            if state.fetcher is not None and state.fetcher.done() and state.current is None and state.queue.empty():
                # Fetch again, after what was consumed (Kafka's consumer also retries a fetch).
                state.fetcher = None
                if state.consumed or state.start.kind == "vector":
                    state.start = subscription.vector_start(state)
            if state.fetcher is None:
                if state.start.kind == "none":
                    raise InvalidRequest(
                        f"no position for {state.tp[0]}/{state.tp[1]} and auto_offset_reset='none': "
                        "call seek(), seek_to_beginning(), seek_to_end() or seek_to_vector() first"
                    )
                state.fetcher = asyncio.create_task(_PartitionFetch(self, state).run(), name=f"georep-fetch-{state.tp}")

    async def close(self) -> None:
        tasks = [s.fetcher for s in self.subscription.states.values() if s.fetcher is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for connection in self._leaders.values():
            await connection.close()
        if self.prefer is not None:
            await self.prefer.close()

    # -- what poll takes --------------------------------------------------------------------------------------

    def take(self, max_records: int) -> list[ConsumerRecord]:
        """Up to ``max_records`` queued records, round-robin over the partitions; raises a partition's error once
        the records before it are taken."""
        out: list[ConsumerRecord] = []
        states = list(self.subscription.states.values())
        if not states:
            return out
        self._rr = (self._rr + 1) % len(states)
        for state in states[self._rr :] + states[: self._rr]:
            if not _take_from(state, out, max_records):
                return out
        return out

    # -- where a partition is fetched ------------------------------------------------------------------------

    def preferred(self, state: PartitionState) -> Connection | None:
        """With read_from="follower", the preferred node's connection, unless ``state`` falls back to the leader."""
        if self.options.read_from != "follower" or time.monotonic() < state.fallback_until:
            return None
        return self.prefer if self.prefer is not None else self.connection

    def connection_for(self, state: PartitionState) -> Connection:
        preferred = self.preferred(state)
        if preferred is not None:
            return preferred
        if not state.leader:
            return self.connection
        connection = self._leaders.get(state.leader)
        if connection is None:
            connection = Connection(state.leader, self.options.connect_timeout_ms, self.tls)
            self._leaders[state.leader] = connection
        return connection

    def request(self, state: PartitionState, start: Start, replica: bool) -> georep_pb2.FetchRequest:
        topic, partition = state.tp
        o = self.options
        request = georep_pb2.FetchRequest(
            topic=topic, partition=partition, max_bytes=o.max_bytes, max_wait_ms=o.max_wait_ms
        )
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

    async def put(self, state: PartitionState, chunk: Chunk) -> None:
        await state.queue.put(chunk)
        self.data.set()

    async def latest_as_vector(self, state: PartitionState) -> Start:
        """ "The end of the log" as a vector: positions and commits then mean the same at every site."""
        topic, partition = state.tp
        connection = self.connection
        try:
            stub = await connection.connect()
            description = await connection.unary(
                stub.DescribeTopic(georep_pb2.DescribeTopicRequest(name=topic), timeout=self.options.request_timeout_s)
            )
        except (grpc.RpcError, GeorepError):
            return state.start  # the fetch reports the error, or retries
        states = [ps for ps in description.partition_states if ps.partition == partition]
        if not states:
            return state.start
        vector = vector_from_proto(states[0].vector)
        state.base_vector = vector
        return Start("vector", -1, vector)


def _take_from(state: PartitionState, out: list[ConsumerRecord], max_records: int) -> bool:
    """Move ``state``'s queued records to ``out`` (up to ``max_records`` in all); False when an error is due
    after them (raised now if ``out`` is empty)."""
    while len(out) < max_records:
        chunk = state.current
        if chunk is None:
            try:
                chunk = state.queue.get_nowait()
            except asyncio.QueueEmpty:
                return True
            state.current = chunk
        if chunk.error is not None:
            if out:
                return False  # raised by the next poll, after these records
            state.current = None
            raise chunk.error
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
    return True


class _PartitionFetch:
    """One partition's fetch task: its streams, one after another, and where the next one starts."""

    def __init__(self, fetcher: Fetcher, state: PartitionState) -> None:
        self.f = fetcher
        self.state = state
        self.start = state.start
        self.vector = self.start.vector
        self.min_offset = self.start.offset if self.start.kind == "offset" else -1
        self.last_next = -1  # the next offset of the last response queued
        self.reported_damage: int | None = None  # the offset whose quarantined batch was reported
        self.backoff_ms = fetcher.options.retry_backoff_ms

    async def run(self) -> None:
        if self.start.kind == "latest":
            self.start = await self.f.latest_as_vector(self.state)
            self.vector = self.start.vector
        while True:
            connection = self.f.connection_for(self.state)
            preferred = connection is self.f.preferred(self.state)
            try:
                stub = await connection.connect()
            except NodeUnavailable:
                await self._lost(preferred, None)
                continue
            generation = connection.generation
            self._follow_site(connection)
            call = stub.Fetch(self.f.request(self.state, self.start, replica=preferred))
            try:
                if not await self._read(call, connection, preferred):
                    return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # The call was cancelled under us: another task closed the shared channel to reconnect. Follow it
                # to the new channel.
                await asyncio.sleep(self.backoff_ms / 1000)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, connection.address, operation=Operation.FETCH)
                if not await self._failed(error, connection, preferred, generation):
                    return
            finally:
                call.cancel()

    def _follow_site(self, connection: Connection) -> None:
        """At another site, local offsets mean nothing: continue from the vector of what was consumed."""
        state = self.state
        if state.served_by and state.served_by != connection.origin:
            self.start = self.f.subscription.vector_start(state)
            self.vector, self.min_offset, self.last_next = self.start.vector, -1, -1
        state.served_by = connection.origin

    def _backoff(self) -> float:
        wait_s = self.backoff_ms / 1000
        self.backoff_ms = min(self.backoff_ms * 2, self.f.options.retry_backoff_max_ms)
        return wait_s

    async def _read(self, call: Any, connection: Connection, preferred: bool) -> bool:
        """Queue the responses of one stream; False when the task must stop (a bad batch reported)."""
        state, f = self.state, self.f
        topic, partition = state.tp
        async for response in call:
            self.backoff_ms = f.options.retry_backoff_ms
            records, bad = decode_fetched(topic, partition, response.batches, self.min_offset, self.vector)
            if bad is not None:
                if not await self._past_bad_batch(records, bad, connection.address):
                    return False
                self._resume_at(bad.next_offset)
                return True  # fetch again from after it: the rest of this response was not decoded
            next_offset = response.next_offset
            if records and response.follower_read:
                f.follower_reads += 1
            if records or next_offset != self.last_next:
                await f.put(state, Chunk(records, next_offset))
            self.last_next = next_offset
            self.start, self.min_offset = Start("offset", next_offset), next_offset  # the vector filter stays on
            if not preferred and f.options.read_from == "follower" and f.preferred(state) is not None:
                return True  # the fall back to the leader is over: the preferred node again
        return True  # the node ended the stream: open it again

    def _resume_at(self, offset: int) -> None:
        self.start = Start("offset", offset)
        self.min_offset = self.last_next = offset

    async def _failed(self, error: GeorepError, connection: Connection, preferred: bool, generation: int) -> bool:
        """A stream ended with ``error``; False when the task stops (the error queued for ``poll``)."""
        state = self.state
        if isinstance(error, NotLeader):  # a multi-node site: fetch from the partition's leader ("": ask again)
            if error.leader != connection.address:
                state.leader = error.leader
            if preferred:  # it cannot serve this (all) as a follower: the leader meanwhile
                state.fallback_until = time.monotonic() + FOLLOWER_RETRY_S
            else:
                await asyncio.sleep(self._backoff())
            return True
        if isinstance(error, DamagedData) and error.next_offset >= 0:
            await self._damaged(error)
            return True
        if isinstance(error, NodeUnavailable) and error.code == grpc.StatusCode.CANCELLED:
            # This stream was cancelled, not the node lost (that is UNAVAILABLE): the channel was replaced under it,
            # or the call alone ended. Open it again on the channel there is now. A reconnect here would cancel
            # every other stream of the channel, each of which would reconnect in turn: with a few thousand
            # partitions (a wildcard subscription) that storm held a consumer to a few hundred records a second.
            await asyncio.sleep(self._backoff())
            return True
        if isinstance(error, NodeUnavailable):
            await self._lost(preferred, generation, backoff_first=True)
            return True
        reset = self.f.subscription.reset
        if isinstance(error, OffsetOutOfRange) and reset != "none":
            self.start, self.min_offset = Start(reset), -1
            return True
        if isinstance(error, OffsetOutOfRange):
            where = f"{state.tp[0]}/{state.tp[1]}, auto_offset_reset='none'"
            error = OffsetOutOfRange(
                f"{error.message} ({where}: seek to a valid offset, or use seek_to_beginning/seek_to_end)", error.code
            )
        await self.f.put(state, Chunk([], self.last_next, error))
        return False

    async def _lost(self, preferred: bool, generation: int | None, backoff_first: bool = False) -> None:
        """The node fetched from is gone: the preferred node falls back to the leader, a leader to the bootstrap
        nodes (which name the next one), the bootstrap connection reconnects; after a backoff."""
        state = self.state
        if backoff_first:
            await asyncio.sleep(self._backoff())
        if preferred:
            state.fallback_until = time.monotonic() + FOLLOWER_RETRY_S
            return
        if state.leader:
            state.leader = ""
            if backoff_first:
                return
        elif generation is not None:
            with contextlib.suppress(GeorepError):
                await self.f.connection.reconnect(generation)
            return
        await asyncio.sleep(self._backoff())

    async def _damaged(self, error: DamagedData) -> None:
        """Quarantined at the node until a peer's copy repairs it: skip it if asked, else report it once and keep
        trying (the repair may come)."""
        state = self.state
        at = self.start.offset if self.start.kind == "offset" else -1
        if self.f.options.skip_corrupt:
            self.f.skipped.append(Skipped(*state.tp, at, error.next_offset, error.message, "damaged"))
            self.start, self.min_offset = Start("offset", error.next_offset), error.next_offset
            return
        if self.reported_damage != at:
            self.reported_damage = at
            await self.f.put(
                state, Chunk([], self.last_next, DamagedData(error.message, error.code, error.next_offset))
            )
        await asyncio.sleep(DAMAGED_RETRY_S)

    async def _past_bad_batch(self, records: list[ConsumerRecord], bad: BadBatch, address: str) -> bool:
        """Hand out the records before a batch that does not decode, then skip it (True: the task goes on after
        it) or report it (False: the task stops; ``poll`` raises after the records)."""
        state, f = self.state, self.f
        topic, partition = state.tp
        if records:
            await f.put(state, Chunk(records, bad.base_offset))  # every record before it first
        if bad.next_offset < 0:  # a CRC failure: its header, so where it ends, cannot be trusted
            await f.put(
                state,
                Chunk(
                    [],
                    self.last_next,
                    CorruptData(
                        f"corrupt batch fetched from {topic}/{partition} at {address}: {bad.error}; "
                        "the node's copy may be damaged, try another site"
                    ),
                ),
            )
            return False
        message = (
            f"invalid batch at {topic}/{partition} offsets {bad.base_offset}..{bad.next_offset - 1}, served "
            f"by {address}: {bad.error}. It was stored before georep validated batches"
        )
        if not f.options.skip_corrupt:
            await f.put(
                state,
                Chunk(
                    [],
                    bad.base_offset,
                    InvalidData(
                        f"{message}; skip it (georep consume --skip-corrupt, Consumer(skip_corrupt=True)) "
                        "or read it at a site that holds a valid copy",
                        None,
                        bad.next_offset,
                    ),
                ),
            )
            return False
        f.skipped.append(Skipped(topic, partition, bad.base_offset, bad.next_offset, message, "invalid"))
        await f.put(state, Chunk([], bad.next_offset))
        return True
