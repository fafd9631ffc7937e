"""What a node's digest scan (ScanDigests, issue 24) costs per batch, beside the file audit's scan of the same files.

Writes one partition log of ``--batches`` batches of ``--batch-bytes`` through ``SegmentLog`` in a temporary
directory, then walks it with the node's ``DigestCursor`` and with ``spark_jobs.scan.scan_segment`` (the file
audit's walk), and prints batches per second, MB per second, and CPU microseconds per batch (process CPU time, so
the figure means something on a shared machine). The bytes are in the page cache: this is the CPU side, not the
disk's. Compare the batches per second of one core with ``--audit-digest-rate`` (default 10,000).

    .venv/bin/python bench/digests.py --batches 20000 --batch-bytes 16384
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from georep.record.batch import HEADER_BYTES, REWRITTEN_BYTES, RecordInput, encode_batch, parse_header, stamp_origin
from georep.storage.api import LogConfig
from georep.storage.digests import DigestCursor
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from spark_jobs.layout import partition_segments
from spark_jobs.scan import scan_segment
from topology.ids import SiteId

ORIGIN = Origin(SiteId("a"), 1)


def fill(directory: Path, batches: int, batch_bytes: int) -> SegmentLog:
    log = SegmentLog.open(directory, LogConfig(segment_bytes_max=64 << 20), now_ms=0)
    records = max(1, batch_bytes // 1024)
    value = os.urandom(max(1, batch_bytes // records - 40))
    raw = encode_batch([RecordInput(None, value, (), 1_000 + i) for i in range(records)])
    for i in range(batches):
        head, _crc = stamp_origin(raw, ORIGIN, i * records)
        log.append(parse_header(head), (memoryview(head)[REWRITTEN_BYTES:], memoryview(raw)[HEADER_BYTES:]), 1 + i)
    log.flush()
    return log


def timed(name: str, walk: object, batches: int, size: int) -> None:
    wall, cpu = time.monotonic(), time.process_time()
    n = walk() if callable(walk) else 0
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert n == batches, (name, n, batches)
    print(
        f"{name:12} {n / wall:10,.0f} batches/s  {size / wall / 1e6:8,.0f} MB/s  "
        f"{cpu / n * 1e6:7.1f} us CPU/batch  ({n / cpu:,.0f} batches per CPU-second)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--batch-bytes", type=int, default=16_384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="georep-digests-") as tmp:
        log = fill(Path(tmp) / "t-0", args.batches, args.batch_bytes)
        size = log.size_bytes

        def node() -> int:
            cursor = DigestCursor(log, 0, int(log.flushed_offset))
            n = 0
            while not cursor.done:
                n += len(cursor.take(256, 4 << 20))
            return n

        def file_audit() -> int:
            return sum(1 for f in partition_segments("a", "t", 0, log.directory) for _ in scan_segment(f))

        print(f"{args.batches} batches of ~{args.batch_bytes} bytes ({size / 1e6:.0f} MB), load {os.getloadavg()}")
        for name, walk in (("node digest", node), ("file audit", file_audit), ("node digest", node)):
            timed(name, walk, args.batches, size)
        log.close()


if __name__ == "__main__":
    main()
