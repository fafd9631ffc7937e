"""Kafka's topic config names mapped onto georep's keys (``georep/metadata/kafka_config.py``): what a create takes,
what it refuses and why, and how a topic's configs are described back with Kafka's names."""

from __future__ import annotations

import pytest

from georep.metadata.kafka_config import (
    FLUSH_MS_MAX,
    KAFKA_NAMES,
    ConfigSource,
    InvalidConfig,
    InvalidReplicationFactor,
    SiteSettings,
    broker_configs,
    describe,
    to_georep,
)
from georep.metadata.topics import TOPIC_CONFIG_KEYS

ONE_NODE = SiteSettings()
THREE_NODES = SiteSettings(replication_factor=3, min_insync_replicas=2)
BUILT_IN = {
    "segment_bytes_max": 1 << 30,
    "segment_ms": 604_800_000,
    "retention_ms": -1,
    "retention_bytes": -1,
    "flush_interval_ms": 0,
    "max_batch_bytes": 8 << 20,
    "message_timestamp_before_max_ms": -1,
    "message_timestamp_after_max_ms": 3_600_000,
}


def test_kafka_names_set_georep_keys_and_the_fixed_ones_set_nothing() -> None:
    """min.insync.replicas is the topic's own now (issue 23): it sets georep's min_insync_replicas."""
    raw = {
        "retention.ms": "3600000",
        "retention.bytes": "1048576",
        "segment.bytes": "16777216",
        "segment.ms": "60000",
        "max.message.bytes": "2097152",
        "flush.ms": "1000",
        "message.timestamp.before.max.ms": "86400000",
        "message.timestamp.after.max.ms": "60000",
        "cleanup.policy": "delete",
        "compression.type": "producer",
        "message.timestamp.type": "CreateTime",
        "min.insync.replicas": "1",
    }
    assert to_georep(raw, ONE_NODE) == {
        "retention_ms": "3600000",
        "retention_bytes": "1048576",
        "segment_bytes_max": "16777216",
        "segment_ms": "60000",
        "max_batch_bytes": "2097152",
        "flush_interval_ms": "1000",
        "message_timestamp_before_max_ms": "86400000",
        "message_timestamp_after_max_ms": "60000",
        "min_insync_replicas": "1",
    }


def test_georep_keys_are_taken_too_and_every_georep_key_has_a_kafka_name() -> None:
    assert to_georep({"retention_ms": "5000", "segment.ms": "7"}, ONE_NODE) == {
        "retention_ms": "5000",
        "segment_ms": "7",
    }
    # replication_factor is CreateTopics' own field in Kafka, not a topic config
    assert sorted(n.key for n in KAFKA_NAMES if n.key) == sorted(set(TOPIC_CONFIG_KEYS) - {"replication_factor"})


@pytest.mark.parametrize(
    ("raw", "site", "says"),
    [
        ({"cleanup.policy": "compact"}, ONE_NODE, "no log compaction yet"),
        ({"cleanup.policy": "compact,delete"}, ONE_NODE, "use delete"),
        ({"compression.type": "zstd"}, ONE_NODE, "in its producer's codec"),
        ({"message.timestamp.type": "LogAppendTime"}, ONE_NODE, "use CreateTime"),
        ({"min.insync.replicas": "2"}, ONE_NODE, "factor 1 (this site's: a one-node site keeps one copy)"),
        ({"min.insync.replicas": "4"}, THREE_NODES, "ask for min.insync.replicas of 1 to 3, or a replication"),
        ({"min.insync.replicas": "3", "replication_factor": "2"}, THREE_NODES, "replication factor 2 (its own)"),
        ({"min.insync.replicas": "0"}, THREE_NODES, "min_insync_replicas=0 is below the minimum 1"),
        ({"min.insync.replicas": "two"}, None, "is not an integer"),
        (
            {"retention.ms": "soon"},
            ONE_NODE,
            "retention.ms='soon' (georep's retention_ms): topic config retention_ms='soon' is not an integer",
        ),
        ({"segment.bytes": "10"}, ONE_NODE, "below the minimum 1024"),
        ({"max.message.bytes": str(1 << 30)}, ONE_NODE, "above the maximum"),
        ({"flush.ms": "9223372036854775807"}, ONE_NODE, f"above {FLUSH_MS_MAX}"),
        ({"unclean.leader.election.enable": "false"}, ONE_NODE, "has no georep counterpart"),
        ({"segment.bytes.max": "4096"}, ONE_NODE, "use Kafka's name segment.bytes or georep's key segment_bytes_max"),
        ({"no.such.config": "1"}, ONE_NODE, "georep takes Kafka's cleanup.policy"),
        ({"retention.ms": "1000", "retention_ms": "2000"}, ONE_NODE, "to two values"),
    ],
)
def test_what_georep_cannot_take_is_refused_with_what_to_do(
    raw: dict[str, str], site: SiteSettings | None, says: str
) -> None:
    with pytest.raises(InvalidConfig) as refused:
        to_georep(raw, site)
    assert says in str(refused.value)
    assert refused.value.kafka_code == 40  # Kafka's INVALID_CONFIG


def test_min_insync_replicas_is_the_topics_own_up_to_its_replication_factor() -> None:
    """Before issue 23's per-topic quorum, any value but the site's was refused ("use 2 or leave it out")."""
    assert to_georep({"min.insync.replicas": "3", "cleanup.policy": "delete"}, THREE_NODES) == {
        "min_insync_replicas": "3"
    }
    # below the site's quorum, a replication factor below the site's quorum is fine: the topic's own counts
    assert to_georep({"min.insync.replicas": "1", "replication_factor": "1"}, THREE_NODES) == {
        "min_insync_replicas": "1",
        "replication_factor": "1",
    }
    # a one-node site takes it with a replication factor for the multi-node sites the topic reaches
    assert to_georep({"min_insync_replicas": "2", "replication_factor": "3"}, ONE_NODE) == {
        "min_insync_replicas": "2",
        "replication_factor": "3",
    }
    assert to_georep({"min.insync.replicas": "2"}, None) == {"min_insync_replicas": "2"}  # the CLI: its node checks


def test_a_replication_factor_below_the_sites_min_insync_replicas_is_refused_not_raised() -> None:
    """With fewer copies than every write needs, one node down stops the partition: a create asking for that
    (Kafka clients ask for 1 by habit) is told what to ask for, not silently given more."""
    assert to_georep({"replication_factor": "2"}, THREE_NODES) == {"replication_factor": "2"}
    with pytest.raises(InvalidReplicationFactor, match=r"at least 2 \(or -1 for the site's 3\)") as error:
        to_georep({"replication_factor": "1"}, THREE_NODES)
    assert error.value.kafka_code == 38


def test_describe_names_each_value_with_its_source_and_synonyms() -> None:
    defaults = {**BUILT_IN, "retention_ms": 86_400_000}  # a node started with --retention-ms 86400000
    described = {d.name: d for d in describe({"segment_bytes_max": 4096}, defaults, BUILT_IN, THREE_NODES)}
    assert sorted(described) == sorted(n.name for n in KAFKA_NAMES)
    seg = described["segment.bytes"]
    assert (seg.value, seg.source) == ("4096", ConfigSource.DYNAMIC_TOPIC_CONFIG)
    assert seg.synonyms == (
        ("segment.bytes", "4096", ConfigSource.DYNAMIC_TOPIC_CONFIG),
        ("log.segment.bytes", str(1 << 30), ConfigSource.DEFAULT_CONFIG),
    )
    ret = described["retention.ms"]
    assert (ret.value, ret.source) == ("86400000", ConfigSource.STATIC_BROKER_CONFIG)
    assert described["flush.ms"].source == ConfigSource.DEFAULT_CONFIG
    assert (described["cleanup.policy"].value, described["cleanup.policy"].source) == (
        "delete",
        ConfigSource.DEFAULT_CONFIG,
    )
    assert described["min.insync.replicas"].value == "2"
    assert "georep's topic config segment_bytes_max" in seg.documentation


def test_broker_configs_use_kafkas_broker_names() -> None:
    named = {d.name: d.value for d in broker_configs(BUILT_IN, BUILT_IN, THREE_NODES)}
    assert named["log.retention.ms"] == "-1" and named["message.max.bytes"] == str(8 << 20)
    assert named["default.replication.factor"] == "3" and named["min.insync.replicas"] == "2"


def test_describe_shows_a_topics_min_insync_replicas_or_the_sites() -> None:
    own = {d.name: d for d in describe({"min_insync_replicas": 3}, BUILT_IN, BUILT_IN, THREE_NODES)}[
        "min.insync.replicas"
    ]
    assert (own.value, own.source) == ("3", ConfigSource.DYNAMIC_TOPIC_CONFIG)
    assert own.synonyms[1:] == (
        ("min.insync.replicas", "2", ConfigSource.STATIC_BROKER_CONFIG),
        ("min.insync.replicas", "1", ConfigSource.DEFAULT_CONFIG),
    )
    site = {d.name: d for d in describe({}, BUILT_IN, BUILT_IN, THREE_NODES)}["min.insync.replicas"]
    assert (site.value, site.source) == ("2", ConfigSource.STATIC_BROKER_CONFIG)
    one = {d.name: d for d in describe({}, BUILT_IN, BUILT_IN, ONE_NODE)}["min.insync.replicas"]
    assert (one.value, one.source) == ("1", ConfigSource.DEFAULT_CONFIG)
