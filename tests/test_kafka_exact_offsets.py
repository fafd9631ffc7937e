"""Exact Kafka offsets at every site (issue 23): a group commits at site a, and at site b ``committed()`` is the
exact local offset of the first record the commit does not cover, so an "assign, seek to committed(), poll"
reader (Flink's and Spark's pattern, and lag tools' number) reads exactly the records the commit does not cover,
with confluent-kafka and no help from a per-client filter."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until
from tests.support.sites import Sites, converged, wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.slow

TOPIC = "orders"
RECORDS = 1_000
COMMITTED = 400


def produce_in_few_batches(bootstrap: str) -> None:
    """1,000 records in as few batches as librdkafka makes in one linger, so offset 400 lies inside a batch."""
    p = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 500, "batch.num.messages": RECORDS}
    )
    for i in range(RECORDS):
        p.produce(TOPIC, value=b"v%d" % i, partition=0)
    assert p.flush(30) == 0


def test_committed_at_another_site_is_the_exact_offset_and_a_seeking_reader_reads_only_what_it_does_not_cover(
    make_sites: Callable[..., Sites],
) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")], extra_args=[*KAFKA_ARGS, "--kafka-commit-acks", "geo:2"])
    sites.start()
    at_a, at_b = kafka_address(sites.nodes["a"]), kafka_address(sites.nodes["b"])
    admin = AdminClient({"bootstrap.servers": at_a})
    admin.create_topics([NewTopic(TOPIC, 1, 1)])[TOPIC].result(15)
    produce_in_few_batches(at_a)
    wait_until("b holds every record", lambda: converged(sites, ["a", "b"], TOPIC, RECORDS))

    group = {"group.id": "billing", "enable.auto.commit": False, "auto.offset.reset": "earliest"}
    committer = confluent_kafka.Consumer({"bootstrap.servers": at_a, "client.id": "committer", **group})
    committer.commit(offsets=[TopicPartition(TOPIC, 0, COMMITTED)], asynchronous=False)  # geo:2: b holds it
    committer.close()

    # b holds a's records in a's order (one origin), so the first uncovered record is at 400 there too.
    looker = confluent_kafka.Consumer({"bootstrap.servers": at_b, "client.id": "lag-tool", **group})
    [tp] = looker.committed([TopicPartition(TOPIC, 0)], timeout=30)
    looker.close()
    assert tp.error is None
    assert tp.offset == COMMITTED, f"committed() at b is {tp.offset}, not the first uncovered record's offset"

    # Another client (no OffsetFetch of its own, so no filter): assign at that offset and read to the end.
    reader = confluent_kafka.Consumer(
        {"bootstrap.servers": at_b, "client.id": "flink-task", "group.id": "reader", "enable.auto.commit": False}
    )
    reader.assign([TopicPartition(TOPIC, 0, tp.offset)])
    got: list[bytes] = []

    def step() -> None:
        msg = reader.poll(0.5)
        if msg is not None and msg.error() is None:
            got.append(msg.value())

    try:
        poll_until("the reader reached the end", step, lambda: len(got) >= RECORDS - COMMITTED, timeout_s=60)
        for _ in range(4):  # anything more would be a record delivered twice
            step()
    finally:
        reader.close()
    assert got == [b"v%d" % i for i in range(COMMITTED, RECORDS)]
