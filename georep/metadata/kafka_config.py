"""Kafka's topic config names and georep's topic config keys: the one table that maps them. Pure.

Kafka clients and tools (CreateTopics, ``kafka-topics --config``, Terraform, UIs) name a topic's settings with
Kafka's names (``retention.ms``, ``max.message.bytes``, ``cleanup.policy``); georep's topics have their own keys
(:data:`georep.metadata.topics.TOPIC_CONFIG_KEYS`: ``retention_ms``, ``max_batch_bytes``). This table says, for
each Kafka name georep takes:

* **a mapped name** (:attr:`KafkaName.key` set): the georep key it sets, the value passed on as it is and
  checked with that key's bounds (:func:`~georep.metadata.topics.parse_topic_config`), plus any bound of the Kafka
  name's own (``flush.ms``: :data:`FLUSH_MS_MAX`);
* **a fixed name** (no key): georep has no setting, because it behaves one way only; the name is accepted with
  that one value, so tools that state Kafka's defaults work, and any other value is refused with why and what to
  do (``cleanup.policy=compact``: georep has no log compaction yet);
* ``min.insync.replicas`` is the topic's ``min_insync_replicas``, whose default is the site's (a multi-node
  site's ``--min-insync-replicas`` node flag, 1 on a one-node site). It may not exceed the topic's replication
  factor (its own, else the site's): :func:`check_quorum`, which needs the site's settings.

Anything else is refused with :class:`InvalidConfig` (Kafka's ``INVALID_CONFIG``), whose message names the
config and says what to do. georep's own keys are taken too, under their own names, so a georep client and a
Kafka client may create the same topic either way. :func:`describe` is the other direction: every Kafka name
with the topic's value and where it comes from, as DescribeConfigs answers it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from georep.metadata.topics import TOPIC_CONFIG_KEYS, InvalidTopic, parse_topic_config

KAFKA_INVALID_CONFIG = 40  # Kafka's INVALID_CONFIG (this layer cannot import the gateway's table of codes)
KAFKA_INVALID_REPLICATION_FACTOR = 38

# Records are served, and acks=all released, only once fsynced (docs/kafka.md, "Records"): Kafka's default
# flush.ms (Long.MAX_VALUE, "rely on replication") would hold a topic's records back for good. An hour is the
# longest interval that still makes sense for a topic whose readers wait for the fsync.
FLUSH_MS_MAX = 3_600_000


class InvalidConfig(InvalidTopic):
    """A topic config name or value georep cannot take; the message names it and says what to do."""

    kafka_code = KAFKA_INVALID_CONFIG


class InvalidReplicationFactor(InvalidTopic):
    """A replication factor below the topic's min.insync.replicas (the site's, where it has none of its own): no
    segment of the topic could ack an acks=all write, which a silent raise would hide."""

    kafka_code = KAFKA_INVALID_REPLICATION_FACTOR


class ConfigType(enum.IntEnum):
    """Kafka's ``ConfigType`` (DescribeConfigs v3+)."""

    STRING = 2
    INT = 3
    LONG = 5
    LIST = 7


class ConfigSource(enum.IntEnum):
    """Kafka's ``ConfigSource`` (DescribeConfigs v1+)."""

    DYNAMIC_TOPIC_CONFIG = 1
    STATIC_BROKER_CONFIG = 4
    DEFAULT_CONFIG = 5


@dataclass(frozen=True, slots=True)
class SiteSettings:
    """What the site, not the topic, decides: a multi-node site's node flags (one node: 1 and 1)."""

    replication_factor: int = 1
    min_insync_replicas: int = 1


@dataclass(frozen=True, slots=True)
class KafkaName:
    name: str  # Kafka's topic config name
    key: str | None  # the georep topic config key it sets; None: georep has no setting (see ``fixed``)
    config_type: ConfigType
    broker_name: str  # Kafka's broker-level default of it (the synonym DescribeConfigs lists)
    fixed: str = ""  # with no key: the one value georep takes
    why: str = ""  # with no key: why no other value, and what to do instead


MIN_INSYNC_REPLICAS = "min.insync.replicas"
MIN_INSYNC_KEY = "min_insync_replicas"  # georep's key for it (cluster/topic_settings.py)

KAFKA_NAMES: tuple[KafkaName, ...] = (
    KafkaName("cleanup.policy", None, ConfigType.LIST, "log.cleanup.policy", "delete",
              "georep has no log compaction yet: old records go by retention.ms and retention.bytes only"),
    KafkaName("compression.type", None, ConfigType.STRING, "compression.type", "producer",
              "georep stores each batch in its producer's codec, never in another: choose the codec on the "
              "producer (its compression.type)"),
    KafkaName("flush.ms", "flush_interval_ms", ConfigType.LONG, "log.flush.interval.ms"),
    KafkaName("max.message.bytes", "max_batch_bytes", ConfigType.INT, "message.max.bytes"),
    KafkaName("message.timestamp.after.max.ms", "message_timestamp_after_max_ms", ConfigType.LONG,
              "log.message.timestamp.after.max.ms"),
    KafkaName("message.timestamp.before.max.ms", "message_timestamp_before_max_ms", ConfigType.LONG,
              "log.message.timestamp.before.max.ms"),
    KafkaName("message.timestamp.type", None, ConfigType.STRING, "log.message.timestamp.type", "CreateTime",
              "georep keeps the producer's timestamps, which are part of a record's bytes and the same at every "
              "site, so there is no LogAppendTime"),
    KafkaName(MIN_INSYNC_REPLICAS, MIN_INSYNC_KEY, ConfigType.INT, MIN_INSYNC_REPLICAS),
    KafkaName("retention.bytes", "retention_bytes", ConfigType.LONG, "log.retention.bytes"),
    KafkaName("retention.ms", "retention_ms", ConfigType.LONG, "log.retention.ms"),
    KafkaName("segment.bytes", "segment_bytes_max", ConfigType.INT, "log.segment.bytes"),
    KafkaName("segment.ms", "segment_ms", ConfigType.LONG, "log.roll.ms"),
)  # fmt: skip
BY_NAME: dict[str, KafkaName] = {n.name: n for n in KAFKA_NAMES}
BY_KEY: dict[str, KafkaName] = {n.key: n for n in KAFKA_NAMES if n.key is not None}

# Kafka's other topic configs: georep has no counterpart, which the refusal says (rather than "unknown").
KAFKA_ONLY = frozenset(
    {
        "delete.retention.ms",
        "file.delete.delay.ms",
        "flush.messages",
        "follower.replication.throttled.replicas",
        "index.interval.bytes",
        "leader.replication.throttled.replicas",
        "local.retention.bytes",
        "local.retention.ms",
        "max.compaction.lag.ms",
        "message.downconversion.enable",
        "message.format.version",
        "message.timestamp.difference.max.ms",
        "min.cleanable.dirty.ratio",
        "min.compaction.lag.ms",
        "preallocate",
        "remote.log.copy.disable",
        "remote.log.delete.on.disable",
        "remote.storage.enable",
        "segment.index.bytes",
        "segment.jitter.ms",
        "unclean.leader.election.enable",
    }
)
_SEE = "docs/kafka.md, 'Config names'"


def to_georep(raw: Mapping[str, str], site: SiteSettings | None) -> dict[str, str]:
    """georep's topic config for a create's ``raw`` configs (Kafka names, georep keys or both), each checked: the
    values of a mapped name by its georep key's bounds, a fixed name's value against the one georep takes. Raises
    :class:`InvalidConfig` for the first config (in name order) georep cannot take. ``site``: the node's, which
    the whole config's quorum is checked against (:func:`check_quorum`); None: a client that does not know them
    (georep's CLI), whose node checks it."""
    out: dict[str, str] = {}
    given_as: dict[str, str] = {}  # georep key -> the name it was given under
    for name in sorted(raw):
        value = raw[name].strip()
        kafka = BY_NAME.get(name)
        key = kafka.key if kafka is not None else name if name in TOPIC_CONFIG_KEYS else None
        if kafka is not None and key is None:
            _check_fixed(kafka, value)
            continue
        if key is None:
            raise InvalidConfig(_unknown(name))
        _check_value(name, key, value)
        if key in out and out[key] != value:
            raise InvalidConfig(
                f"config {given_as[key]}={out[key]} and {name}={value} set the same georep setting {key} to two "
                "values: give it once"
            )
        out[key], given_as[key] = value, name
    if site is not None:
        check_quorum(parse_topic_config(out), site)
    return out


def check_quorum(config: Mapping[str, int], site: SiteSettings) -> None:
    """Raises if a topic of ``config`` (georep keys, parsed: its whole config after a create or an alter) would
    ack with more members than its segments have: its min_insync_replicas (else the site's) above its
    replication factor (else the site's). :class:`InvalidConfig` when the topic states the quorum, else
    :class:`InvalidReplicationFactor`. Every create and alter at a node asks this (``Broker.site``)."""
    aq = config.get(MIN_INSYNC_KEY, site.min_insync_replicas)
    rf = config.get("replication_factor", site.replication_factor)
    if aq <= rf:
        return
    if MIN_INSYNC_KEY not in config:
        raise InvalidReplicationFactor(
            f"replication factor {rf} is below this site's min.insync.replicas ({aq}): every acks=all write needs "
            f"that many copies, so ask for at least {aq} (or -1 for the site's {site.replication_factor}), or set "
            f"the topic's min.insync.replicas to at most {rf}"
        )
    whose = "its own" if "replication_factor" in config else "this site's"
    one_node = ": a one-node site keeps one copy" if site.replication_factor == 1 and whose != "its own" else ""
    raise InvalidConfig(
        f"config min.insync.replicas={aq} (georep's {MIN_INSYNC_KEY}) is above the topic's replication factor "
        f"{rf} ({whose}{one_node}): no segment could acknowledge an acks=all write; ask for min.insync.replicas of "
        f"1 to {rf}, or a replication factor of at least {aq}"
    )


def _check_fixed(kafka: KafkaName, value: str) -> None:
    if value != kafka.fixed:
        raise InvalidConfig(
            f"config {kafka.name}={value!r} is not supported: {kafka.why}; use {kafka.fixed} or leave it out"
        )


def _check_value(name: str, key: str, value: str) -> None:
    try:
        parse_topic_config({key: value})
    except InvalidTopic as exc:
        spelled = "" if name == key else f" (georep's {key})"
        raise InvalidConfig(f"config {name}={value!r}{spelled}: {exc}") from None
    if name == "flush.ms" and int(value) > FLUSH_MS_MAX:
        raise InvalidConfig(
            f"config flush.ms={value} is above {FLUSH_MS_MAX} (an hour): georep serves a record, and acknowledges "
            "acks=all, only once it is fsynced, so Kafka's 'never fsync' would hold the topic's records back; use 0 "
            "(fsync every batch, georep's default) up to an hour"
        )


def _unknown(name: str) -> str:
    kafka_names = ", ".join(n.name for n in KAFKA_NAMES)
    if name in KAFKA_ONLY:
        return (
            f"Kafka's topic config {name!r} has no georep counterpart: leave it out (georep takes {kafka_names}; "
            f"{_SEE})"
        )
    dotted = BY_KEY.get(name.replace(".", "_"))
    if dotted is not None:
        return f"unknown topic config {name!r}: use Kafka's name {dotted.name} or georep's key {dotted.key}"
    return f"unknown topic config {name!r}: georep takes Kafka's {kafka_names}, or its own keys ({_SEE})"


@dataclass(frozen=True, slots=True)
class Described:
    """One topic config as DescribeConfigs answers it."""

    name: str
    value: str
    source: ConfigSource
    config_type: ConfigType
    synonyms: tuple[tuple[str, str, ConfigSource], ...]  # (name, value, source), the one in effect first
    documentation: str


def describe(
    overrides: Mapping[str, int], defaults: Mapping[str, int], built_in: Mapping[str, int], site: SiteSettings
) -> list[Described]:
    """Every Kafka name of a topic with its value: the topic's own (``overrides``: DYNAMIC_TOPIC_CONFIG), else the
    node's default (``defaults``, from its flags: STATIC_BROKER_CONFIG where it differs from georep's ``built_in``
    one, else DEFAULT_CONFIG). A fixed name is georep's one value; min.insync.replicas' default is the site's."""
    return [_described(n, overrides, defaults, built_in, site) for n in KAFKA_NAMES]


def _described(
    n: KafkaName,
    overrides: Mapping[str, int],
    defaults: Mapping[str, int],
    built_in: Mapping[str, int],
    site: SiteSettings,
) -> Described:
    if n.key is None:
        value = n.fixed
        source = ConfigSource.DEFAULT_CONFIG
        doc = f"georep takes {value} only: {n.why}"
        return Described(n.name, value, source, n.config_type, ((n.broker_name, value, source),), doc)
    synonyms: list[tuple[str, str, ConfigSource]] = []
    if n.key in overrides:
        synonyms.append((n.name, str(overrides[n.key]), ConfigSource.DYNAMIC_TOPIC_CONFIG))
    if n.key == MIN_INSYNC_KEY:  # the site's, not a topic default of the node's
        default, built = site.min_insync_replicas, 1
    else:
        default, built = defaults[n.key], built_in[n.key]
    if default != built:
        synonyms.append((n.broker_name, str(default), ConfigSource.STATIC_BROKER_CONFIG))
    synonyms.append((n.broker_name, str(built), ConfigSource.DEFAULT_CONFIG))
    _name, value, source = synonyms[0]
    doc = f"georep's topic config {n.key}: {TOPIC_CONFIG_KEYS[n.key]}"
    return Described(n.name, value, source, n.config_type, tuple(synonyms), doc)


def broker_configs(defaults: Mapping[str, int], built_in: Mapping[str, int], site: SiteSettings) -> list[Described]:
    """The node's settings that a Kafka broker's DescribeConfigs names: each topic default under Kafka's broker
    name (the site's min.insync.replicas among them), and the site's replication factor."""
    out = []
    for n in KAFKA_NAMES:
        d = _described(n, {}, defaults, built_in, site)
        out.append(Described(n.broker_name, d.value, d.source, d.config_type, d.synonyms, d.documentation))
    rf_source = ConfigSource.DEFAULT_CONFIG if site.replication_factor == 1 else ConfigSource.STATIC_BROKER_CONFIG
    rf = str(site.replication_factor)
    out.append(
        Described(
            "default.replication.factor",
            rf,
            rf_source,
            ConfigType.INT,
            (("default.replication.factor", rf, rf_source),),
            "the site's replication factor (a multi-node site's --replication-factor node flag; 1 on a one-node site)",
        )
    )
    return sorted(out, key=lambda d: d.name)


def alter_changes(sets: Mapping[str, str], resets: Iterable[str]) -> dict[str, int | None]:
    """An alter's changes as georep keys: each of ``sets`` (Kafka names or georep keys, checked as a create's
    are, :func:`to_georep`) to its value, each of ``resets`` back to the node's default (``None``). A fixed name
    takes only its one value and has nothing to reset. Raises :class:`InvalidConfig`. The quorum is checked on the
    topic's whole config after the change (:func:`check_quorum`), which only the node knows."""
    out: dict[str, int | None] = {key: int(value) for key, value in to_georep(sets, None).items()}
    for name in sorted(resets):
        key = _key_of(name)
        if name in BY_NAME and key is None:
            continue  # a fixed name: its default is its one value
        if key is None:
            raise InvalidConfig(_unknown(name))
        if key in out:
            raise InvalidConfig(f"config {name} is both set and reset in one alter: give it once")
        out[key] = None
    return out


SET, DELETE, APPEND, SUBTRACT = 0, 1, 2, 3  # IncrementalAlterConfigs' ConfigOperation


def kafka_alter(
    configs: Iterable[tuple[str, int, str | None]], overrides: Mapping[str, int], replace_all: bool
) -> tuple[dict[str, str], list[str]]:
    """What a Kafka alter of a topic sets and resets: ``configs`` as (name, operation, value);
    ``replace_all`` (AlterConfigs, not incremental): every override it leaves out goes back to its default, as
    Kafka's AlterConfigs replaces a topic's whole config. Raises :class:`InvalidConfig`."""
    sets: dict[str, str] = {}
    resets: list[str] = []
    for name, operation, value in configs:
        if operation == DELETE or (replace_all and value is None):
            resets.append(name)
        elif operation == SET:
            if value is None:
                raise InvalidConfig(f"config {name}: a SET needs a value; DELETE resets it to the default")
            sets[name] = value
        else:
            raise InvalidConfig(
                f"config {name}: APPEND and SUBTRACT are for list configs, and georep's topic configs are single "
                "values: use SET"
            )
    if replace_all:
        given = {_key_of(name) for name in [*sets, *resets]}
        resets += sorted(key for key in overrides if key not in given)
    return sets, resets


def _key_of(name: str) -> str | None:
    kafka = BY_NAME.get(name)
    return kafka.key if kafka is not None else name if name in TOPIC_CONFIG_KEYS else None
