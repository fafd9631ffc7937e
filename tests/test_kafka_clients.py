"""Unmodified Kafka clients against a node's Kafka listener (issue 13): confluent-kafka (librdkafka),
kafka-python and aiokafka produce (idempotent, acks=all) and consume; confluent-kafka and kafka-python run a
two-member consumer group through a rebalance; requests the gateway does not serve get error codes on a
connection that stays open."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator

import pytest

from georep.server.process import NodeProcess
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until, read_frame, values

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka = pytest.importorskip("kafka")
aiokafka = pytest.importorskip("aiokafka")

FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 300}


@pytest.fixture
def bootstrap(start_node) -> Iterator[str]:  # type: ignore[no-untyped-def]
    node: NodeProcess = start_node(extra_args=KAFKA_ARGS)
    yield kafka_address(node)


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the result: its handle serves the future
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(15)


# -- confluent-kafka (librdkafka) --------------------------------------------------------------------------------


def confluent_produce(bootstrap: str, topic: str, vals: list[bytes]) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    errors: list[object] = []
    for i, v in enumerate(vals):
        p.produce(topic, key=b"%d" % i, value=v, on_delivery=lambda err, msg: errors.append(err) if err else None)
    assert p.flush(30) == 0
    assert errors == []


def test_confluent_produce_consume_and_group_rebalance(bootstrap: str) -> None:
    create_topic(bootstrap, "orders", 2)
    first = values(100, "first")
    confluent_produce(bootstrap, "orders", first)

    def consumer(name: str) -> object:
        c = confluent_kafka.Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "g",
                "client.id": name,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                **FAST_GROUP,
            }
        )
        c.subscribe(["orders"])
        return c

    got: dict[str, list[tuple[int, int, bytes]]] = {"c1": [], "c2": []}
    consumers = {"c1": consumer("c1")}

    def step() -> None:
        for name, c in consumers.items():
            m = c.poll(0.2)  # type: ignore[attr-defined]
            if m is not None and m.error() is None:
                got[name].append((m.partition(), m.offset(), m.value()))
                headers = dict(m.headers())
                assert headers["georep.origin"].startswith(b"a@") and int(headers["georep.origin_seq"]) >= 0

    poll_until("c1 read the first 100 records", step, lambda: len(got["c1"]) >= 100)
    assert sorted(v for _p, _o, v in got["c1"]) == sorted(first)
    consumers["c1"].commit(asynchronous=False)  # type: ignore[attr-defined]

    consumers["c2"] = consumer("c2")
    poll_until(
        "the rebalance gave each member one partition",
        step,
        lambda: all(len(c.assignment()) == 1 for c in consumers.values()),
    )  # type: ignore[attr-defined]
    parts = {name: c.assignment()[0].partition for name, c in consumers.items()}  # type: ignore[attr-defined]
    assert sorted(parts.values()) == [0, 1]
    second = values(100, "second")
    confluent_produce(bootstrap, "orders", second)
    poll_until(
        "the group read the second 100",
        step,
        lambda: sum(1 for recs in got.values() for _p, _o, v in recs if v.startswith(b"second")) >= 100,
    )
    after = [(name, p, v) for name, recs in got.items() for p, _o, v in recs[100 if name == "c1" else 0 :]]
    # Nothing committed is delivered again, and each member reads only its own partition after the rebalance.
    assert sorted(v for _n, _p, v in after) == sorted(second)
    assert all(p == parts[name] for name, p, _v in after)
    for c in consumers.values():
        c.close()  # type: ignore[attr-defined]


# -- kafka-python --------------------------------------------------------------------------------------------------


def test_kafka_python_produce_consume_and_group_rebalance(bootstrap: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic("events", 2, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    first = values(60, "first")
    for v in first:
        producer.send("events", v)
    producer.flush(30)

    def consumer(name: str) -> KafkaConsumer:
        return KafkaConsumer(
            "events",
            bootstrap_servers=bootstrap,
            group_id="kg",
            client_id=name,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=6000,
            heartbeat_interval_ms=300,
        )

    got: dict[str, list[tuple[int, bytes]]] = {"k1": [], "k2": []}
    consumers = {"k1": consumer("k1")}

    def step() -> None:
        for name, c in consumers.items():
            for _tp, msgs in c.poll(200).items():
                got[name] += [(m.partition, m.value) for m in msgs]

    poll_until("k1 read the first 60", step, lambda: len(got["k1"]) >= 60)
    assert sorted(v for _p, v in got["k1"]) == sorted(first)
    consumers["k1"].commit()
    consumers["k2"] = consumer("k2")
    poll_until(
        "the rebalance gave each member one partition",
        step,
        lambda: all(len(c.assignment()) == 1 for c in consumers.values()),
    )
    parts = {name: next(iter(c.assignment())).partition for name, c in consumers.items()}
    second = values(60, "second")
    for v in second:
        producer.send("events", v)
    producer.flush(30)
    producer.close()
    poll_until(
        "the group read the second 60",
        step,
        lambda: sum(1 for recs in got.values() for _p, v in recs if v.startswith(b"second")) >= 60,
    )
    after = [(name, p, v) for name, recs in got.items() for p, v in recs[60 if name == "k1" else 0 :]]
    assert sorted(v for _n, _p, v in after) == sorted(second)
    assert all(p == parts[name] for name, p, _v in after)
    # ListGroups and DescribeGroups, as kafka-python's admin client asks them.
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        listed = admin.list_groups()
        described = admin.describe_groups(["kg"])["kg"]
    finally:
        admin.close()
    assert "kg" in str(listed)
    assert described["group_state"] == "Stable" and len(described["members"]) == 2, described
    for c in consumers.values():
        c.close()


# -- aiokafka ------------------------------------------------------------------------------------------------------


def test_aiokafka_produce_and_consume(bootstrap: str) -> None:
    create_topic(bootstrap, "clicks", 1)
    sent = values(50, "click")

    async def run() -> list[bytes]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
        await producer.start()
        try:
            for v in sent:
                await producer.send("clicks", v)
            await producer.flush()
        finally:
            await producer.stop()
        consumer = aiokafka.AIOKafkaConsumer(
            "clicks", bootstrap_servers=bootstrap, group_id="ag", auto_offset_reset="earliest"
        )
        await consumer.start()
        got: list[bytes] = []
        try:
            async with asyncio.timeout(60):
                while len(got) < len(sent):
                    for _tp, msgs in (await consumer.getmany(timeout_ms=500)).items():
                        got += [m.value for m in msgs]
        finally:
            await consumer.stop()
        return got

    assert asyncio.run(run()) == sent


# -- what the gateway does not serve --------------------------------------------------------------------------------


def _request(sock: socket.socket, api_key: int, version: int, correlation_id: int, body: bytes = b"") -> bytes:
    client = b"raw"
    head = struct.pack(">hhih", api_key, version, correlation_id, len(client)) + client
    if (version >= 3 and api_key == 18) or (version >= 2 and api_key == 43):
        head += b"\x00"  # the flexible request header's empty tagged fields
    frame = head + body
    sock.sendall(struct.pack(">i", len(frame)) + frame)
    return read_frame(sock)


def test_unsupported_requests_get_error_codes_on_an_open_connection(bootstrap: str) -> None:
    host, port = bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # ElectLeaders (43) v2, not served: its own (flexible) response layout, whose error code is
        # UNSUPPORTED_VERSION (35): correlation id, tagged fields, throttle_time_ms, error_code.
        resp = _request(sock, 43, 2, 7, b"\x00\x00")
        assert struct.unpack_from(">ibih", resp) == (7, 0, 0, 35)
        # ApiVersions above the highest version served: a v0 answer with UNSUPPORTED_VERSION and the ranges.
        resp = _request(sock, 18, 9, 8)
        correlation, code, count = struct.unpack_from(">ihi", resp)
        assert (correlation, code) == (8, 35) and count >= 17
        ranges = {
            struct.unpack_from(">hhh", resp, 10 + 6 * i)[0]: struct.unpack_from(">hhh", resp, 10 + 6 * i)[1:]
            for i in range(count)
        }
        assert ranges[0] == (3, 9) and ranges[1] == (4, 12)
        # Produce at a version below the lowest served: its own response type, with the error code.
        resp = _request(sock, 0, 1, 9, b"\xff\xff\x00\x00\x00\x00\x00\x00")
        assert struct.unpack_from(">i", resp) == (9,)
        # The connection still serves: ApiVersions v0 answers with no error.
        resp = _request(sock, 18, 0, 10)
        assert struct.unpack_from(">ih", resp) == (10, 0)
