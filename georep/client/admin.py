"""Topic administration and node health (asyncio)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from georep.client.connection import Connection
from georep.client.errors import InvalidRequest, Operation, from_rpc_error
from georep.proto import georep_pb2
from georep.proto.convert import vector_from_proto
from georep.security.tls import TlsConfig
from offsets.vector import VectorOffset

T = TypeVar("T")

EARLIEST = "earliest"
LATEST = "latest"


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
    partition_states: list[PartitionInfo] = field(default_factory=list)

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
        return cls(message.name, message.partitions, dict(sorted(message.config.items())), states)


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

    async def list_topics(self) -> list[TopicInfo]:
        stub = await self._connection.connect()
        response = await self._call(stub.ListTopics, georep_pb2.ListTopicsRequest())
        return sorted((TopicInfo.from_proto(t) for t in response.topics), key=lambda t: t.name)

    async def describe_topic(self, name: str) -> TopicInfo:
        stub = await self._connection.connect()
        return TopicInfo.from_proto(await self._call(stub.DescribeTopic, georep_pb2.DescribeTopicRequest(name=name)))

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
