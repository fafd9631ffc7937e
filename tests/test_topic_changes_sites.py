"""Topic changes across sites, as a Kafka user makes them (issue 23): confluent-kafka's AdminClient alters a
topic's config and adds partitions at site a, and site b, linked both ways, takes both (the topic sync over a
real link, georep/server/topic_changes.py); the new partition's records cross the link like any partition's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
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
