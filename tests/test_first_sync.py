"""A data dir creates topics only once it has synced its topic catalog with each upstream (issue 23,
``georep/server/first_sync.py``): site b, fresh, linked from site a which deleted ``orders``, refuses a create
until its first sync, then creates the next incarnation, not the deleted one again; after a restart it creates at
once even with a unreachable.

Site b runs in this process (its ``Replicator`` and ``NodeService``), a is a real node."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from georep.broker.errors import CatalogNotSynced
from georep.kafka import errors as k
from georep.kafka.gateway import Client, KafkaGateway
from georep.kafka.protocol import Request
from georep.metadata.store import SiteIdentity
from georep.proto import georep_pb2 as pb
from georep.server import first_sync
from georep.server.broker import Broker
from georep.server.groups import GroupService
from georep.server.metrics import NodeMetrics
from georep.server.process import NodeProcess
from georep.server.replicator import Replicator
from georep.server.service import NodeService
from tests.support.node_api import stub_for
from tests.support.ports import free_ports
from tests.support.sites import topology_toml
from topology.file import parse_topology_file
from topology.ids import SiteId


def site_b(data_dir: Path, port_a: int) -> tuple[Replicator, NodeService]:
    (port_b,) = free_ports(1)
    text = topology_toml({"a": port_a, "b": port_b}, [("a", "b")])
    topology = parse_topology_file("topology.toml", text.encode())
    broker = Broker(data_dir, SiteIdentity(SiteId("b"), 1))
    replicator = Replicator(broker, topology, "b", stall_ms=1000)
    return replicator, NodeService(broker, NodeMetrics(broker), replicator)


def create(name: str) -> bytes:
    return pb.CreateTopicRequest(name=name, partitions=1).SerializeToString()


def creates(*names: str) -> bytes:
    return pb.CreateTopicsRequest(
        topics=[pb.CreateTopicRequest(name=n, partitions=1) for n in names]
    ).SerializeToString()


async def kafka_create(service: NodeService, name: str) -> Any:
    """Kafka's CreateTopics at b's gateway, sharing b's topic calls as the node wires them."""
    broker = service.broker

    async def create_topic(name: str, partitions: int, config: dict[str, str]) -> None:
        broker.create_topic(name, partitions, config)

    gateway = KafkaGateway(broker, GroupService(broker), "127.0.0.1", 9092, create_topic)
    gateway.topic_calls = service.topic_calls
    topic = SimpleNamespace(name=name, num_partitions=1, replication_factor=-1, configs=[])
    answer = await gateway._create_topics(
        Request(19, 5, 1, "c", SimpleNamespace(validate_only=False, topics=[topic])), Client("127.0.0.1")
    )
    return answer.topics[0]


def test_a_fresh_site_creates_only_after_its_first_sync_and_never_the_deleted_incarnation(
    tmp_path: Path, node: NodeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel, stub_a = stub_for(node)
    stub_a.CreateTopic(pb.CreateTopicRequest(name="orders", partitions=1))
    stub_a.DeleteTopic(pb.DeleteTopicRequest(name="orders"))
    port_a = int(node.address.rsplit(":", 1)[1])
    monkeypatch.setattr(first_sync, "CREATE_WAIT_S", 0.2)

    async def first_start() -> None:
        replicator, service = site_b(tmp_path / "b", port_a)
        try:
            # Not synced yet (its links not started): both calls refused, naming a, and nothing created.
            with pytest.raises(CatalogNotSynced, match="topic catalog not yet synced with upstream a"):
                await service.create_topic(create("orders"), None)  # type: ignore[arg-type]
            answer = await service.create_topics(creates("orders", "events"), None)  # type: ignore[arg-type]
            assert [r.error.code for r in answer.results] == [14] * 2  # UNAVAILABLE
            assert "synced with upstream a" in answer.results[0].error.message
            kafka = await kafka_create(service, "orders")
            assert kafka.error_code == k.REQUEST_TIMED_OUT and "synced with upstream a" in kafka.error_message
            assert not {"orders", "events"} & set(replicator.broker.metadata.topics())
            # Its links start: a create waits for the first sync, then makes the name's next incarnation.
            monkeypatch.setattr(first_sync, "CREATE_WAIT_S", 30.0)
            replicator.start()
            await service.create_topic(create("orders"), None)  # type: ignore[arg-type]
            assert replicator.broker.topic("orders").incarnation == 1
        finally:
            await replicator.stop()
            replicator.broker.close()

    async def restarted() -> None:
        (dead,) = free_ports(1)  # a unreachable now: the sync recorded before is enough
        replicator, service = site_b(tmp_path / "b", dead)
        try:
            await service.create_topic(create("events"), None)  # type: ignore[arg-type]
            assert replicator.broker.topic("events").incarnation == 0
        finally:
            await replicator.stop()
            replicator.broker.close()

    try:
        asyncio.run(first_start())
        monkeypatch.setattr(first_sync, "CREATE_WAIT_S", 0.2)
        asyncio.run(restarted())
    finally:
        channel.close()


def test_a_site_with_no_upstream_and_a_data_dir_from_before_create_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / "topics.json").write_text("{}")  # a data dir from before the record: it ran with a
        lone = first_sync.FirstSyncs(tmp_path / "lone", [])
        await lone.wait(0)
        old = first_sync.FirstSyncs(tmp_path / "old", ["a"])
        await old.wait(0)
        fresh = first_sync.FirstSyncs(tmp_path / "fresh", ["a"])
        with pytest.raises(CatalogNotSynced, match="upstream a"):
            await fresh.wait(0)

    (tmp_path / "lone").mkdir()
    (tmp_path / "fresh").mkdir()
    asyncio.run(scenario())
