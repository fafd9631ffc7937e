"""Issue 22, "Metrics": a scrape's series follow the topics, not the partitions, unless the node asks for
per-partition detail (``georep node --metrics-partition-detail``)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from georep.record.batch import RecordInput, encode_batch
from georep.server.broker import Broker
from georep.server.metrics import NodeMetrics
from georep.storage.metadata_file import load_or_create_identity


def series(metrics: NodeMetrics) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def scrape(tmp_path: Path, partitions: int, detail: bool) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    try:
        broker.create_topic("t", partitions, {})
        for index in range(partitions):
            broker.append("t", index, encode_batch([RecordInput(key=None, value=b"v", headers=(), timestamp_ms=1_000)]))
        metrics = NodeMetrics(broker)
        metrics.partition_detail = detail
        return series(metrics)
    finally:
        broker.close()


def test_series_do_not_grow_with_the_partition_count_by_default(tmp_path: Path) -> None:
    few, many = scrape(tmp_path / "few", 2, False), scrape(tmp_path / "many", 40, False)
    assert len(few) == len(many), sorted(set(many) - set(few))[:10]
    size = [line for line in many if line.startswith("georep_topic_size_bytes{")]
    assert len(size) == 1 and float(size[0].rsplit(" ", 1)[1]) > 0  # the 40 partitions summed into one series
    assert any(line.startswith('georep_topic_partitions{topic="t"} 40') for line in many)


def test_the_detail_flag_gives_one_series_per_partition_back(tmp_path: Path) -> None:
    many = scrape(tmp_path, 40, True)
    ends = [line for line in many if line.startswith("georep_partition_log_end_offset{")]
    assert len(ends) == 40 and all(line.endswith(" 1.0") for line in ends)
