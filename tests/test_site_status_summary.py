"""Issue 22, "status and metrics that walk everything": ``SiteStatus`` answers a summary per topic by default, and
per-partition rows only when asked, by topic and by page; ``georep status`` compares topics by vector digest."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.cli.status import converged_counts, differing_topics
from georep.proto import georep_pb2 as pb
from georep.record.batch import RecordInput, encode_batch
from georep.server.broker import Broker
from georep.server.metrics import NodeMetrics
from georep.server.service import NodeService
from georep.storage.metadata_file import load_or_create_identity

PARTITIONS = 30


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic("big", PARTITIONS, {})
    b.create_topic("small", 2, {})
    for index in range(PARTITIONS):
        b.append("big", index, encode_batch([RecordInput(key=None, value=b"v", headers=(), timestamp_ms=1_000)]))
    yield b
    b.close()


def ask(broker: Broker, **fields: object) -> pb.SiteStatusResponse:
    service = NodeService(broker, NodeMetrics(broker))
    data = pb.SiteStatusRequest(**fields).SerializeToString()  # type: ignore[arg-type]
    return asyncio.run(service.site_status(data, None))  # type: ignore[arg-type]


def test_the_default_answer_is_one_summary_per_topic_not_a_row_per_partition(broker: Broker) -> None:
    status = ask(broker)
    assert len(status.partitions) == 0
    big = {t.topic: t for t in status.topics}["big"]
    assert big.partitions == PARTITIONS and big.log_end_offset == PARTITIONS and big.damaged_batches == 0


def test_partition_rows_come_by_topic_and_page_without_gap_or_repeat(broker: Broker) -> None:
    rows: list[tuple[str, int]] = []
    after: dict[str, object] = {}
    for _ in range(PARTITIONS):
        page = ask(broker, partitions=True, topic="big", page_size=7, **after)
        rows += [(p.topic, p.partition) for p in page.partitions]
        if not page.more_partitions:
            break
        after = {"after_topic": rows[-1][0], "after_partition": rows[-1][1]}
    assert rows == [("big", i) for i in range(PARTITIONS)]
    assert [t.topic for t in ask(broker, topic="small").topics] == ["small"]


def test_status_looks_at_partitions_only_of_topics_whose_digests_differ(broker: Broker) -> None:
    here = ask(broker)
    there = pb.SiteStatusResponse()
    there.CopyFrom(here)
    statuses: dict[str, pb.SiteStatusResponse | str] = {"a": here, "b": there}
    assert differing_topics(statuses) == [] and converged_counts(statuses, {}) == (PARTITIONS + 2, PARTITIONS + 2, [])
    broker.append("big", 4, encode_batch([RecordInput(key=None, value=b"w", headers=(), timestamp_ms=1_000)]))
    changed = ask(broker)
    statuses["a"] = changed
    assert differing_topics(statuses) == ["big"]
    rows_a = ask(broker, partitions=True, topic="big")
    rows_b = pb.SiteStatusResponse()
    rows_b.CopyFrom(rows_a)
    rows_b.partitions[4].vector.entries[0].next_seq -= 1  # b is one record behind on partition 4
    drilled: dict[str, pb.SiteStatusResponse | str] = {"a": rows_a, "b": rows_b}
    assert converged_counts(statuses, {"big": drilled}) == (PARTITIONS + 1, PARTITIONS + 2, [("big", 4)])
