"""Kafka's admin APIs as Kafka's own admin clients call them (issue 23), on a one-node site's Kafka listener:
CreateTopics with Kafka's config names (the ones georep takes, and the ones it refuses with INVALID_CONFIG),
DescribeConfigs, DescribeCluster and DescribeLogDirs, with confluent-kafka's AdminClient and kafka-python's
KafkaAdminClient; and ``georep topic create --config`` with Kafka's names."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from georep.server.process import NodeProcess
from tests.support.cli import georep, ok
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, read_frame

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka = pytest.importorskip("kafka")

from confluent_kafka.admin import (  # noqa: E402
    AdminClient,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

INVALID_CONFIG = 40
UNKNOWN_TOPIC_OR_PARTITION = 3
INVALID_PARTITIONS = 37
TAKEN = {
    "retention.ms": "3600000",
    "retention.bytes": "1048576",
    "segment.bytes": "16777216",
    "segment.ms": "600000",
    "max.message.bytes": "2097152",
    "flush.ms": "0",
    "message.timestamp.before.max.ms": "86400000",
    "message.timestamp.after.max.ms": "60000",
    "cleanup.policy": "delete",
    "compression.type": "producer",
    "message.timestamp.type": "CreateTime",
    "min.insync.replicas": "1",
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the module: every test uses its own topics."""
    started = NodeProcess(site="a", data_dir=Path(tmp_path_factory.mktemp("admin")) / "node", extra_args=KAFKA_ARGS)
    started.start()
    yield started
    started.kill9()


@pytest.fixture(scope="module")
def admin(node: NodeProcess) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_address(node)})


def create(admin: AdminClient, topic: NewTopic, validate_only: bool = False) -> object:
    """None, or the KafkaError the create of ``topic`` failed with."""
    try:
        admin.create_topics([topic], validate_only=validate_only)[topic.topic].result(15)
    except confluent_kafka.KafkaException as exc:
        return exc.args[0]
    return None


def topic_configs(admin: AdminClient, name: str) -> dict[str, object]:
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    return dict(admin.describe_configs([resource])[resource].result(15))


def test_create_topics_takes_kafkas_config_names_and_describe_configs_shows_them(admin: AdminClient) -> None:
    assert create(admin, NewTopic("kafka-named", 2, 1, config=TAKEN)) is None
    configs = topic_configs(admin, "kafka-named")
    assert {name: configs[name].value for name in TAKEN} == TAKEN  # type: ignore[attr-defined]
    retention = configs["retention.ms"]
    assert retention.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value  # type: ignore[attr-defined]
    assert configs["cleanup.policy"].source == ConfigSource.DEFAULT_CONFIG.value  # type: ignore[attr-defined]
    # A topic created with no config: every name, at the node's defaults.
    assert create(admin, NewTopic("plain", 1, 1)) is None
    plain = topic_configs(admin, "plain")
    assert plain["retention.ms"].value == "-1"  # type: ignore[attr-defined]
    assert plain["max.message.bytes"].value == str(8 << 20)  # type: ignore[attr-defined]
    assert plain["retention.ms"].source == ConfigSource.DEFAULT_CONFIG.value  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"cleanup.policy": "compact"}, "no log compaction yet"),
        ({"compression.type": "snappy"}, "use producer"),
        ({"message.timestamp.type": "LogAppendTime"}, "use CreateTime"),
        ({"min.insync.replicas": "2"}, "above the topic's replication factor 1"),
        ({"retention.ms": "forever"}, "not an integer"),
        ({"preallocate": "true"}, "no georep counterpart"),
        ({"no.such.config": "1"}, "unknown topic config"),
    ],
)
def test_configs_georep_cannot_take_get_invalid_config(admin: AdminClient, config: dict[str, str], says: str) -> None:
    for validate_only in (True, False):
        name = f"refused-{abs(hash(str(config))) % 10_000}-{validate_only}"
        error = create(admin, NewTopic(name, 1, 1, config=config), validate_only)
        assert error is not None and error.code() == INVALID_CONFIG, error  # type: ignore[attr-defined]
        assert says in error.str(), error.str()  # type: ignore[attr-defined]
        assert name not in admin.list_topics(timeout=10).topics


def test_a_validate_only_create_with_kafka_names_creates_nothing(admin: AdminClient) -> None:
    assert create(admin, NewTopic("only-checked", 1, 1, config={"cleanup.policy": "delete"}), True) is None
    assert "only-checked" not in admin.list_topics(timeout=10).topics


def test_describe_configs_of_an_unknown_topic_and_of_the_broker(admin: AdminClient) -> None:
    unknown = ConfigResource(ConfigResource.Type.TOPIC, "nowhere")
    with pytest.raises(confluent_kafka.KafkaException) as refused:
        admin.describe_configs([unknown])[unknown].result(15)
    assert refused.value.args[0].code() == UNKNOWN_TOPIC_OR_PARTITION
    broker = ConfigResource(ConfigResource.Type.BROKER, "0")
    configs = admin.describe_configs([broker])[broker].result(15)
    assert configs["log.retention.ms"].value == "-1"
    assert configs["min.insync.replicas"].value == "1" and configs["default.replication.factor"].value == "1"


def test_describe_cluster(admin: AdminClient, node: NodeProcess) -> None:
    described = admin.describe_cluster().result(15)
    host, port = kafka_address(node).rsplit(":", 1)
    assert described.cluster_id == "georep-a"
    assert described.controller.id == 0
    assert [(n.id, n.host, n.port) for n in described.nodes] == [(0, host, int(port))]


def test_kafka_python_describes_configs_the_cluster_and_log_dirs(admin: AdminClient, node: NodeProcess) -> None:
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient
    from kafka.admin import NewTopic as KNewTopic

    client = KafkaAdminClient(bootstrap_servers=kafka_address(node))
    try:
        client.create_topics([KNewTopic("kp-named", 1, 1, topic_configs={"segment.bytes": "1048576"})])
        described = client.describe_configs(
            [KConfigResource(ConfigResourceType.TOPIC, "kp-named")], include_synonyms=True, config_filter="all"
        )
        cluster = client.describe_cluster()
        log_dirs = client.describe_log_dirs()
    finally:
        client.close()
    segment = described["topic"]["kp-named"]["segment.bytes"]
    assert segment["value"] == "1048576" and segment["config_source"] == "DYNAMIC_TOPIC_CONFIG"
    assert [s["name"] for s in segment["synonyms"]] == ["segment.bytes", "log.segment.bytes"]
    assert cluster["cluster_id"] == "georep-a" and [b["broker_id"] for b in cluster["brokers"]] == [0]
    (only,) = log_dirs
    (log_dir,) = only["log_dirs"]
    assert Path(log_dir["log_dir"]) == (node.data_dir / "logs").resolve()
    sizes = {(t["name"], p["partition_index"]) for t in log_dir["topics"] for p in t["partitions"]}
    assert ("kp-named", 0) in sizes


def test_the_cli_takes_kafkas_config_names(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    ok(
        georep(
            "topic", "create", "cli-named", "--partitions", "1", "--config", "retention.ms=60000",
            "--config", "segment.bytes=4096", *b,
        )
    )  # fmt: skip
    described = ok(georep("topic", "describe", "cli-named", *b))
    assert "retention_ms=60000" in described and "segment_bytes_max=4096" in described
    refused = georep("topic", "create", "cli-compacted", "--partitions", "1", "--config", "cleanup.policy=compact", *b)
    assert refused.returncode != 0 and "no log compaction yet" in refused.stderr.decode()


def exchange(address: str, request: Any, response_cls: Any) -> Any:
    """One request at its own version on a fresh connection, and its decoded response."""
    request.with_header(correlation_id=1, client_id="raw")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(bytes(request.encode(header=True, framed=True)))
        return response_cls.decode(read_frame(sock), version=request.API_VERSION, header=True)


@pytest.mark.parametrize("version", [0, 1, 2])
def test_describe_cluster_at_every_version_served(node: NodeProcess, version: int) -> None:
    from kafka.protocol import admin as kadmin

    request = kadmin.DescribeClusterRequest(version=version, include_cluster_authorized_operations=False)
    answer = exchange(kafka_address(node), request, kadmin.DescribeClusterResponse)
    host, port = kafka_address(node).rsplit(":", 1)
    assert (answer.error_code, answer.cluster_id, answer.controller_id) == (0, "georep-a", 0)
    assert [(b.broker_id, b.host, b.port) for b in answer.brokers] == [(0, host, int(port))]


def test_alter_configs_incremental_alter_configs_and_create_partitions_change_the_topic(
    admin: AdminClient, node: NodeProcess
) -> None:
    """Each change is made and DescribeConfigs and Metadata show it (before issue 23's topic changes, all three
    answered INVALID_REQUEST)."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, NewPartitions

    assert create(admin, NewTopic("changed", 1, 1, config={"segment.bytes": "1048576"})) is None
    incremental = ConfigResource(
        ConfigResource.Type.TOPIC,
        "changed",
        incremental_configs=[
            ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET),
            ConfigEntry("segment.bytes", None, incremental_operation=AlterConfigOpType.DELETE),
        ],
    )
    admin.incremental_alter_configs([incremental])[incremental].result(15)
    configs = topic_configs(admin, "changed")
    assert configs["retention.ms"].value == "1000" and not configs["retention.ms"].is_read_only  # type: ignore[attr-defined]
    assert configs["segment.bytes"].source == ConfigSource.DEFAULT_CONFIG.value  # type: ignore[attr-defined]
    # AlterConfigs replaces the whole config: retention.ms, left out, goes back to its default.
    whole = ConfigResource(ConfigResource.Type.TOPIC, "changed", set_config={"max.message.bytes": "2097152"})
    with pytest.warns(DeprecationWarning):  # Kafka tools still send AlterConfigs
        admin.alter_configs([whole])[whole].result(15)
    configs = topic_configs(admin, "changed")
    assert configs["max.message.bytes"].value == "2097152" and configs["retention.ms"].value == "-1"  # type: ignore[attr-defined]
    admin.create_partitions([NewPartitions("changed", 3)])["changed"].result(15)
    assert len(admin.list_topics("changed", timeout=10).topics["changed"].partitions) == 3
    described = ok(georep("topic", "describe", "changed", "--bootstrap", node.address))
    assert "Partitions: 3" in described and "max_batch_bytes=2097152" in described


def test_topic_changes_georep_cannot_make_are_refused_with_the_reason(admin: AdminClient) -> None:
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, NewPartitions

    assert create(admin, NewTopic("kept", 2, 1)) is None
    compact = ConfigResource(
        ConfigResource.Type.TOPIC,
        "kept",
        incremental_configs=[ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)],
    )
    with pytest.raises(confluent_kafka.KafkaException) as refused:
        admin.incremental_alter_configs([compact])[compact].result(15)
    assert refused.value.args[0].code() == INVALID_CONFIG and "no log compaction" in refused.value.args[0].str()
    with pytest.raises(confluent_kafka.KafkaException) as fewer:
        admin.create_partitions([NewPartitions("kept", 1)])["kept"].result(15)
    assert fewer.value.args[0].code() == INVALID_PARTITIONS and "only grows" in fewer.value.args[0].str()
    unknown = ConfigResource(ConfigResource.Type.TOPIC, "nowhere", set_config={"retention.ms": "1"})
    with pytest.raises(confluent_kafka.KafkaException) as missing, pytest.warns(DeprecationWarning):
        admin.alter_configs([unknown])[unknown].result(15)
    assert missing.value.args[0].code() == UNKNOWN_TOPIC_OR_PARTITION


def test_the_cli_alters_and_grows_a_topic(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    ok(georep("topic", "create", "cli-changed", "--partitions", "1", "--config", "retention.ms=60000", *b))
    ok(georep("topic", "alter", "cli-changed", "--config", "segment.bytes=4096", "--delete-config", "retention.ms", *b))
    ok(georep("topic", "add-partitions", "--topic", "cli-changed", "--partitions", "2", *b))
    described = ok(georep("topic", "describe", "cli-changed", *b))
    assert "Partitions: 2" in described and "segment_bytes_max=4096" in described and "retention_ms=-1" in described
    fewer = georep("topic", "add-partitions", "cli-changed", "--partitions", "1", *b)
    assert fewer.returncode != 0 and "the count only grows" in fewer.stderr.decode()
    compact = georep("topic", "alter", "cli-changed", "--config", "cleanup.policy=compact", *b)
    assert compact.returncode != 0 and "no log compaction yet" in compact.stderr.decode()


def test_min_insync_replicas_is_the_topics_own_and_held_to_its_replication_factor(
    admin: AdminClient, node: NodeProcess
) -> None:
    """Issue 23: Kafka's min.insync.replicas is the topic's min_insync_replicas, created, described and altered as
    Kafka's tools do, and never above the topic's replication factor (before, any value but the site's was refused
    and every topic showed the site's). A one-node site takes it with the topic's own factor, which the multi-node
    sites the topic reaches apply."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry

    config = {"min.insync.replicas": "2", "replication_factor": "3"}
    assert create(admin, NewTopic("insync", 1, 1, config=config)) is None
    shown = topic_configs(admin, "insync")["min.insync.replicas"]
    assert (shown.value, shown.source) == ("2", ConfigSource.DYNAMIC_TOPIC_CONFIG.value)  # type: ignore[attr-defined]

    def alter(name: str, value: str) -> object:
        entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        resource = ConfigResource(ConfigResource.Type.TOPIC, "insync", incremental_configs=[entry])
        try:
            admin.incremental_alter_configs([resource])[resource].result(15)
        except confluent_kafka.KafkaException as exc:
            return exc.args[0]
        return None

    over = alter("min.insync.replicas", "4")
    assert over is not None and over.code() == INVALID_CONFIG and "of 1 to 3" in over.str()  # type: ignore[attr-defined]
    lowered = alter("replication_factor", "1")  # below the topic's quorum: refused, not silently raised
    assert lowered is not None and "a replication factor of at least 2" in lowered.str()  # type: ignore[attr-defined]
    assert alter("min.insync.replicas", "3") is None
    assert topic_configs(admin, "insync")["min.insync.replicas"].value == "3"  # type: ignore[attr-defined]
    cli = georep("topic", "alter", "insync", "--config", "min_insync_replicas=5", "--bootstrap", node.address)
    assert cli.returncode != 0 and "ask for min.insync.replicas of 1 to 3" in cli.stderr.decode()
