"""Kafka's OffsetForLeaderEpoch (API key 23, KIP-320), as a consumer sends it after a leader change to detect
a truncation: every epoch up to the leader's ends where the log's readable part ends (georep never takes back
what it served: ``georep/kafka/leader_epochs.py``), and a client whose metadata is ahead of or behind the
leader gets UNKNOWN_LEADER_EPOCH or FENCED_LEADER_EPOCH, as from Kafka."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol import consumer as kconsumer

from georep.kafka.cluster import OneNode, Route, SiteView
from georep.kafka.gateway import Client, KafkaGateway
from georep.kafka.leader_epochs import FENCED_LEADER_EPOCH, UNKNOWN_LEADER_EPOCH, EpochEnd, end_of_epoch
from georep.kafka.protocol import Request, decode_request, encode_response
from georep.record.batch import RecordInput, encode_batch
from georep.server.broker import Broker
from tests.test_kafka_gateway_core import gateway

TOPIC = "t"
PEER = Client("127.0.0.1")
UNKNOWN_TOPIC_OR_PARTITION = 3


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A one-node site with 4 fsynced records of topic ``t`` (offsets 0..3) and 2 more not yet fsynced."""
    from georep.storage.metadata_file import load_or_create_identity

    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic(TOPIC, 1, {"flush_interval_ms": "60000"})
    records = [RecordInput(None, b"v%d" % i, (), 1_000) for i in range(4)]
    b.append(TOPIC, 0, encode_batch(records))
    b.partition(TOPIC, 0).log.flush()
    b.append(TOPIC, 0, encode_batch(records[:2]))
    yield b
    b.close()


@dataclass(frozen=True)
class EpochView:
    """A multi-node site's view in which this node leads every partition at ``epoch``."""

    epoch: int
    me: int = 0

    def brokers(self) -> list[Any]:
        return OneNode("127.0.0.1", 9092).brokers()

    def route(self, topic: str, partition: int) -> Route:
        return Route(0, self.me, self.epoch, (self.me,), (self.me,))

    def not_served(self, topic: str, partition: int) -> int:
        return 6

    def coordinator(self, group: str) -> Any:
        return None


def ask(g: KafkaGateway, asked: list[tuple[str, int, int, int]], version: int = 2) -> list[tuple[Any, ...]]:
    """OffsetForLeaderEpoch through the gateway's codec and dispatch: ``asked`` is (topic, partition, current
    leader epoch, leader epoch); the answer is (topic, partition, error, leader epoch, end offset) each."""
    r = kconsumer.OffsetForLeaderEpochRequest
    topics: dict[str, list[Any]] = {}
    for topic, partition, current, epoch in asked:
        topics.setdefault(topic, []).append(
            r.OffsetForLeaderTopic.OffsetForLeaderPartition(
                partition=partition, current_leader_epoch=current, leader_epoch=epoch
            )
        )
    request = r(
        version=version,
        replica_id=-1,
        topics=[r.OffsetForLeaderTopic(topic=t, partitions=ps) for t, ps in topics.items()],
    )
    request.with_header(correlation_id=7, client_id="rdkafka")
    decoded = decode_request(bytes(request.encode(header=True)))
    assert isinstance(decoded, Request), decoded

    async def dispatched() -> Any:
        return await g.dispatch(decoded, PEER)

    answer = asyncio.run(dispatched())
    framed = encode_response(23, version, 7, answer)  # the bytes the client gets, decoded as it decodes them
    answer = kconsumer.OffsetForLeaderEpochResponse.decode(framed[4:], version=version, header=True)
    return [
        (t.topic, p.partition, p.error_code, p.leader_epoch, p.end_offset) for t in answer.topics for p in t.partitions
    ]


def test_api_versions_lists_offset_for_leader_epoch() -> None:
    from georep.kafka.protocol import SUPPORTED

    assert SUPPORTED[23][2:] == (2, 4)


@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_one_node_sites_only_epoch_ends_at_the_high_watermark(broker: Broker, version: int) -> None:
    """Epoch 0 (every served batch's partitionLeaderEpoch) ends at 4, not at the log end (6): a consumer
    never reads past the high watermark, so it never sees its position past the epoch's end."""
    g = gateway(broker)
    assert ask(g, [(TOPIC, 0, 0, 0), (TOPIC, 0, -1, 0)], version) == [(TOPIC, 0, 0, 0, 4), (TOPIC, 0, 0, 0, 4)]


def test_a_later_leader_reports_every_epoch_up_to_its_own_ending_at_the_high_watermark(broker: Broker) -> None:
    """After leader changes (epoch 5 now): the client's last batch said epoch 0, or its ListOffsets answer said
    an epoch in between; no truncation happened, so no epoch ends before the client's position."""
    g = gateway(broker)
    g.view_of = lambda keys: EpochView(5)
    assert ask(g, [(TOPIC, 0, 5, 0), (TOPIC, 0, 5, 3), (TOPIC, 0, 5, 5)]) == [
        (TOPIC, 0, 0, 0, 4),
        (TOPIC, 0, 0, 3, 4),
        (TOPIC, 0, 0, 5, 4),
    ]


def test_a_client_ahead_of_or_behind_the_leaders_epoch_gets_kafkas_codes(broker: Broker) -> None:
    g = gateway(broker)
    g.view_of = lambda keys: EpochView(5)
    assert ask(g, [(TOPIC, 0, 6, 5), (TOPIC, 0, 4, 4), (TOPIC, 0, 5, 6)]) == [
        (TOPIC, 0, UNKNOWN_LEADER_EPOCH, -1, -1),  # this node has not seen the election the client has
        (TOPIC, 0, FENCED_LEADER_EPOCH, -1, -1),  # the client's metadata is stale
        (TOPIC, 0, 0, -1, -1),  # an epoch past the leader's: undefined, as Kafka answers
    ]


def test_an_unknown_topic_or_partition_gets_its_code(broker: Broker) -> None:
    got = ask(gateway(broker), [("nope", 0, -1, 0), (TOPIC, 9, -1, 0)])
    assert [(t, p, code) for t, p, code, _e, _o in got] == [
        ("nope", 0, UNKNOWN_TOPIC_OR_PARTITION),
        (TOPIC, 9, UNKNOWN_TOPIC_OR_PARTITION),
    ]


def test_end_of_epoch_rules() -> None:
    assert end_of_epoch(0, -1, 0, 10) == EpochEnd(0, 0, 10)
    assert end_of_epoch(2, 3, 3, 10) == EpochEnd(0, 2, 10)
    assert end_of_epoch(-1, 3, 3, 10) == EpochEnd(0, -1, -1)
    assert end_of_epoch(4, 3, 3, 10) == EpochEnd(0, -1, -1)
    assert end_of_epoch(3, 4, 3, 10) == EpochEnd(UNKNOWN_LEADER_EPOCH, -1, -1)
    assert end_of_epoch(3, 2, 3, 10) == EpochEnd(FENCED_LEADER_EPOCH, -1, -1)


_: type[SiteView] = EpochView  # the fake view meets the gateway's port


# -- a confluent-kafka consumer across a leader change on a 3-node site ---------------------------------------


@pytest.mark.slow
def test_a_consumer_reads_on_across_a_leader_change_without_a_truncation(tmp_path: Path) -> None:
    """librdkafka sees the partition's leader epoch grow in Metadata and validates its position with
    OffsetForLeaderEpoch at the new leader: it goes on reading every record, once, with no truncation error."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.support.cluster_site import ClusterSite
    from tests.support.kafka_nodes import poll_until

    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"], kafka=True)
    site.start()
    try:
        bootstrap = ",".join(site.kafka_address(n) for n in (1, 2, 3))
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a handle dropped fails its futures
        admin.create_topics([NewTopic("e", 1, 3)])["e"].result(15)
        victim = site.wait_leader("e")
        p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 60_000})

        def produce(first: int) -> None:
            for i in range(first, first + 50):
                p.produce("e", value=b"v-%d" % i, partition=0)
            assert p.flush(60) == 0

        lines: list[str] = []
        logger = logging.getLogger("rdkafka-epoch")
        logger.addHandler(ListHandler(lines))
        logger.setLevel(logging.DEBUG)
        c = confluent_kafka.Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "epoch",
                "enable.auto.commit": False,
                "topic.metadata.refresh.interval.ms": 500,
                "debug": "consumer,topic,protocol",
                "logger": logger,
            }
        )
        c.assign([confluent_kafka.TopicPartition("e", 0, confluent_kafka.OFFSET_BEGINNING)])
        got: list[bytes] = []
        errors: list[object] = []

        def step() -> None:
            m = c.poll(0.5)
            if m is not None:
                (errors.append(m.error()) if m.error() else got.append(m.value()))

        try:
            produce(0)
            poll_until("the first 50 records are read", step, lambda: len(got) >= 50)
            site.nodes[victim].kill9()
            assert site.wait_leader("e", not_node=victim) != victim
            produce(50)
            poll_until("the next 50 records are read from the new leader", step, lambda: len(got) >= 100)
            for _ in range(4):  # and nothing more (a duplicate) arrives
                step()
        finally:
            c.close()
        assert errors == []
        assert got == [b"v-%d" % i for i in range(100)]
        validated = [line for line in lines if "Sent OffsetForLeaderEpochRequest" in line]
        assert validated, "the consumer validated its position at the new leader"
    finally:
        site.close()


class ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
