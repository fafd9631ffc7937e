"""snappy, lz4, gzip and zstd through the Kafka gateway, stored compressed (issue 23, "Compression"): confluent-kafka,
kafka-python (where it has the codec's library) and aiokafka produce with each codec; the stored segment bytes are
measured compressed, in the producer's codec; every client, and georep's own consumer, reads the records back; and
a bomb or garbage in each codec, sent raw, is refused with its Kafka error code and nothing is stored."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import Iterator
from pathlib import Path

import cramjam
import lz4.frame
import pytest

from georep.client import Consumer
from georep.record.batch import BatchHeader, iter_headers
from georep.record.compression import Compression
from georep.server.process import NodeProcess
from tests.support.forge import ZEROS_MIB
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until
from tests.support.kafka_raw import kafka_batch, kafka_python_read, kafka_record, produce_raw
from tests.support.sites import Sites, converged, wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka = pytest.importorskip("kafka")
aiokafka = pytest.importorskip("aiokafka")

pytestmark = pytest.mark.slow

CODECS = ("gzip", "snappy", "lz4", "zstd")
STORED_AS = {"gzip": Compression.GZIP, "snappy": Compression.SNAPPY, "lz4": Compression.LZ4, "zstd": Compression.ZSTD}
RECORDS = 300


@pytest.fixture
def node(start_node) -> Iterator[NodeProcess]:  # type: ignore[no-untyped-def]
    yield start_node(extra_args=KAFKA_ARGS)


def create_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the results: its handle serves the futures
    for future in admin.create_topics([NewTopic(t, 1, 1) for t in names]).values():
        future.result(15)


def values(topic: str) -> list[bytes]:
    """Compressible values, as JSON events are: each distinct, most of each repeated."""
    return [
        b'{"topic": "%s", "n": %d, "page": "/catalog/shoes", "agent": "Mozilla/5.0 (X11; Linux)"}'
        % (
            topic.encode(),
            i,
        )
        * 4
        for i in range(RECORDS)
    ]


def topics() -> list[tuple[str, str, str]]:
    """(client, codec, topic) for every codec each client can produce with here."""
    out = [("confluent", codec, f"confluent-{codec}") for codec in CODECS]
    out += [("kafka-python", c, f"kafka-python-{c}") for c in CODECS]  # snappy through python-snappy (dev)
    return out + [("aiokafka", codec, f"aiokafka-{codec}") for codec in CODECS]


def produce(bootstrap: str, client: str, codec: str, topic: str) -> None:
    sent = values(topic)
    if client == "confluent":
        p = confluent_kafka.Producer(
            {"bootstrap.servers": bootstrap, "compression.type": codec, "linger.ms": 50, "enable.idempotence": True}
        )
        for v in sent:
            p.produce(topic, value=v)
        assert p.flush(30) == 0
    elif client == "kafka-python":
        kp = kafka.KafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=50, acks="all")
        for v in sent:
            kp.send(topic, v)
        kp.flush(30)
        kp.close()
    else:
        asyncio.run(_aiokafka_produce(bootstrap, codec, topic, sent))


async def _aiokafka_produce(bootstrap: str, codec: str, topic: str, sent: list[bytes]) -> None:
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=50)
    await producer.start()
    try:
        for v in sent:
            await producer.send(topic, v)
        await producer.flush()
    finally:
        await producer.stop()


def stored_batches(data_dir: Path, topic: str) -> list[BatchHeader]:
    """The CRC-checked batches of ``topic``-0 in the node's segment files."""
    return [
        h
        for log in sorted((data_dir / "logs" / f"{topic}-0").glob("*.log"))
        for h in iter_headers(log.read_bytes(), verify=True)
    ]


def confluent_read(bootstrap: str, names: list[str]) -> dict[str, list[bytes]]:
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "enable.auto.commit": False})
    c.assign([confluent_kafka.TopicPartition(t, 0, confluent_kafka.OFFSET_BEGINNING) for t in names])
    got: dict[str, list[bytes]] = {t: [] for t in names}

    def step() -> None:
        m = c.poll(0.2)
        if m is not None:
            assert m.error() is None, m.error()
            got[m.topic()].append(m.value())

    try:
        poll_until("confluent-kafka read every topic", step, lambda: all(len(v) >= RECORDS for v in got.values()))
    finally:
        c.close()
    return got


async def aiokafka_read(bootstrap: str, names: list[str]) -> dict[str, list[bytes]]:
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    got: dict[str, list[bytes]] = {t: [] for t in names}
    try:
        parts = [aiokafka.TopicPartition(t, 0) for t in names]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        async with asyncio.timeout(60):
            while any(len(v) < RECORDS for v in got.values()):
                for tp, msgs in (await consumer.getmany(timeout_ms=500)).items():
                    got[tp.topic] += [m.value for m in msgs]
    finally:
        await consumer.stop()
    return got


async def georep_read(address: str, names: list[str]) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {t: [] for t in names}
    async with Consumer(address, auto_offset_reset="earliest", max_wait_ms=100) as consumer:
        consumer.assign([(t, 0) for t in names])
        deadline = time.monotonic() + 60
        while any(len(v) < RECORDS for v in got.values()) and time.monotonic() < deadline:
            for r in await consumer.poll(timeout_ms=200):
                got[r.topic].append(r.value)
    return got


def test_every_codec_from_every_client_is_stored_compressed_and_read_back_by_every_client(node: NodeProcess) -> None:
    bootstrap = kafka_address(node)
    cases = topics()
    names = [t for _c, _codec, t in cases]
    create_topics(bootstrap, names)
    for client, codec, topic in cases:
        produce(bootstrap, client, codec, topic)
    for client, codec, topic in cases:
        batches = stored_batches(node.data_dir, topic)
        assert sum(h.records_count for h in batches) == RECORDS, topic
        assert {h.compression for h in batches} == {STORED_AS[codec]}, (client, codec)
        stored = sum(h.size_bytes for h in batches)
        raw = sum(len(v) for v in values(topic))
        assert stored < raw // 4, (client, codec, stored, raw)  # what crosses the WAN: the stored batches
    expected = {t: values(t) for t in names}
    assert confluent_read(bootstrap, names) == expected
    assert {t: kafka_python_read(bootstrap, t) for t in names} == expected
    assert asyncio.run(aiokafka_read(bootstrap, names)) == expected
    assert asyncio.run(georep_read(node.address, names)) == expected


def test_a_bomb_or_garbage_in_every_codec_is_refused_and_nothing_is_stored(node: NodeProcess) -> None:
    bootstrap = kafka_address(node)
    create_topics(bootstrap, ["hostile"])
    compress = {
        1: gzip.compress,
        2: lambda data: bytes(cramjam.snappy.compress_raw(data)),
        3: lambda data: bytes(lz4.frame.compress(data)),
        4: lambda data: bytes(cramjam.zstd.compress(data)),
    }
    for kafka_id, squeeze in compress.items():
        bomb = kafka_batch(squeeze(ZEROS_MIB * 16), 1, attributes=kafka_id)  # the topic's max_batch_bytes: 8 MiB
        garbage = kafka_batch(squeeze(b"\x13" * 99), 1, attributes=kafka_id)
        code, message = produce_raw(bootstrap, "hostile", 0, bomb)
        assert code == 10 and "max_batch_bytes" in message, (kafka_id, code, message)
        code, message = produce_raw(bootstrap, "hostile", 0, garbage)
        assert code in (2, 87), (kafka_id, code, message)
    assert stored_batches(node.data_dir, "hostile") == []
    good = kafka_batch(compress[2](kafka_record(b"fine")), 1, attributes=2)
    assert produce_raw(bootstrap, "hostile", 0, good) == (0, "")
    assert [h.compression for h in stored_batches(node.data_dir, "hostile")] == [Compression.SNAPPY]


def test_compressed_kafka_batches_cross_to_another_site_as_stored(tmp_path: Path) -> None:
    """What a link carries is the stored batch, verbatim: the other site holds the same compressed bytes."""
    sites = Sites(tmp_path, ["x", "y"], [("x", "y")], extra_args=KAFKA_ARGS)
    try:
        sites.start()
        bootstrap = kafka_address(sites.nodes["x"])
        create_topics(bootstrap, ["wan-snappy", "wan-gzip"])
        produce(bootstrap, "confluent", "snappy", "wan-snappy")
        produce(bootstrap, "aiokafka", "gzip", "wan-gzip")
        for topic, codec in (("wan-snappy", "snappy"), ("wan-gzip", "gzip")):
            wait_until(f"y holds {topic}", lambda t=topic: converged(sites, ["x", "y"], t, RECORDS), 60)
            at_x, at_y = (stored_batches(sites.nodes[s].data_dir, topic) for s in ("x", "y"))
            assert {h.compression for h in at_y} == {STORED_AS[codec]}
            assert [(h.crc, h.size_bytes) for h in at_y] == [(h.crc, h.size_bytes) for h in at_x]
            assert sum(h.size_bytes for h in at_y) < sum(len(v) for v in values(topic)) // 4
    finally:
        sites.close()
