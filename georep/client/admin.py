"""Topic administration and node health (asyncio)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from georep.client.connection import Connection
from georep.client.errors import GeorepError, InvalidRequest, Operation, code_of, from_rpc_error, from_status
from georep.proto import georep_pb2
from georep.proto.convert import vector_from_proto
from georep.security.tls import TlsConfig
from offsets.vector import VectorOffset

T = TypeVar("T")

EARLIEST = "earliest"
LATEST = "latest"

# What a listing carries of each topic (ListTopicsRequest.view): "summary" (the definition, plus the records and
# bytes of the partitions the node serves), "definition" (name, partitions, configuration), "full" (as
# describe_topic: every partition's state, vector included).
TopicView = Literal["summary", "definition", "full"]
_VIEWS: dict[str, georep_pb2.TopicView.ValueType] = {
    "summary": georep_pb2.TOPIC_VIEW_SUMMARY,
    "definition": georep_pb2.TOPIC_VIEW_DEFINITION,
    "full": georep_pb2.TOPIC_VIEW_FULL,
}
LIST_PAGE_SIZE = 1_000  # topics per ListTopics call of list_topics
CREATE_TOPICS_PER_CALL = 100  # topics per CreateTopics call of create_topics (a node takes up to 1,000): each
# call well inside the default request timeout even where every partition costs fsyncs on a busy disk


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    partition: int
    log_start_offset: int
    log_end_offset: int
    size_bytes: int
    segments: int
    vector: VectorOffset
    # Quarantined batches, each "offsets A..B (origin O seqs X..Y): reason": served to no one until repaired.
    damaged: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    partition_states: list[PartitionInfo] = field(default_factory=list)  # the "full" view only
    # The "summary" view: summed over the partitions the node answering serves (on a multi-node site, those it
    # leads). Records: log end offset minus log start offset.
    records: int = 0
    size_bytes: int = 0

    @classmethod
    def from_proto(cls, message: georep_pb2.TopicDescription) -> TopicInfo:
        states = [
            PartitionInfo(
                p.partition,
                p.log_start_offset,
                p.log_end_offset,
                p.size_bytes,
                p.segments,
                vector_from_proto(p.vector),
                tuple(damaged_text(d) for d in p.damaged),
            )
            for p in message.partition_states
        ]
        states.sort(key=lambda p: p.partition)
        config = dict(sorted(message.config.items()))
        return cls(message.name, message.partitions, config, states, message.records, message.size_bytes)


@dataclass(frozen=True, slots=True)
class NewTopic:
    """A topic for :meth:`Admin.create_topics` (Kafka's ``NewTopic``)."""

    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TopicCreated:
    """One topic's answer to :meth:`Admin.create_topics`: ``error`` is None when it was created."""

    name: str
    partitions: int
    error: GeorepError | None = None


@dataclass(frozen=True, slots=True)
class TopicPage:
    """A page of :meth:`Admin.list_topics_page`: pass ``next_page_token`` for the next ("" after the last)."""

    topics: list[TopicInfo]
    next_page_token: str
    total_topics: int  # at the node, every page together (internal topics included)


def damaged_text(d: georep_pb2.DamagedRange) -> str:
    return (
        f"offsets {d.base_offset}..{d.next_offset - 1} (origin {d.origin} seqs {d.base_origin_seq}.."
        f"{d.last_origin_seq}): {d.reason}"
    )


@dataclass(frozen=True, slots=True)
class PartitionOffset:
    partition: int
    offset: int  # -1 when no record has a timestamp that late
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class Health:
    status: str
    site: str
    epoch: int
    version: str
    uptime_ms: int
    disk_full: bool


def offset_spec(spec: str | int) -> dict[str, Any]:
    """``"earliest"``, ``"latest"`` or a timestamp in ms as ``ListOffsetsRequest`` fields."""
    if spec == EARLIEST:
        return {"position": georep_pb2.START_EARLIEST}
    if spec == LATEST:
        return {"position": georep_pb2.START_LATEST}
    if isinstance(spec, int) and not isinstance(spec, bool):
        return {"timestamp_ms": spec}
    raise InvalidRequest(f"invalid offset spec {spec!r}: use 'earliest', 'latest' or a timestamp in ms")


class Admin:
    """``async with Admin("127.0.0.1:7101") as admin: await admin.create_topic("t", 3)``."""

    def __init__(
        self,
        bootstrap: str | list[str],
        request_timeout_ms: int = 30_000,
        connect_timeout_ms: int = 5_000,
        tls: TlsConfig | None = None,
    ) -> None:
        self._connection = Connection(bootstrap, connect_timeout_ms, tls)
        self._timeout_s = request_timeout_ms / 1000

    async def start(self) -> Admin:
        await self._connection.connect()
        return self

    async def close(self) -> None:
        await self._connection.close()

    async def __aenter__(self) -> Admin:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, rpc: Callable[..., Awaitable[T]], request: Any) -> T:
        await self._connection.connect()
        try:
            return await self._connection.unary(rpc(request, timeout=self._timeout_s))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self._connection.address, operation=Operation.ADMIN) from None

    async def create_topic(self, name: str, partitions: int, config: dict[str, str] | None = None) -> TopicInfo:
        stub = await self._connection.connect()
        request = georep_pb2.CreateTopicRequest(name=name, partitions=partitions, config=config or {})
        return TopicInfo.from_proto(await self._call(stub.CreateTopic, request))

    async def create_topics(self, topics: Sequence[NewTopic]) -> list[TopicCreated]:
        """Create every topic of ``topics``, each on its own (Kafka's CreateTopics): one answer per topic, in
        their order, with the error that refused it if any. Far faster than one ``create_topic`` each: a node
        writes its topic table once per call. Raises only what fails the calls themselves."""
        stub = await self._connection.connect()
        out: list[TopicCreated] = []
        for i in range(0, len(topics), CREATE_TOPICS_PER_CALL):
            request = georep_pb2.CreateTopicsRequest(
                topics=[
                    georep_pb2.CreateTopicRequest(name=t.name, partitions=t.partitions, config=t.config)
                    for t in topics[i : i + CREATE_TOPICS_PER_CALL]
                ]
            )
            response = await self._call(stub.CreateTopics, request)
            for r in response.results:
                error = None
                if r.HasField("error"):
                    e = r.error
                    error = from_status(Operation.ADMIN, code_of(e.code), e.message, e.reason, self._connection.address)
                out.append(TopicCreated(r.name, r.partitions, error))
        return out

    async def list_topics_page(
        self, page_size: int = LIST_PAGE_SIZE, page_token: str = "", view: TopicView = "summary"
    ) -> TopicPage:
        """One page of the node's topics, by name: at most ``page_size`` (the node caps it), after
        ``page_token`` (a previous page's ``next_page_token``; "": from the first)."""
        if page_size <= 0:
            raise InvalidRequest(f"page_size {page_size}: ask for at least one topic per page")
        if view not in _VIEWS:
            raise InvalidRequest(f"unknown topic view {view!r}: use one of {', '.join(_VIEWS)}")
        stub = await self._connection.connect()
        request = georep_pb2.ListTopicsRequest(page_size=page_size, page_token=page_token, view=_VIEWS[view])
        response = await self._call(stub.ListTopics, request)
        topics = [TopicInfo.from_proto(t) for t in response.topics]
        return TopicPage(topics, response.next_page_token, response.total_size)

    async def list_topics(self, view: TopicView = "summary", page_size: int = LIST_PAGE_SIZE) -> list[TopicInfo]:
        """Every topic of the node, by name, fetched a page at a time. ``view``: how much of each (the default
        leaves out the partitions' states; ``"full"`` has them, as :meth:`describe_topic`)."""
        out: list[TopicInfo] = []
        token = ""
        while True:
            page = await self.list_topics_page(page_size, token, view)
            out += page.topics
            if not page.next_page_token:
                return out
            if page.next_page_token == token:  # the same page again would never end: stop rather than loop
                return out
            token = page.next_page_token

    async def describe_topic(self, name: str) -> TopicInfo:
        stub = await self._connection.connect()
        return TopicInfo.from_proto(await self._call(stub.DescribeTopic, georep_pb2.DescribeTopicRequest(name=name)))

    async def alter_topic(
        self, name: str, config: Mapping[str, str], reset: Sequence[str] = (), *, validate_only: bool = False
    ) -> TopicInfo:
        """Set each of ``config`` (Kafka's names or georep's keys) and reset each of ``reset`` to the node's
        default; the change replicates to every site the topic's links reach, last writer winning."""
        stub = await self._connection.connect()
        request = georep_pb2.AlterTopicRequest(
            name=name, set=dict(config), reset=list(reset), validate_only=validate_only
        )
        return TopicInfo.from_proto(await self._call(stub.AlterTopic, request))

    async def add_partitions(self, name: str, partitions: int, *, validate_only: bool = False) -> TopicInfo:
        """Grow ``name`` to ``partitions`` in all (more than it has); every site converges to the largest count."""
        stub = await self._connection.connect()
        request = georep_pb2.AddPartitionsRequest(name=name, partitions=partitions, validate_only=validate_only)
        return TopicInfo.from_proto(await self._call(stub.AddPartitions, request))

    async def delete_topic(self, name: str, *, validate_only: bool = False) -> int:
        """Delete ``name`` at every site its links reach; the incarnation deleted. A topic created again after it
        starts empty (docs/operations.md, "Deleting a topic")."""
        stub = await self._connection.connect()
        request = georep_pb2.DeleteTopicRequest(name=name, validate_only=validate_only)
        return int((await self._call(stub.DeleteTopic, request)).incarnation)

    async def list_offsets(self, topic: str, partition: int = -1, spec: str | int = LATEST) -> list[PartitionOffset]:
        """Offsets per partition: ``spec`` is ``"earliest"``, ``"latest"`` or a timestamp (ms)."""
        stub = await self._connection.connect()
        request = georep_pb2.ListOffsetsRequest(topic=topic, partition=partition, **offset_spec(spec))
        response = await self._call(stub.ListOffsets, request)
        offsets = [PartitionOffset(o.partition, o.offset, o.timestamp_ms) for o in response.offsets]
        return sorted(offsets, key=lambda o: o.partition)

    async def health(self) -> Health:
        stub = await self._connection.connect()
        r = await self._call(stub.Health, georep_pb2.HealthRequest())
        return Health(r.status, r.site, r.epoch, r.version, r.uptime_ms, r.disk_full)
