"""Wildcard subscriptions (issue 25): a consumer, a group, ``georep consume`` and a Kafka client read every topic a
pattern matches, existing and created later; a pattern group fails over between sites and resumes exactly."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.client.consumer import Consumer
from georep.client.errors import InvalidRequest
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from tests.support.cli import georep
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.sites import Sites, wait_until

REFRESH_MS = 200  # metadata_max_age_ms: how soon a new matching topic is read


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    net = Sites(tmp_path_factory.mktemp("patterns"), ["a", "b"], [("a", "b"), ("b", "a")], extra_args=KAFKA_ARGS)
    try:
        net.start()
        yield net
    finally:
        net.close()


def _create(sites: Sites, *names: str, partitions: int = 2) -> None:
    for name in names:
        sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=name, partitions=partitions), timeout=10)
    wait_until("b has the topics", lambda: all(_known(sites, "b", n) for n in names))


def _known(sites: Sites, site: str, name: str) -> bool:
    try:
        sites.stub(site).DescribeTopic(pb.DescribeTopicRequest(name=name), timeout=5)
    except Exception:
        return False
    return True


async def _produce(address: str, values: dict[str, list[str]]) -> None:
    async with Producer(address, linger_ms=1) as producer:
        futures = [producer.send(t, v.encode(), key=v.encode()) for t, vs in values.items() for v in vs]
        await asyncio.gather(*futures)


async def _read(consumer: Consumer, n: int, timeout_s: float = 30.0) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += [(r.topic, (r.value or b"").decode()) for r in await consumer.poll(timeout_ms=200)]
    return out


def test_a_pattern_reads_every_matching_topic_and_one_created_later(sites: Sites) -> None:
    _create(sites, "p1/eu/a", "p1/us/b", "p1x/c")
    asyncio.run(_produce(sites.address("a"), {"p1/eu/a": ["a0", "a1"], "p1/us/b": ["b0"], "p1x/c": ["c0"]}))

    async def run() -> list[tuple[str, str]]:
        consumer = Consumer(sites.address("a"), auto_offset_reset="earliest", metadata_max_age_ms=REFRESH_MS)
        async with consumer:
            consumer.subscribe(pattern="p1/**")
            first = await _read(consumer, 3)
            _create(sites, "p1/eu/new")
            await _produce(sites.address("a"), {"p1/eu/new": ["n0", "n1"]})
            return first + await _read(consumer, 2)

    got = asyncio.run(run())
    assert sorted(got) == [
        ("p1/eu/a", "a0"),
        ("p1/eu/a", "a1"),
        ("p1/eu/new", "n0"),
        ("p1/eu/new", "n1"),
        ("p1/us/b", "b0"),
    ]


@pytest.mark.slow  # node processes through several steps: make test runs it, test-quick does not
def test_a_pattern_group_rebalances_over_a_new_topic_and_fails_over_to_another_site_exactly(sites: Sites) -> None:
    _create(sites, "p2/x")
    asyncio.run(_produce(sites.address("a"), {"p2/x": [f"x{i}" for i in range(10)]}))

    def member(site: str) -> Consumer:
        return Consumer(
            sites.address(site),
            group_id="pattern-group",
            auto_offset_reset="earliest",
            metadata_max_age_ms=REFRESH_MS,
            session_timeout_ms=6000,
            enable_auto_commit=False,
        )

    async def at_a() -> list[tuple[str, str]]:
        async with member("a") as consumer:
            consumer.subscribe(pattern="p2/**")
            got = await _read(consumer, 10)
            _create(sites, "p2/y")
            await _produce(sites.address("a"), {"p2/y": ["y0", "y1"]})
            got += await _read(consumer, 2)
            await consumer.commit()
            return got

    first = asyncio.run(at_a())
    assert sorted(v for _t, v in first) == sorted([f"x{i}" for i in range(10)] + ["y0", "y1"]), first
    asyncio.run(_produce(sites.address("a"), {"p2/x": ["x10"], "p2/y": ["y2"]}))
    wait_until(
        "b holds the new records", lambda: sum(n for v in sites.vectors("b", "p2/y").values() for n in v.values()) == 3
    )

    async def at_b() -> list[tuple[str, str]]:
        async with member("b") as consumer:
            consumer.subscribe(pattern="p2/**")
            got = await _read(consumer, 2)
            got += await _read(consumer, 1, timeout_s=2)  # nothing more: no record comes twice
            return got

    assert sorted(asyncio.run(at_b())) == [("p2/x", "x10"), ("p2/y", "y2")]


def test_georep_consume_takes_a_pattern_and_names_each_records_topic(sites: Sites) -> None:
    _create(sites, "p3/a", "p3/b")
    asyncio.run(_produce(sites.address("a"), {"p3/a": ["one"], "p3/b": ["two"]}))
    out = georep("consume", "p3/+", "--bootstrap", sites.address("a"), "--from-beginning", "--max", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert sorted((r["topic"], r["value"]) for r in map(json.loads, out.stdout.decode().splitlines())) == [
        ("p3/a", "one"),
        ("p3/b", "two"),
    ]
    refused = georep("consume", "p3/+", "--bootstrap", sites.address("a"), "--partition", "0", "--max", "1")
    assert refused.returncode != 0 and b"is a pattern" in refused.stderr, refused.stderr


def test_a_subscription_names_topics_or_a_pattern_not_both(sites: Sites) -> None:
    consumer = Consumer(sites.address("a"))
    with pytest.raises(InvalidRequest, match="not both"):
        consumer.subscribe(["t"], pattern="t/**")
    with pytest.raises(InvalidRequest, match="wildcard"):
        consumer.subscribe(pattern="orders*")


@pytest.mark.slow  # node processes through several steps: make test runs it, test-quick does not
def test_a_kafka_regex_subscription_reads_the_matching_topics(sites: Sites, tmp_path: Path) -> None:
    confluent_kafka = pytest.importorskip("confluent_kafka")
    _create(sites, "p4/a", "p4/b", "p5/c")
    asyncio.run(_produce(sites.address("a"), {"p4/a": ["a"], "p4/b": ["b"], "p5/c": ["c"]}))
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": kafka_address(sites.nodes["a"]),
            "group.id": "kafka-regex",
            "auto.offset.reset": "earliest",
            "topic.metadata.refresh.interval.ms": 500,
        }
    )
    try:
        consumer.subscribe(["^p4/.*"])
        got: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append((msg.topic(), msg.value().decode()))
        assert sorted(got) == [("p4/a", "a"), ("p4/b", "b")]
    finally:
        consumer.close()


def test_a_listing_for_a_pattern_carries_only_the_matching_topics(sites: Sites) -> None:
    _create(sites, "p6/a", "p6/b/c", "p7/a")
    stub = sites.stub("a")
    for request in (
        pb.ListTopicsRequest(pattern="p6/**", view=pb.TOPIC_VIEW_DEFINITION),
        pb.ListTopicsRequest(pattern="p6/**", view=pb.TOPIC_VIEW_DEFINITION, changed_since=""),
    ):
        listed = stub.ListTopics(request, timeout=10)
        assert sorted(t.name for t in listed.topics) == ["p6/a", "p6/b/c"], listed
    with pytest.raises(grpc.RpcError, match="wildcard"):
        stub.ListTopics(pb.ListTopicsRequest(pattern="p6*"), timeout=10)


def test_one_cancelled_stream_is_opened_again_without_replacing_the_channel_of_the_others(
    sites: Sites, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer reads each partition on its own stream over one channel. A stream that ends CANCELLED (a call
    cancelled, not the node lost: that is UNAVAILABLE) is opened again; it once reconnected the channel, which
    cancelled every other stream, each of which reconnected in turn (a wildcard consumer of 10,000 topics read 203
    records/s; bench/first_use.py --lone-only)."""
    import georep.client.fetcher as fetcher_module

    names = [f"pcancel/t{i}" for i in range(6)]
    _create(sites, *names, partitions=1)
    asyncio.run(_produce(sites.address("a"), {n: [f"{n}-0"] for n in names}))
    real_read = fetcher_module._PartitionFetch._read
    cancelled: list[str] = []

    async def read_once_cancelled(self: fetcher_module._PartitionFetch, call: object, *args: object) -> bool:
        if self.state.tp[0] == "pcancel/t3" and not cancelled:
            cancelled.append(self.state.tp[0])
            meta = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, meta, meta, details="Locally cancelled")
        return await real_read(self, call, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fetcher_module._PartitionFetch, "_read", read_once_cancelled)

    async def run() -> tuple[list[tuple[str, str]], int, int]:
        async with Consumer(sites.address("a"), auto_offset_reset="earliest", metadata_max_age_ms=REFRESH_MS) as c:
            c.subscribe(pattern="pcancel/**")
            await c._connection.connect()
            generation = c._connection.generation  # before any stream opens
            return await _read(c, len(names)), generation, c._connection.generation

    got, before, after = asyncio.run(run())
    assert cancelled == ["pcancel/t3"]
    assert sorted(got) == sorted((n, f"{n}-0") for n in names)
    assert after == before  # the channel every other stream was on stayed
