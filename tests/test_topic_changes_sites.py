"""Topic changes across sites, as a Kafka user makes them (issue 23): confluent-kafka's AdminClient alters a
topic's config and adds partitions at site a, and site b, linked both ways, takes both (the topic sync over a
real link, georep/server/topic_changes.py); the new partition's records cross the link like any partition's."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import ClusterSite
from tests.support.cluster_site import status as cluster_status
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.node_api import batch
from tests.support.ports import free_ports
from tests.support.sites import Sites, converged, wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import (  # noqa: E402
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)


def retention_at(admin: AdminClient, topic: str) -> str:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    try:
        return str(admin.describe_configs([resource])[resource].result(10)["retention.ms"].value)
    except confluent_kafka.KafkaException:
        return ""  # not there yet


def partitions_at(admin: AdminClient, topic: str) -> int:
    found = admin.list_topics(topic, timeout=10).topics.get(topic)
    return 0 if found is None or found.error is not None else len(found.partitions)


@pytest.mark.slow
def test_an_alter_and_added_partitions_at_a_reach_b(tmp_path: Path) -> None:
    sites = Sites(tmp_path, ["a", "b"], [("a", "b"), ("b", "a")], extra_args=KAFKA_ARGS)
    try:
        sites.start()
        at_a = AdminClient({"bootstrap.servers": kafka_address(sites.nodes["a"])})
        at_b = AdminClient({"bootstrap.servers": kafka_address(sites.nodes["b"])})
        at_a.create_topics([NewTopic("orders", 1, 1, config={"retention.ms": "60000"})])["orders"].result(15)
        wait_until("b has the topic", lambda: retention_at(at_b, "orders") == "60000")
        change = ConfigResource(
            ConfigResource.Type.TOPIC,
            "orders",
            incremental_configs=[ConfigEntry("retention.ms", "120000", incremental_operation=AlterConfigOpType.SET)],
        )
        at_a.incremental_alter_configs([change])[change].result(15)
        at_a.create_partitions([NewPartitions("orders", 3)])["orders"].result(15)
        assert retention_at(at_a, "orders") == "120000" and partitions_at(at_a, "orders") == 3
        wait_until("b took the alter", lambda: retention_at(at_b, "orders") == "120000")
        wait_until("b took the growth", lambda: partitions_at(at_b, "orders") == 3)
        producer = Producer({"bootstrap.servers": kafka_address(sites.nodes["a"])})
        producer.produce("orders", b"to-a-new-partition", partition=2)
        assert producer.flush(15) == 0
        wait_until("b holds the new partition's record", lambda: converged(sites, ["a", "b"], "orders", 1))
        assert sites.vectors("b", "orders")[2] == sites.vectors("a", "orders")[2] != {}
        status = sites.status("b")
        assert not status.conflicts and status.config_conflicts_total == 0
    finally:
        sites.close()


def _produce(site: ClusterSite, node: int, topic: str, partition: int, value_bytes: int) -> grpc.StatusCode | None:
    with open_channel(site.address(node)) as channel:
        try:
            pbg.NodeStub(channel).Produce(
                pb.ProduceRequest(topic=topic, partition=partition, batch=batch(4, value_bytes=value_bytes)), timeout=10
            )
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return None


@pytest.mark.slow
def test_alter_and_add_partitions_on_a_three_node_site(tmp_path: Path) -> None:
    """On a multi-node site a change is a Raft command: made at any node, the topic's leader takes the new config
    without a restart, and the controller places the added partitions."""
    with ClusterSite(tmp_path, 3).running() as site:
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name="orders", partitions=1), timeout=30)
        leader = site.wait_leader("orders", 0)
        wait_until("the leader takes a batch of 6 KB", lambda: _produce(site, leader, "orders", 0, 1500) is None)
        with open_channel(site.address(leader % 3 + 1)) as channel:  # another node than the leader
            stub = pbg.NodeStub(channel)
            stub.AlterTopic(pb.AlterTopicRequest(name="orders", set={"max.message.bytes": "1024"}), timeout=30)
            grown = stub.AddPartitions(pb.AddPartitionsRequest(name="orders", partitions=2), timeout=30)
        assert grown.partitions == 2 and grown.config["max_batch_bytes"] == "1024"
        wait_until(
            "the leader refuses what the new max.message.bytes does not allow",
            lambda: _produce(site, leader, "orders", 0, 1500) == grpc.StatusCode.INVALID_ARGUMENT,
        )
        second = site.wait_leader("orders", 1)
        wait_until("the added partition takes records", lambda: _produce(site, second, "orders", 1, 10) is None)
        described = site.describe("orders")
        assert described is not None and described.partitions == 2


def _open_ensembles(site: ClusterSite) -> dict[str, list[int]]:
    rows = cluster_status(site).partitions
    return {row.topic: list(row.open_ensemble) for row in rows if row.partition == 0 and row.open_ensemble}


@pytest.mark.slow
def test_a_topics_own_replication_factor_places_its_segments(tmp_path: Path) -> None:
    """Issue 23: per-topic replication_factor (Kafka's CreateTopics, ``georep topic create --replication-factor``)
    on a 3-node site whose own is 3: a topic of 2 opens its segments on two nodes, and is not under-replicated;
    one asking for more nodes than the site has opens on what it has, and status says it is short."""
    with ClusterSite(tmp_path, 3, kafka=True).running() as site:
        b = ("--bootstrap", site.address(1))
        admin = AdminClient({"bootstrap.servers": site.kafka_address(2)})
        admin.create_topics([NewTopic("pairs", 1, 2)])["pairs"].result(30)
        ok(georep("topic", "create", "wide", "--partitions", "1", "--replication-factor", "5", *b))
        ok(georep("topic", "create", "plain", "--partitions", "1", *b))
        lone = georep("topic", "create", "lone", "--partitions", "1", "--replication-factor", "1", *b)
        assert lone.returncode != 0 and b"at least 2" in lone.stderr  # below min.insync.replicas: refused
        wait_until("every topic's first segment is open", lambda: len(_open_ensembles(site)) == 3)
        sizes = {topic: len(members) for topic, members in _open_ensembles(site).items()}
        assert sizes == {"pairs": 2, "wide": 3, "plain": 3}
        short = {(u.topic, u.partition) for u in cluster_status(site).under_replicated}
        assert ("wide", 0) in short and ("pairs", 0) not in short and ("plain", 0) not in short


def _described(address: str, topic: str) -> tuple[int, dict[str, str]]:
    with open_channel(address) as channel:
        try:
            d = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
        except grpc.RpcError:
            return 0, {}
    return d.partitions, dict(d.config)


@pytest.mark.slow
def test_changes_cross_between_a_one_node_site_and_a_three_node_site(tmp_path: Path) -> None:
    """The topic sync merges entries into a multi-node site's Raft metadata and lists its changes onward: an alter
    and a growth made at one-node b reach three-node a, and an alter made at a node of a reaches b."""
    b_port = free_ports(1)[0]
    more = (
        f'[sites.b]\nnodes = ["127.0.0.1:{b_port}"]\n[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\n'
    )
    site_a = ClusterSite(tmp_path, 3, more_toml=more)
    b = NodeProcess("b", tmp_path / "b", listen=f"127.0.0.1:{b_port}", extra_args=["--topology", str(site_a.topology)])
    try:
        site_a.start()
        b.start()
        with open_channel(b.address) as channel:
            stub = pbg.NodeStub(channel)
            stub.CreateTopic(pb.CreateTopicRequest(name="shared", partitions=1), timeout=30)
            wait_until("a has the topic", lambda: _described(site_a.address(3), "shared")[0] == 1)
            stub.AlterTopic(pb.AlterTopicRequest(name="shared", set={"retention.ms": "70000"}), timeout=30)
            stub.AddPartitions(pb.AddPartitionsRequest(name="shared", partitions=2), timeout=30)
        wait_until(
            "a took b's alter and growth",
            lambda: _described(site_a.address(3), "shared") == _described(b.address, "shared") != (1, {}),
        )
        assert _described(site_a.address(3), "shared")[0] == 2
        assert _described(site_a.address(3), "shared")[1]["retention_ms"] == "70000"
        site_a.wait_leader("shared", 1)
        with open_channel(site_a.address(2)) as channel:
            pbg.NodeStub(channel).AlterTopic(
                pb.AlterTopicRequest(name="shared", set={"retention_ms": "80000"}), timeout=30
            )
        wait_until("b took a's alter", lambda: _described(b.address, "shared")[1].get("retention_ms") == "80000")
    finally:
        b.stop()
        site_a.close()
