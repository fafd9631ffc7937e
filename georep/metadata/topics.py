"""Topic definitions: names, partition counts and per-topic configuration. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOPIC_NAME_MAX_CHARS = 249
PARTITIONS_MAX = 10_000
# Hierarchical names: levels of [A-Za-z0-9._-] separated by '/' (link filters match
# levels with '+' and '**', so those characters cannot appear in names).
_LEVEL = re.compile(r"[A-Za-z0-9._-]+")


class InvalidTopic(ValueError):
    """A topic name, partition count or config value that cannot be used."""


def validate_topic_name(name: str) -> str:
    if not name:
        raise InvalidTopic("topic name is empty: use levels of letters, digits, '.', '_' or '-' separated by '/'")
    if len(name) > TOPIC_NAME_MAX_CHARS:
        raise InvalidTopic(f"topic name is {len(name)} characters long; the limit is {TOPIC_NAME_MAX_CHARS}")
    levels = name.split("/")
    for level in levels:
        if not _LEVEL.fullmatch(level) or level in (".", ".."):
            raise InvalidTopic(
                f"invalid topic name {name!r}: each '/'-separated level must be letters, digits, '.', '_' "
                "or '-' (not empty, not '.' or '..'), for example 'orders/eu'"
            )
    return name


def validate_partitions(partitions: int) -> int:
    if not 1 <= partitions <= PARTITIONS_MAX:
        raise InvalidTopic(f"invalid partition count {partitions}: use 1 to {PARTITIONS_MAX}")
    return partitions


# Every per-topic setting, with its meaning; values are integers.
TOPIC_CONFIG_KEYS: dict[str, str] = {
    "segment_bytes_max": "roll a segment before it would exceed this size",
    "segment_ms": "roll a segment once its first batch is this old",
    "retention_ms": "delete sealed segments whose newest record is older (-1: forever)",
    "retention_bytes": "delete the oldest sealed segments while the partition is larger (-1: no limit)",
    "flush_interval_ms": "0: fsync before acking each batch; N: fsync every N ms",
    "max_batch_bytes": "reject produced batches larger than this, compressed or decompressed",
    "message_timestamp_before_max_ms": "reject a produced record stamped more than this before the site's clock "
    "(-1: no limit; Kafka's message.timestamp.before.max.ms)",
    "message_timestamp_after_max_ms": "reject a produced record stamped more than this after the site's clock "
    "(-1: no limit; Kafka's message.timestamp.after.max.ms)",
    "replication_factor": "a multi-node site opens each new segment on this many nodes (default: the site's "
    "--replication-factor; a site with fewer nodes uses what it has; a one-node site keeps one copy)",
    "min_insync_replicas": "a multi-node site acknowledges an acks=all write once this many nodes hold it fsynced "
    "(default: the site's --min-insync-replicas; at most the replication factor; a one-node site keeps one copy "
    "and acknowledges once it is fsynced; Kafka's min.insync.replicas)",
}

# The largest max_batch_bytes a topic may have. The node's gRPC receive limit is above it, so a batch over a
# topic's limit always reaches the broker and gets its clear refusal, never a bare transport error.
MAX_BATCH_BYTES_LIMIT = 64 << 20

REPLICATION_FACTOR_MAX = 16
_MAXIMUMS = {
    "max_batch_bytes": MAX_BATCH_BYTES_LIMIT,
    "replication_factor": REPLICATION_FACTOR_MAX,
    "min_insync_replicas": REPLICATION_FACTOR_MAX,
}

_MINIMUMS = {
    "segment_bytes_max": 1024,
    "segment_ms": 1,
    "retention_ms": -1,
    "retention_bytes": -1,
    "flush_interval_ms": 0,
    "max_batch_bytes": 1024,
    "message_timestamp_before_max_ms": -1,
    "message_timestamp_after_max_ms": -1,
    "replication_factor": 1,
    "min_insync_replicas": 1,
}


def parse_topic_config(raw: dict[str, str]) -> dict[str, int]:
    """Validate config overrides given as strings (from the CLI or the wire)."""
    out: dict[str, int] = {}
    for key in sorted(raw):
        if key not in TOPIC_CONFIG_KEYS:
            known = ", ".join(sorted(TOPIC_CONFIG_KEYS))
            raise InvalidTopic(f"unknown topic config {key!r}: known keys are {known}")
        try:
            value = int(raw[key])
        except ValueError:
            raise InvalidTopic(f"topic config {key}={raw[key]!r} is not an integer") from None
        if value < _MINIMUMS[key]:
            raise InvalidTopic(f"topic config {key}={value} is below the minimum {_MINIMUMS[key]}")
        if key in _MAXIMUMS and value > _MAXIMUMS[key]:
            raise InvalidTopic(f"topic config {key}={value} is above the maximum {_MAXIMUMS[key]}: use at most that")
        out[key] = value
    return out


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, int] = field(default_factory=dict)  # overrides only
    # The incarnation live at this site (georep/metadata/topic_entry.py): 0 until the name is deleted once.
    incarnation: int = 0

    def effective(self, defaults: dict[str, int]) -> dict[str, int]:
        return {**defaults, **self.config}
