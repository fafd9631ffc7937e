"""The asyncio consumer, split as aiokafka splits its own: the subscription state (``subscription.py``: what it
reads, where each partition starts, positions and vectors), the fetcher (``fetcher.py``: one ``Fetch`` stream per
assigned partition, decoded in the client by ``fetched.py``, follower reads) and the coordinator
(``coordinator.py``: the group membership, assignments and commits). :class:`Consumer` is the public face that
ties them.

``position(tp)`` is the next local offset ``poll`` will return from; it is None until known (after
``seek_to_beginning``/``seek_to_end``/``seek_to_vector`` it becomes known with the first answer). ``vector(tp)`` is
the vector offset of everything consumed: the start vector plus, per origin, the origin seq after the last record
returned. Hand it to a consumer at another site (``seek_to_vector``) to continue there with no loss and no
duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

import grpc

from georep.client.connection import Connection
from georep.client.coordinator import Committed, Coordinator, GroupOptions, check_group
from georep.client.errors import GeorepError, InvalidRequest, Operation, from_rpc_error
from georep.client.fetched import BadBatch, ConsumerRecord, Decoded, decode_fetched, decode_response
from georep.client.fetcher import READ_FROM, Fetcher, FetchOptions, Skipped
from georep.client.producer import parse_acks
from georep.client.subscription import OFFSET_RESETS, Start, SubscriptionState, TopicPartition
from georep.proto import georep_pb2
from georep.security.tls import TlsConfig
from offsets.vector import VectorOffset
from topology.filters import InvalidTopicFilter, TopicFilter

__all__ = [
    "BadBatch",
    "Consumer",
    "ConsumerRecord",
    "Decoded",
    "Skipped",
    "TopicPartition",
    "decode_fetched",
    "decode_response",
]


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
        metadata_max_age_ms: int = 5_000,
    ) -> None:
        if auto_offset_reset not in OFFSET_RESETS:
            raise InvalidRequest(f"invalid auto_offset_reset {auto_offset_reset!r}: use earliest, latest or none")
        if read_from not in READ_FROM:
            raise InvalidRequest(
                f"invalid read_from {read_from!r}: use 'leader' (each partition at its leader) or "
                "'follower' (at the preferred node, which may follow the partition)"
            )
        if prefer is not None and read_from != "follower":
            raise InvalidRequest("prefer names the node follower reads go to: give it with read_from='follower'")
        self._group: Coordinator | None = None
        self._group_id = group_id
        self._group_options = GroupOptions(
            session_timeout_ms=session_timeout_ms,
            assignor=assignor,
            client_id=client_id,
            enable_auto_commit=enable_auto_commit,
            auto_commit_interval_ms=auto_commit_interval_ms,
            commit_acks=parse_acks(commit_acks),
            commit_wait_caught_up_ms=commit_wait_caught_up_ms,
        )
        self._connection = Connection(bootstrap, connect_timeout_ms, tls)
        self._request_timeout_s = request_timeout_ms / 1000
        self._subscription = SubscriptionState(auto_offset_reset, queued_responses_max, metadata_max_age_ms / 1000)
        options = FetchOptions(
            max_bytes,
            max_wait_ms,
            retry_backoff_ms,
            max(retry_backoff_max_ms, retry_backoff_ms),
            self._request_timeout_s,
            connect_timeout_ms,
            read_from,
            skip_corrupt,
        )
        # read_from="follower": the node every partition is fetched at first (None: the bootstrap connection's).
        preferred = Connection(prefer, connect_timeout_ms, tls) if prefer is not None else None
        self._fetcher = Fetcher(self._subscription, self._connection, options, preferred, tls)
        self._closed = False

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
            await self._group.close()
        self._closed = True
        await self._fetcher.close()
        await self._connection.close()

    # --- what it reads and where ----------------------------------------------------

    @property
    def follower_reads(self) -> int:
        """Fetch responses with records that a node not leading the partition served (read_from="follower")."""
        return self._fetcher.follower_reads

    @property
    def skipped(self) -> list[Skipped]:
        """With skip_corrupt: what was skipped, and why."""
        return self._fetcher.skipped

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any earlier assignment or subscription)."""
        self._subscription.assign(partitions)

    def subscribe(self, topics: Iterable[str] = (), group: str | None = None, pattern: str | None = None) -> None:
        """Read the topics, or every topic ``pattern`` matches (``orders/eu/**``: existing ones, and new ones within
        ``metadata_max_age_ms``): with a group (here or ``group_id=``), the partitions the group's coordinator
        assigns to this member; without one, every partition."""
        if self._group is not None:
            raise InvalidRequest("this consumer already joined a group: close it and create another to resubscribe")
        topics = list(topics)
        if (pattern is None) == (not topics):
            raise InvalidRequest("subscribe to topics or to a pattern (pattern='orders/**'), not both and not neither")
        try:
            self._subscription.subscribe(topics, None if pattern is None else TopicFilter(pattern))
        except InvalidTopicFilter as exc:
            raise InvalidRequest(str(exc)) from None
        if group is not None:
            self._group_id = group

    @property
    def site_origin(self) -> str:
        """``site@epoch`` of the node this consumer reads from now ("" before connecting)."""
        return self._connection.origin

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._subscription.states)

    def describe(self) -> str:
        """One line on where this consumer is: its site, its group membership, each partition's fetch."""
        parts = [f"at {self._connection.origin or self._connection.address or 'no site'}"]
        g = self._group
        if g is not None:
            parts.append(
                f"group {g.group} member {g.member_id or '-'} generation {g.generation} at {g.site or '-'}"
                + (f" (last error: {g.error.message})" if g.error is not None else "")
            )
        for tp, s in sorted(self._subscription.states.items()):
            fetch = "no fetch" if s.fetcher is None else "fetch ended" if s.fetcher.done() else "fetching"
            parts.append(f"{tp[0]}/{tp[1]} position {s.position} from {s.served_by or '-'}, {fetch}")
        return ", ".join(parts)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Continue ``tp`` from local ``offset`` (the batch holding it is fetched, earlier records dropped)."""
        self._subscription.restart(tp, Start("offset", int(offset)))

    def seek_to_beginning(self, tps: Iterable[TopicPartition] | None = None) -> None:
        self._subscription.seek_all(tps, Start("earliest"))

    def seek_to_end(self, tps: Iterable[TopicPartition] | None = None) -> None:
        self._subscription.seek_all(tps, Start("latest"))

    def seek_to_vector(self, tp: TopicPartition, vector: VectorOffset) -> None:
        """Continue ``tp`` with exactly the records ``vector`` does not cover, at this or any site."""
        self._subscription.restart(tp, Start("vector", -1, vector))

    def position(self, tp: TopicPartition) -> int | None:
        """The next local offset to be returned for ``tp``; None until known."""
        return self._subscription.states[tp].position

    def vector(self, tp: TopicPartition) -> VectorOffset:
        """The vector offset of everything consumed from ``tp``."""
        return self._subscription.states[tp].vector()

    # --- groups and commits -------------------------------------------------------

    async def commit(self, offsets: dict[TopicPartition, VectorOffset] | None = None) -> None:
        """Commit the group's position: by default the vector of everything ``poll`` returned,
        for every assigned partition. Waits for the ack level of ``commit_acks``."""
        await self._membership().commit_consumed(offsets, member=bool(self._subscription.subscribed))

    def commit_async(self, offsets: dict[TopicPartition, VectorOffset] | None = None) -> asyncio.Task[None]:
        """``commit`` in the background; await the task for its outcome."""
        return asyncio.create_task(self.commit(offsets), name="georep-commit")

    async def committed(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, Committed]:
        """The group's committed positions for ``tps``, as the connected site holds them."""
        await self._connection.connect()
        return await self._membership().fetch_committed([(str(t), int(p)) for t, p in tps])

    def _membership(self) -> Coordinator:
        if self._group is None:
            group = check_group(self._group_id)
            self._group = Coordinator(
                self._connection, self._subscription, self._fetcher, group, self._group_options, self._request_timeout_s
            )
        return self._group

    # --- reading ---------------------------------------------------------------

    async def _ensure_started(self) -> None:
        if self._closed:
            raise GeorepError("poll() on a closed consumer")
        await self._connection.connect()
        subscription = self._subscription
        pattern = subscription.pattern
        if pattern is not None and pattern.due() and await pattern.refresh(self._connection, self._request_timeout_s):
            subscription.matched(pattern.topics, in_group=bool(self._group_id))
        if subscription.subscribed and self._group_id:
            group = self._membership()
            if not group.started:
                await group.start()
            if group.error is not None:
                error, group.error = group.error, None
                raise error
            group.maybe_auto_commit()
        else:
            for topic in subscription.subscribed:
                if topic not in subscription.resolved_topics:
                    for partition in range(await self._partitions(topic)):
                        subscription.add((topic, partition))
                    subscription.resolved_topics.add(topic)
        self._fetcher.start()

    async def _partitions(self, topic: str) -> int:
        try:
            description = await self._connection.unary(
                self._connection.stub.DescribeTopic(
                    georep_pb2.DescribeTopicRequest(name=topic), timeout=self._request_timeout_s
                )
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self._connection.address, operation=Operation.FETCH) from None
        return int(description.partitions)

    async def poll(self, timeout_ms: float = 1000, max_records: int = 500) -> list[ConsumerRecord]:
        """Up to ``max_records`` records, waiting at most ``timeout_ms`` for the first one."""
        await self._ensure_started()
        deadline = time.monotonic() + timeout_ms / 1000
        data = self._fetcher.data
        while True:
            data.clear()
            # A group member no coordinator answered for a session takes nothing: its partitions may be others' now.
            out = [] if self._group is not None and self._group.lapsed else self._fetcher.take(max_records)
            if out:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await data.wait()

    async def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        while True:
            for record in await self.poll(timeout_ms=self._fetcher.options.max_wait_ms):
                yield record
