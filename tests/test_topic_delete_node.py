"""Topic delete on a one-node site's node process (issue 23): Kafka's DeleteTopics from confluent-kafka's
AdminClient, ``georep topic delete``, and what a client sees after it; the topic created again starts empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from georep.server.process import NodeProcess
from tests.support.cli import georep, ok
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.sites import Sites, converged, wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

pytestmark = pytest.mark.slow  # a node process


def partition_dirs(node: NodeProcess, topic: str) -> list[str]:
    return sorted(d.name for d in (node.data_dir / "logs").iterdir() if d.name.startswith(f"{topic}-"))


def produce(address: str, topic: str, n: int) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": address})
    for i in range(n):
        producer.produce(topic, f"old-{i}".encode(), partition=i % 2)
    assert producer.flush(15) == 0


def test_kafka_delete_topics_and_the_cli_delete_a_topic_and_a_re_created_one_starts_empty(tmp_path: Path) -> None:
    node = NodeProcess(site="a", data_dir=tmp_path / "node", extra_args=KAFKA_ARGS)
    node.start()
    try:
        address, b = kafka_address(node), ("--bootstrap", node.address)
        admin = AdminClient({"bootstrap.servers": address})
        admin.create_topics([NewTopic("gone", 2, 1)])["gone"].result(15)
        produce(address, "gone", 6)
        admin.delete_topics(["gone"])["gone"].result(15)  # before: TOPIC_DELETION_DISABLED
        assert "gone" not in admin.list_topics(timeout=10).topics
        described = georep("topic", "describe", "gone", *b)
        assert described.returncode != 0 and "was deleted (at site a)" in described.stderr.decode()
        wait_until("the partitions of 'gone' are removed", lambda: not partition_dirs(node, "gone"))
        with pytest.raises(confluent_kafka.KafkaException) as again:
            admin.delete_topics(["gone"])["gone"].result(15)
        assert again.value.args[0].code() == 3  # UNKNOWN_TOPIC_OR_PARTITION
        # Created again: incarnation 1, in its own directories, with none of the old records.
        ok(georep("topic", "create", "gone", "--partitions", "2", *b))
        assert partition_dirs(node, "gone") == [] and (node.data_dir / "logs" / "gone@1-0").is_dir()
        consumer = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "g"})
        try:
            marks = [consumer.get_watermark_offsets(confluent_kafka.TopicPartition("gone", i), 10) for i in (0, 1)]
        finally:
            consumer.close()
        assert marks == [(0, 0), (0, 0)]
        # The CLI: a check first, then the delete.
        ok(georep("topic", "create", "cli-gone", "--partitions", "1", *b))
        assert "can be deleted" in ok(georep("topic", "delete", "cli-gone", "--validate-only", *b))
        assert "deleted topic 'cli-gone' (incarnation 0)" in ok(georep("topic", "delete", "cli-gone", *b))
        internal = georep("topic", "delete", "__georep_offsets", *b)
        assert internal.returncode != 0 and "cannot be deleted" in internal.stderr.decode()
    finally:
        node.kill9()


def deleted(admin: AdminClient, topic: str) -> bool:
    """Ask for the delete: True once made; False while the node waits for its linked sites to announce that they
    check incarnations (TOPIC_DELETION_DISABLED: they have not answered a Health round yet)."""
    try:
        admin.delete_topics([topic])[topic].result(15)
    except confluent_kafka.KafkaException as exc:
        assert exc.args[0].code() == 73, exc  # TOPIC_DELETION_DISABLED, with the reason
        return False
    return True


def marks(address: str, topic: str) -> list[tuple[int, int]]:
    consumer = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "marks"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return [consumer.get_watermark_offsets(confluent_kafka.TopicPartition(topic, i), 10) for i in sorted(parts)]
    finally:
        consumer.close()


def test_a_delete_at_a_reaches_b_and_c_and_the_topic_created_again_holds_no_old_record(tmp_path: Path) -> None:
    """The issue's test: confluent-kafka's AdminClient deletes a topic at a, b and c (linked both ways with a)
    see it gone, and the topic created again at a holds, at every site, only what was produced after."""
    sites = Sites(tmp_path, ["a", "b", "c"], [("a", "b"), ("b", "a"), ("a", "c"), ("c", "a")], extra_args=KAFKA_ARGS)
    try:
        sites.start()
        address = {name: kafka_address(node) for name, node in sites.nodes.items()}
        admins = {name: AdminClient({"bootstrap.servers": a}) for name, a in address.items()}
        admins["a"].create_topics([NewTopic("orders", 2, 1)])["orders"].result(15)
        produce(address["a"], "orders", 6)
        wait_until("b and c hold the 6 records", lambda: converged(sites, ["a", "b", "c"], "orders", 6))
        wait_until("a deletes the topic", lambda: deleted(admins["a"], "orders"))
        for name in ("b", "c"):
            admin, node = admins[name], sites.nodes[name]
            wait_until(f"{name} no longer has the topic", lambda: "orders" not in admin.list_topics().topics)  # noqa: B023
            wait_until(f"{name} removed its files", lambda: not partition_dirs(node, "orders"))  # noqa: B023
        admins["a"].create_topics([NewTopic("orders", 2, 1)])["orders"].result(15)
        producer = confluent_kafka.Producer({"bootstrap.servers": address["a"]})
        producer.produce("orders", b"new", partition=0)
        assert producer.flush(15) == 0
        wait_until("b and c hold the new record", lambda: converged(sites, ["a", "b", "c"], "orders", 1))
        for name in ("a", "b", "c"):
            assert marks(address[name], "orders") == [(0, 1), (0, 0)], name
            assert (sites.nodes[name].data_dir / "logs" / "orders@1-0").is_dir()
    finally:
        sites.close()
