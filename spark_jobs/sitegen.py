"""Synthetic site data dirs, written straight through the storage layer, as replication leaves them.

For the audit's benchmark and unit tests: each site writes its own records as
their origin, and every site then holds every origin's batches, byte for byte
(only the 24-byte local prefix differs), appended in an interleaved order with
a replication delay. Faster than going through gRPC by orders of magnitude.

:func:`to_cluster_site` turns such a site into a multi-node one, as its
segment cluster stores it: each partition a chain of segments, each segment
copied byte for byte onto the nodes of its ensemble.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from georep.record.batch import RecordInput, encode_batch, parse_header
from georep.record.compression import Compression
from georep.storage.api import LogConfig
from georep.storage.partition_dirs import parse_partition_dir, partition_dir_name
from georep.storage.replica_store import REPLICA_LOG_CONFIG, REPLICAS_DIR
from georep.storage.replica_store import partition_dir_name as replica_dir_name
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin, OriginSeq
from spark_jobs.layout import LOGS_DIR, SITE_FILE
from topology.ids import SiteId

EPOCH = 1
T0_MS = 1_700_000_000_000


@dataclass(frozen=True, slots=True)
class SiteSpec:
    topic: str = "orders"
    partitions: int = 2
    records_per_origin: int = 1_000  # per partition
    batch_records: int = 50
    value_bytes: int = 40
    compression: Compression = Compression.NONE
    segment_bytes_max: int = 1 << 30
    delay_ms: int = 25  # replica append time minus origin append time, per hop


def origin_batches(site: str, spec: SiteSpec, partition: int) -> list[tuple[int, bytes]]:
    """(origin append time, batch) for every batch ``site`` writes as origin to ``partition``."""
    origin = Origin(SiteId(site), EPOCH)
    pad = b"x" * max(0, spec.value_bytes - 16)
    out = []
    for base in range(0, spec.records_per_origin, spec.batch_records):
        n = min(spec.batch_records, spec.records_per_origin - base)
        ts = T0_MS + base
        records = [
            RecordInput(
                b"k%d" % ((base + i) % 997), b"%s-%d-%d-" % (site.encode(), partition, base + i) + pad, (), ts + i
            )
            for i in range(n)
        ]
        out.append((ts + 5, encode_batch(records, compression=spec.compression, origin=origin, base_origin_seq=base)))
    return out


def write_sites(root: Path, sites: list[str], spec: SiteSpec) -> dict[str, Path]:
    """``root/<site>`` for each site, every one holding every origin's batches; returns the site dirs."""
    dirs = {}
    per_origin = {(s, p): origin_batches(s, spec, p) for s in sites for p in range(spec.partitions)}
    config = LogConfig(segment_bytes_max=spec.segment_bytes_max, flush_interval_ms=1 << 30)
    for site in sites:
        site_dir = root / site
        dirs[site] = site_dir
        (site_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        (site_dir / SITE_FILE).write_text(json.dumps({"version": 1, "site": site, "epoch": EPOCH}))
        for p in range(spec.partitions):
            log = SegmentLog.open(site_dir / LOGS_DIR / partition_dir_name(spec.topic, p), config, T0_MS)
            # Interleave origins batch by batch, as concurrent pulls would.
            streams = [per_origin[(o, p)] for o in sites]
            for i in range(max(len(s) for s in streams)):
                for o, stream in zip(sites, streams, strict=True):
                    if i < len(stream):
                        appended, batch = stream[i]
                        delay = 0 if o == site else spec.delay_ms * (1 + (sites.index(site) + i) % 3)
                        log.append(parse_header(batch), [memoryview(batch)[24:]], appended + delay)
            log.close()
    return dirs


Ensembles = dict[tuple[str, int], list[list[str]]]  # (topic, partition) -> each segment's nodes, by segment id


def segment_dir(site_dir: Path, node: str, topic: str, partition: int, segment_id: int) -> Path:
    """A node's copy of a segment in a multi-node site's dir (georep/storage/replica_store.py's layout)."""
    return site_dir / node / REPLICAS_DIR / replica_dir_name((topic, partition)) / f"{segment_id:010d}"


def to_cluster_site(site_dir: Path, nodes: list[str], replication_factor: int, segment_batches: int) -> Ensembles:
    """Rewrite a one-node site dir (:func:`write_sites`) as a multi-node site's, ``site_dir/<node>/replicas/...``.

    Each partition's log is cut into segments of ``segment_batches`` batches, segment ids 0, 1, ...; segment ``i``
    goes to the ``replication_factor`` nodes from ``nodes[i % len(nodes)]`` on, each copy a ``SegmentLog`` from the
    segment's base offset and start vector holding the log's batches as they were, local prefix included. The
    one-node log is removed. Returns each segment's ensemble.
    """
    from spark_jobs.inject import read_partition

    ensembles: Ensembles = {}
    logs = site_dir / LOGS_DIR
    for part_dir in sorted(p for p in logs.iterdir() if p.is_dir()):
        parsed = parse_partition_dir(part_dir.name)
        if parsed is None:
            continue
        topic, partition = parsed
        stored = read_partition(part_dir)
        vector: dict[Origin, OriginSeq] = {}
        chain = ensembles[parsed] = []
        for sid, first in enumerate(range(0, len(stored), segment_batches)):
            chunk = stored[first : first + segment_batches]
            base = parse_header(chunk[0][1]).base_offset
            ensemble = [nodes[(sid + k) % len(nodes)] for k in range(replication_factor)]
            chain.append(ensemble)
            for node in ensemble:
                copy = SegmentLog.create_at(
                    segment_dir(site_dir, node, topic, partition, sid), REPLICA_LOG_CONFIG, base, vector, T0_MS
                )
                for appended, batch in chunk:
                    copy.append(parse_header(batch), [memoryview(batch)[24:]], appended)
                copy.close()
            for _appended, batch in chunk:
                h = parse_header(batch)
                vector[h.origin] = OriginSeq(h.last_origin_seq + 1)
    shutil.rmtree(logs)
    (site_dir / SITE_FILE).unlink(missing_ok=True)
    return ensembles
