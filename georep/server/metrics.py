"""Prometheus metrics of one node, served at ``/metrics``.

Counters are bumped once per batch, never per record. Partition gauges are
read from the logs at scrape time, so they cost nothing on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from georep.server.http_bounds import bound_connections

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.replicator import Replicator
    from georep.storage.api import PartitionLog
    from offsets.coordinates import Origin

LINK_STATES = ("connecting", "streaming", "stalled", "down")


class _PartitionCollector(Collector):
    """Partition gauges, summed per topic; per partition only with ``detail`` (``--metrics-partition-detail``).

    Per-partition series are what breaks a Prometheus server at 10,000 partitions a node (Kafka's exporters
    aggregate by default for the same reason), so by default a scrape's size follows the topics, not the
    partitions. Two series stay per partition because they are rare by nature: ``georep_quarantined_batches`` for
    partitions that hold damage, and (in :class:`_ReplicationCollector`) the lag of partitions that lag.
    """

    def __init__(self, broker: Broker, detail: bool) -> None:
        self.broker = broker
        self.detail = detail

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        topics: dict[str, list[int]] = {}  # partitions, log end sum, size, segments, unflushed, quarantined
        origins: dict[tuple[str, str], int] = {}
        detail = _PartitionDetail() if self.detail else None
        quarantined = GaugeMetricFamily(
            "georep_quarantined_batches",
            "Batches quarantined as damaged, served to no one until repaired (partitions holding some)",
            labels=["topic", "partition"],
        )
        found_total = repaired_total = 0
        for (topic, index), p in sorted(self.broker.partitions.items()):
            log = p.log
            damaged = len(log.damaged_batches())
            row = topics.setdefault(topic, [0, 0, 0, 0, 0, 0])
            unflushed = log.log_end_offset - log.flushed_offset
            for i, value in enumerate((1, log.log_end_offset, log.size_bytes, log.segment_count, unflushed, damaged)):
                row[i] += value
            vector = log.vector()
            for origin, seq in vector.items():
                origins[(topic, str(origin))] = origins.get((topic, str(origin)), 0) + seq
            if damaged:
                quarantined.add_metric([topic, str(index)], damaged)
            if detail is not None:
                detail.add(topic, index, log, vector)
            found_total += log.damage_found_total
            repaired_total += log.repaired_total
        yield from _topic_families(topics, origins)
        found = CounterMetricFamily("georep_corrupt_batches", "Damaged batches found (reads, scrubs) since start")
        repaired = CounterMetricFamily("georep_repaired_batches", "Quarantined batches repaired from a peer's copy")
        found.add_metric([], found_total)
        repaired.add_metric([], repaired_total)
        yield from (quarantined, found, repaired)
        if detail is not None:
            yield from detail.families()
        disk = GaugeMetricFamily("georep_disk_full", "1 while writes are turned away for lack of disk space")
        disk.add_metric([], 1 if self.broker.disk_full else 0)
        yield disk


_TOPIC_GAUGES = (
    ("georep_topic_partitions", "Partitions of the topic this node holds"),
    ("georep_topic_log_end_offset", "Sum over the topic's partitions of the next local offset"),
    ("georep_topic_size_bytes", "Bytes in retained segments"),
    ("georep_topic_segments", "Retained segments"),
    ("georep_topic_unflushed_records", "Records appended but not yet fsynced"),
    ("georep_topic_quarantined_batches", "Batches quarantined as damaged, served to no one until repaired"),
)


def _topic_families(topics: dict[str, list[int]], origins: dict[tuple[str, str], int]) -> Iterator[GaugeMetricFamily]:
    families = [GaugeMetricFamily(name, text, labels=["topic"]) for name, text in _TOPIC_GAUGES]
    for topic, row in topics.items():
        for family, value in zip(families, row, strict=True):
            family.add_metric([topic], value)
    held = GaugeMetricFamily(
        "georep_topic_origin_records",
        "Records of each origin the topic holds here: the sum of its partitions' vector offsets",
        labels=["topic", "origin"],
    )
    for (topic, origin), total in sorted(origins.items()):
        held.add_metric([topic, origin], total)
    yield from (*families, held)


class _PartitionDetail:
    """The per-partition series of ``--metrics-partition-detail``."""

    def __init__(self) -> None:
        labels = ["topic", "partition"]
        self.end = GaugeMetricFamily(
            "georep_partition_log_end_offset", "Next local offset to be assigned", labels=labels
        )
        self.start = GaugeMetricFamily(
            "georep_partition_log_start_offset", "First retained local offset", labels=labels
        )
        self.size = GaugeMetricFamily("georep_partition_size_bytes", "Bytes in retained segments", labels=labels)
        self.segs = GaugeMetricFamily("georep_partition_segments", "Retained segments", labels=labels)
        self.unflushed = GaugeMetricFamily(
            "georep_partition_unflushed_records", "Records appended but not yet fsynced", labels=labels
        )
        self.vector = GaugeMetricFamily(
            "georep_partition_origin_next_seq",
            "Vector offset: next origin seq per origin",
            labels=["topic", "partition", "origin"],
        )

    def add(self, topic: str, index: int, log: PartitionLog, vector: Mapping[Origin, int]) -> None:
        lv = [topic, str(index)]
        self.end.add_metric(lv, log.log_end_offset)
        self.start.add_metric(lv, log.log_start_offset)
        self.size.add_metric(lv, log.size_bytes)
        self.segs.add_metric(lv, log.segment_count)
        self.unflushed.add_metric(lv, log.log_end_offset - log.flushed_offset)
        for origin, seq in sorted(vector.items()):
            self.vector.add_metric([*lv, str(origin)], seq)

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return (self.end, self.start, self.size, self.segs, self.unflushed, self.vector)


class _ReplicationCollector(Collector):
    """Inbound links and lags, read from the replicator at scrape time (the apply path bumps plain ints)."""

    def __init__(self, replicator: Replicator, detail: bool) -> None:
        self.replicator = replicator
        self.detail = detail

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self.replicator
        link_labels = ["src", "dst"]
        state = GaugeMetricFamily(
            "georep_link_state",
            "1 for the inbound link's current state, 0 for the others",
            labels=[*link_labels, "state"],
        )
        batches = CounterMetricFamily(
            "georep_replication_applied_batches", "Replicated batches appended", labels=link_labels
        )
        size = CounterMetricFamily(
            "georep_replication_applied_bytes", "Replicated batch bytes appended", labels=link_labels
        )
        records = CounterMetricFamily(
            "georep_replication_applied_records", "Replicated records appended", labels=link_labels
        )
        skipped = CounterMetricFamily(
            "georep_replication_skipped_batches",
            "Replicated batches already held (cycles, resends)",
            labels=link_labels,
        )
        gaps = CounterMetricFamily("georep_replication_gaps", "Streams reopened on a gap", labels=link_labels)
        for src, puller in sorted(r.pullers.items()):
            lv = [src, r.site]
            current = r.link_state(src)
            for s in LINK_STATES:
                state.add_metric([*lv, s], 1 if s == current else 0)
            st = puller.stats
            batches.add_metric(lv, st.applied_batches)
            size.add_metric(lv, st.applied_bytes)
            records.add_metric(lv, st.applied_records)
            skipped.add_metric(lv, st.skipped_batches)
            gaps.add_metric(lv, st.gaps)
        lags = _Lags(self.detail)
        for key in sorted(r.broker.partitions):
            lags.add_records(key, r.links.lag_records(key), r.bytes_per_record(*key))
        for (topic, index, origin), ms in sorted(r.lag_ms.items()):
            lags.add_ms(topic, index, str(origin), ms)
        conflicts = GaugeMetricFamily(
            "georep_topic_conflicts", "Topics not replicated over a link: partition counts differ"
        )
        conflicts.add_metric([], len(r.conflicts))
        yield from (state, batches, size, records, skipped, gaps)
        yield from lags.families()
        yield conflicts


class _Lags:
    """Replication lag: per topic and origin always; per partition for the partitions that lag (every partition
    with ``detail``), as Kafka's lag exporters keep only the partitions behind."""

    def __init__(self, detail: bool) -> None:
        self.detail = detail
        labels = ["topic", "partition", "origin"]
        self.records = GaugeMetricFamily(
            "georep_replication_lag_records",
            "Records the best live upstream holds that this site does not",
            labels=labels,
        )
        self.bytes = GaugeMetricFamily(
            "georep_replication_lag_bytes",
            "lag_records times the partition's mean stored bytes per record",
            labels=labels,
        )
        self.ms = GaugeMetricFamily(
            "georep_replication_lag_ms",
            "Last applied batch: local append time minus its max producer timestamp",
            labels=labels,
        )
        self.topic_records: dict[tuple[str, str], int] = {}
        self.topic_ms: dict[tuple[str, str], int] = {}

    def add_records(self, key: tuple[str, int], lags: Mapping[Origin, int], per_record: float) -> None:
        for origin, lag in sorted(lags.items()):
            tk = (key[0], str(origin))
            self.topic_records[tk] = self.topic_records.get(tk, 0) + lag
            if lag or self.detail:
                self.records.add_metric([key[0], str(key[1]), str(origin)], lag)
                self.bytes.add_metric([key[0], str(key[1]), str(origin)], round(lag * per_record))

    def add_ms(self, topic: str, index: int, origin: str, ms: int) -> None:
        self.topic_ms[(topic, origin)] = max(self.topic_ms.get((topic, origin), 0), ms)
        if self.detail:
            self.ms.add_metric([topic, str(index), origin], ms)

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        labels = ["topic", "origin"]
        records = GaugeMetricFamily(
            "georep_topic_replication_lag_records", "Sum of the topic's partitions' lag_records", labels=labels
        )
        ms = GaugeMetricFamily(
            "georep_topic_replication_lag_ms", "The largest lag_ms of the topic's partitions", labels=labels
        )
        for (topic, origin), total in sorted(self.topic_records.items()):
            records.add_metric([topic, origin], total)
        for (topic, origin), worst in sorted(self.topic_ms.items()):
            ms.add_metric([topic, origin], worst)
        return (records, ms, self.records, self.bytes, self.ms)


class NodeMetrics:
    def __init__(self, broker: Broker, partition_detail: bool = False) -> None:
        self.partition_detail = partition_detail
        self.registry = CollectorRegistry()
        self._produced_records = Counter(
            "georep_produced_records", "Records accepted from producers", ["topic"], registry=self.registry
        )
        self._produced_bytes = Counter(
            "georep_produced_bytes", "Batch bytes accepted from producers", ["topic"], registry=self.registry
        )
        self._produce_errors = Counter(
            "georep_produce_errors", "Produce requests refused, by gRPC status", ["code"], registry=self.registry
        )
        self._fetched_bytes = Counter("georep_fetched_bytes", "Batch bytes sent to fetchers", registry=self.registry)
        self._replicated_out_bytes = Counter(
            "georep_replication_sent_bytes", "Batch bytes sent to downstream sites", registry=self.registry
        )
        self.registry.register(_PartitionCollector(broker, partition_detail))
        broker.on_produce = self.produced

    def produced(self, topic: str, records: int, size: int) -> None:
        self._produced_records.labels(topic).inc(records)
        self._produced_bytes.labels(topic).inc(size)

    def produce_error(self, code: grpc.StatusCode) -> None:
        self._produce_errors.labels(code.name).inc()

    def fetched(self, size: int) -> None:
        self._fetched_bytes.inc(size)

    def replicated_out(self, size: int) -> None:
        self._replicated_out_bytes.inc(size)

    def attach(self, replicator: Replicator) -> None:
        self.registry.register(_ReplicationCollector(replicator, self.partition_detail))

    def serve(self, host: str, port: int) -> str:
        """Start the /metrics HTTP server in a daemon thread; returns its address."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound_connections(server)  # georep/server/http_bounds.py: a few connections at once, none for ever
        return f"{host}:{server.server_port}"
