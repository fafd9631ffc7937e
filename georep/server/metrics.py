"""Prometheus metrics of one node, served at ``/metrics``.

Counters are bumped once per batch, never per record. Partition gauges are
read from the logs at scrape time, so they cost nothing on the hot path and
nothing while nobody scrapes. They are summed per topic unless the node runs
with ``--metrics-partition-detail``: the number of series follows the topics,
not the partitions (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from georep.server.cluster_metrics import ClusterCollector
from georep.server.http_bounds import bound_connections

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.replicator import Replicator
    from georep.server.site_cluster import SiteCluster
    from georep.storage.api import PartitionLog
    from offsets.coordinates import Origin

LINK_STATES = ("connecting", "streaming", "stalled", "down")


class _PartitionCollector(Collector):
    """Per topic by default: a node's series follow its topics, not its partitions (a 10,000-partition topic is
    one series per gauge). ``detail`` adds the per-partition series (``georep node --metrics-partition-detail``).
    Quarantined batches are always per partition, but only for partitions that hold one now."""

    def __init__(self, broker: Broker, detail: Callable[[], bool]) -> None:
        self.broker = broker
        self.detail = detail

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        topics: dict[str, _TopicLogs] = {}
        detail = _PartitionGauges() if self.detail() else None
        quarantined = GaugeMetricFamily(
            "georep_quarantined_batches",
            "Batches quarantined as damaged, served to no one until repaired (partitions that hold one)",
            labels=["topic", "partition"],
        )
        found_total = repaired_total = 0
        for (topic, index), p in sorted(self.broker.partitions.items()):
            log = p.log
            vector = log.vector()
            topics.setdefault(topic, _TopicLogs()).add(log, vector)
            if detail is not None:
                detail.add(topic, index, log, vector)
            damaged = len(log.damaged_batches())
            if damaged:
                quarantined.add_metric([topic, str(index)], damaged)
            found_total += log.damage_found_total
            repaired_total += log.repaired_total
        found = CounterMetricFamily("georep_corrupt_batches", "Damaged batches found (reads, scrubs) since start")
        repaired = CounterMetricFamily("georep_repaired_batches", "Quarantined batches repaired from a peer's copy")
        found.add_metric([], found_total)
        repaired.add_metric([], repaired_total)
        yield from (quarantined, found, repaired)
        yield from _topic_families(topics)
        if detail is not None:
            yield from detail.families()
        disk = GaugeMetricFamily("georep_disk_full", "1 while writes are turned away for lack of disk space")
        disk.add_metric([], 1 if self.broker.disk_full else 0)
        yield disk


class _TopicLogs:
    """One topic's partition logs summed at scrape time."""

    __slots__ = ("end", "partitions", "segments", "size", "unflushed", "vector")

    def __init__(self) -> None:
        self.partitions = self.end = self.size = self.segments = self.unflushed = 0
        self.vector: dict[str, int] = {}

    def add(self, log: PartitionLog, vector: Mapping[Origin, int]) -> None:
        self.partitions += 1
        self.end += log.log_end_offset
        self.size += log.size_bytes
        self.segments += log.segment_count
        self.unflushed += log.log_end_offset - log.flushed_offset
        for origin, seq in vector.items():
            key = str(origin)
            self.vector[key] = self.vector.get(key, 0) + seq


def _topic_families(topics: dict[str, _TopicLogs]) -> Iterator[GaugeMetricFamily]:
    labels = ["topic"]
    count = GaugeMetricFamily("georep_topic_partitions", "Partitions of the topic on this node", labels=labels)
    end = GaugeMetricFamily(
        "georep_topic_log_end_offset", "Sum of the partitions' next local offsets: records appended", labels=labels
    )
    size = GaugeMetricFamily("georep_topic_size_bytes", "Bytes in retained segments", labels=labels)
    segs = GaugeMetricFamily("georep_topic_segments", "Retained segments", labels=labels)
    unflushed = GaugeMetricFamily(
        "georep_topic_unflushed_records", "Records appended but not yet fsynced", labels=labels
    )
    seqs = GaugeMetricFamily(
        "georep_topic_origin_next_seq",
        "Sum over the partitions of the vector offset: records held per origin",
        labels=["topic", "origin"],
    )
    for topic, t in topics.items():
        count.add_metric([topic], t.partitions)
        end.add_metric([topic], t.end)
        size.add_metric([topic], t.size)
        segs.add_metric([topic], t.segments)
        unflushed.add_metric([topic], t.unflushed)
        for origin, seq in sorted(t.vector.items()):
            seqs.add_metric([topic, origin], seq)
    yield from (count, end, size, segs, unflushed, seqs)


class _PartitionGauges:
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

    def families(self) -> Iterator[GaugeMetricFamily]:
        yield from (self.end, self.start, self.size, self.segs, self.unflushed, self.vector)


class _ReplicationCollector(Collector):
    """Inbound links and lags, read from the replicator at scrape time (the apply path bumps plain ints)."""

    def __init__(self, replicator: Replicator, detail: Callable[[], bool]) -> None:
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
        wrong_incarnation = CounterMetricFamily(
            "georep_replication_incarnation_dropped_chunks",
            "Pulled chunks dropped: of a topic incarnation this site does not hold live (a deleted or later one)",
            labels=link_labels,
        )
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
            wrong_incarnation.add_metric(lv, puller.chunks.dropped_chunks)
        lag_records, lag_bytes, lag_seconds = _lag_families(r, self.detail())
        conflicts = GaugeMetricFamily(
            "georep_topic_conflicts", "Topics not replicated over a link: partition counts differ"
        )
        conflicts.add_metric([], len(r.conflicts))
        config_conflicts = CounterMetricFamily(
            "georep_topic_config_conflicts",
            "Concurrent changes of one topic config key at two sites found here (the later stamp is kept everywhere)",
        )
        config_conflicts.add_metric([], r.topic_changes.conflicts_total)
        yield from (state, batches, size, records, skipped, gaps, lag_records, lag_bytes, lag_seconds, conflicts)
        yield from (config_conflicts, wrong_incarnation)


def _lag_families(r: Replicator, detail: bool) -> tuple[GaugeMetricFamily, ...]:
    """Replication lag per (topic, origin): records and bytes summed over the partitions, ms the largest; with
    ``detail``, per (topic, partition, origin). Only origins some partition lags on, or has applied from, appear."""
    labels = ["topic", "partition", "origin"] if detail else ["topic", "origin"]
    lag_records = GaugeMetricFamily(
        "georep_replication_lag_records", "Records the best live upstream holds that this site does not", labels=labels
    )
    lag_bytes = GaugeMetricFamily(
        "georep_replication_lag_bytes", "lag_records times the partition's mean stored bytes per record", labels=labels
    )
    lag_seconds = GaugeMetricFamily(
        "georep_replication_lag_seconds",
        "Last applied batch: local append time minus its max producer timestamp (the largest over the partitions)",
        labels=labels,
    )
    records: dict[tuple[str, ...], int] = {}
    size: dict[tuple[str, ...], float] = {}
    for key in sorted(r.broker.partitions):
        lags = r.links.lag_records(key)
        if not lags:
            continue
        per_record = r.bytes_per_record(*key)
        for origin, lag in lags.items():
            lv: tuple[str, ...] = (key[0], str(key[1]), str(origin)) if detail else (key[0], str(origin))
            records[lv] = records.get(lv, 0) + lag
            size[lv] = size.get(lv, 0.0) + lag * per_record
    ms: dict[tuple[str, ...], int] = {}
    for (topic, index, origin), value in r.lag_ms.items():
        at: tuple[str, ...] = (topic, str(index), str(origin)) if detail else (topic, str(origin))
        ms[at] = max(ms.get(at, value), value)
    for lv in sorted(records):
        lag_records.add_metric(list(lv), records[lv])
        lag_bytes.add_metric(list(lv), round(size[lv]))
    for at in sorted(ms):
        lag_seconds.add_metric(list(at), ms[at] / 1000)
    return lag_records, lag_bytes, lag_seconds


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
        self._replicated_wire_bytes = Counter(
            "georep_replication_sent_wire_bytes",
            "Those batches' bytes as they went: compressed for the trip where the destination took it",
            registry=self.registry,
        )
        self._audit_digests = Counter(
            "georep_audit_digests",
            "Stored batches digested for audits (ScanDigests) on this node",
            registry=self.registry,
        )
        self._audit_digest_bytes = Counter(
            "georep_audit_digest_bytes", "Batch bytes read to digest them for audits", registry=self.registry
        )
        self._audit_paced_seconds = Counter(
            "georep_audit_paced_seconds",
            "Seconds audit scans waited for --audit-digest-rate (all scans together)",
            registry=self.registry,
        )
        # Per deleting site, not per topic: the topic's other series go with it, and these are counted as it goes.
        self._delete_records = Counter(
            "georep_topic_delete_records",
            "Records a topic delete made at another site removed here that this site took after the delete",
            ["site"],
            registry=self.registry,
        )
        self.partition_detail = False  # georep node --metrics-partition-detail: per-partition series too
        self.registry.register(_PartitionCollector(broker, lambda: self.partition_detail))
        self._produced_by_topic: dict[str, tuple[Counter, Counter]] = {}
        broker.on_produce = self.produced

    def produced(self, topic: str, records: int, size: int) -> None:
        # Called per batch; a labels() lookup takes a lock and builds a key, twice per batch: keep each topic's.
        counters = self._produced_by_topic.get(topic)
        if counters is None:
            counters = self._produced_by_topic[topic] = (
                self._produced_records.labels(topic),
                self._produced_bytes.labels(topic),
            )
        counters[0].inc(records)
        counters[1].inc(size)

    def forget_topic(self, topic: str) -> None:
        """A deleted topic's series go (a re-created topic counts from zero)."""
        if self._produced_by_topic.pop(topic, None) is not None:
            self._produced_records.remove(topic)
            self._produced_bytes.remove(topic)

    def delete_records(self, site: str, records: int) -> None:
        """``records`` removed by a delete made at ``site`` had been taken here after it (thread-safe)."""
        self._delete_records.labels(site).inc(records)

    def produce_error(self, code: grpc.StatusCode) -> None:
        self._produce_errors.labels(code.name).inc()

    def fetched(self, size: int) -> None:
        self._fetched_bytes.inc(size)

    def digested(self, batches: int, size: int, waited_s: float) -> None:
        """One step of an audit's digest scan (``georep/server/digest_calls.py``)."""
        self._audit_digests.inc(batches)
        self._audit_digest_bytes.inc(size)
        self._audit_paced_seconds.inc(waited_s)

    def replicated_out(self, size: int) -> None:
        self._replicated_out_bytes.inc(size)

    def replicated_wire(self, size: int) -> None:
        self._replicated_wire_bytes.inc(size)

    def attach(self, replicator: Replicator) -> None:
        self.registry.register(_ReplicationCollector(replicator, lambda: self.partition_detail))

    def attach_cluster(self, site: SiteCluster) -> None:
        """A multi-node site's health and Raft group (``georep/server/cluster_metrics.py``)."""
        self.registry.register(ClusterCollector(site))

    def serve(self, host: str, port: int) -> str:
        """Start the /metrics HTTP server in a daemon thread; returns its address."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound_connections(server)  # georep/server/http_bounds.py: a few connections at once, none for ever
        return f"{host}:{server.server_port}"
