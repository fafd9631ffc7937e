"""Synthetic site data dirs, written straight through the storage layer, as replication leaves them.

For the audit's benchmark and unit tests: each site writes its own records as
their origin, and every site then holds every origin's batches, byte for byte
(only the 24-byte local prefix differs), appended in an interleaved order with
a replication delay. Faster than going through gRPC by orders of magnitude.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from georep.record.batch import RecordInput, encode_batch, parse_header
from georep.record.compression import Compression
from georep.server.broker import partition_dir_name
from georep.storage.api import LogConfig
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
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
        records = [RecordInput(b"k%d" % ((base + i) % 997), b"%s-%d-%d-" % (site.encode(), partition, base + i) + pad,
                               (), ts + i) for i in range(n)]  # fmt: skip
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
