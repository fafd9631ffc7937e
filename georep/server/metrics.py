"""Prometheus metrics of one node, served at ``/metrics``.

Counters are bumped once per batch, never per record. Partition gauges are
read from the logs at scrape time, so they cost nothing on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from georep.server.http_bounds import bound_connections

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.replicator import Replicator

LINK_STATES = ("connecting", "streaming", "stalled", "down")


class _PartitionCollector(Collector):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["topic", "partition"]
        end = GaugeMetricFamily("georep_partition_log_end_offset", "Next local offset to be assigned", labels=labels)
        start = GaugeMetricFamily("georep_partition_log_start_offset", "First retained local offset", labels=labels)
        size = GaugeMetricFamily("georep_partition_size_bytes", "Bytes in retained segments", labels=labels)
        segs = GaugeMetricFamily("georep_partition_segments", "Retained segments", labels=labels)
        unflushed = GaugeMetricFamily(
            "georep_partition_unflushed_records", "Records appended but not yet fsynced", labels=labels
        )
        origin_labels = ["topic", "partition", "origin"]
        vector = GaugeMetricFamily(
            "georep_partition_origin_next_seq", "Vector offset: next origin seq per origin", labels=origin_labels
        )
        for (topic, index), p in sorted(self.broker.partitions.items()):
            lv = [topic, str(index)]
            end.add_metric(lv, p.log.log_end_offset)
            start.add_metric(lv, p.log.log_start_offset)
            size.add_metric(lv, p.log.size_bytes)
            segs.add_metric(lv, p.log.segment_count)
            unflushed.add_metric(lv, p.log.log_end_offset - p.log.flushed_offset)
            for origin, seq in sorted(p.log.vector().items()):
                vector.add_metric([*lv, str(origin)], seq)
        quarantined = GaugeMetricFamily(
            "georep_quarantined_batches",
            "Batches quarantined as damaged, served to no one until repaired",
            labels=labels,
        )
        found = CounterMetricFamily("georep_corrupt_batches", "Damaged batches found (reads, scrubs) since start")
        repaired = CounterMetricFamily("georep_repaired_batches", "Quarantined batches repaired from a peer's copy")
        found_total = repaired_total = 0
        for (topic, index), p in sorted(self.broker.partitions.items()):
            quarantined.add_metric([topic, str(index)], len(p.log.damaged_batches()))
            found_total += p.log.damage_found_total
            repaired_total += p.log.repaired_total
        found.add_metric([], found_total)
        repaired.add_metric([], repaired_total)
        yield from (quarantined, found, repaired)
        disk = GaugeMetricFamily("georep_disk_full", "1 while writes are turned away for lack of disk space")
        disk.add_metric([], 1 if self.broker.disk_full else 0)
        yield from (end, start, size, segs, unflushed, vector, disk)


class _ReplicationCollector(Collector):
    """Inbound links and lags, read from the replicator at scrape time (the apply path bumps plain ints)."""

    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator

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
        origin_labels = ["topic", "partition", "origin"]
        lag_records = GaugeMetricFamily(
            "georep_replication_lag_records",
            "Records the best live upstream holds that this site does not",
            labels=origin_labels,
        )
        lag_bytes = GaugeMetricFamily(
            "georep_replication_lag_bytes",
            "lag_records times the partition's mean stored bytes per record",
            labels=origin_labels,
        )
        lag_ms = GaugeMetricFamily(
            "georep_replication_lag_ms",
            "Last applied batch: local append time minus its max producer timestamp",
            labels=origin_labels,
        )
        for key in sorted(r.broker.partitions):
            per_record = r.bytes_per_record(*key)
            for origin, lag in sorted(r.links.lag_records(key).items()):
                lag_records.add_metric([key[0], str(key[1]), str(origin)], lag)
                lag_bytes.add_metric([key[0], str(key[1]), str(origin)], round(lag * per_record))
        for (topic, index, origin), ms in sorted(r.lag_ms.items()):
            lag_ms.add_metric([topic, str(index), str(origin)], ms)
        conflicts = GaugeMetricFamily(
            "georep_topic_conflicts", "Topics not replicated over a link: partition counts differ"
        )
        conflicts.add_metric([], len(r.conflicts))
        yield from (state, batches, size, records, skipped, gaps, lag_records, lag_bytes, lag_ms, conflicts)


class NodeMetrics:
    def __init__(self, broker: Broker) -> None:
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
        self.registry.register(_PartitionCollector(broker))
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
        self.registry.register(_ReplicationCollector(replicator))

    def serve(self, host: str, port: int) -> str:
        """Start the /metrics HTTP server in a daemon thread; returns its address."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound_connections(server)  # georep/server/http_bounds.py: a few connections at once, none for ever
        return f"{host}:{server.server_port}"
