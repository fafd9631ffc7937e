"""A node's batch digests of a partition log (georep/storage/digests.py) and their pacing (digest_pacing.py).

The digests must say what the file audit's scan (spark_jobs/scan.py) says of the same files, batch for batch:
the node and the file audit share the walk (georep/storage/batch_scan.py).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from georep.proto import georep_pb2 as pb
from georep.server.digest_calls import digest_pb, digests_of
from georep.server.digest_pacing import DigestPacer, TokenBucket
from georep.storage.batch_scan import CORRUPT, OK, TORN_TAIL
from georep.storage.digests import DigestCursor, Found
from georep.storage.segment_log import SegmentLog
from spark_jobs.layout import partition_segments
from spark_jobs.scan import read_batches
from tests.support.segments import A, B, Writer, log_files, max_open_files, open_log

SEGMENT_BYTES = 1_000  # about 5 batches a segment


def filled(tmp_path: Path, batches: int = 24) -> tuple[SegmentLog, Writer]:
    log = open_log(tmp_path / "t-0", segment_bytes_max=SEGMENT_BYTES, index_interval_bytes=300)
    w = Writer(log)
    for i in range(batches):
        w.append(A if i % 3 else B, 1 + i % 4)
    log.flush()
    return log, w


def everything(log: SegmentLog, from_offset: int = 0, end: int | None = None) -> list[Found]:
    cursor = DigestCursor(log, from_offset, int(log.flushed_offset) if end is None else end)
    out: list[Found] = []
    while not cursor.done:
        out += cursor.take(7)
    cursor.close()
    return out


def file_audit_rows(directory: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for segment in partition_segments("a", "t", 0, directory):
        for arrow in read_batches(segment):
            rows += arrow.to_pylist()
    return rows


def as_rows(found: list[Found], log: SegmentLog) -> list[dict[str, object]]:
    out = []
    for f in found:
        d = digest_pb(f, "", None, int(log.log_start_offset))
        out.append(
            {
                "segment": d.segment,
                "position": d.position,
                "status": d.status,
                "base_offset": d.base_offset,
                "crc": d.crc if d.status == OK else None,
                "base_seq": d.base_seq if d.status == OK else None,
                "size_bytes": d.size_bytes,
            }
        )
    return out


def file_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    def base_of(path: object) -> int:
        return int(Path(str(path)).stem)

    return [
        {
            "segment": base_of(r["file"]),
            "position": r["position"],
            "status": r["status"],
            "base_offset": r["base_offset"],
            "crc": r["crc"],
            "base_seq": r["base_seq"],
            "size_bytes": r["size_bytes"],
        }
        for r in rows
    ]


def test_the_digests_of_a_log_are_the_file_audits_rows_of_its_files(tmp_path: Path) -> None:
    log, w = filled(tmp_path)
    try:
        found = everything(log)
        assert len(log_files(log.directory)) > 3
        assert [f.scanned.base_offset for f in found] == [s.header.base_offset for s in w.stored]
        assert as_rows(found, log) == file_rows(file_audit_rows(log.directory))
        assert {f.scanned.status for f in found} == {OK}
    finally:
        log.close()


def test_a_range_gives_the_batches_holding_its_offsets_from_mid_segment_and_mid_batch(tmp_path: Path) -> None:
    log, w = filled(tmp_path)
    try:
        ends = [(s.header.base_offset, s.header.next_offset) for s in w.stored]
        end = int(log.flushed_offset)
        ranges = [(lo, min(lo + span, end)) for lo in range(end) for span in (1, 7)] + [(0, end), (9, 9)]
        for lo, hi in ranges:  # from every offset: mid-batch, mid-segment, past sparse-index entries
            got = [(f.scanned.base_offset, f.scanned.next_offset) for f in everything(log, lo, hi)]
            assert got == [(b, n) for b, n in ends if n > lo and b < hi and lo < hi], (lo, hi)
    finally:
        log.close()


def test_a_corrupt_batch_in_a_sealed_segment_is_a_digest_with_status_corrupt(tmp_path: Path) -> None:
    log, w = filled(tmp_path)
    try:
        first = log_files(log.directory)[0]
        victim = w.stored[1].header  # in the first (sealed) segment, with batches after it
        at = sum(s.header.size_bytes for s in w.stored[:1]) + victim.size_bytes - 3  # a record byte: CRC-covered
        with open(first, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        found = everything(log)
        bad = [f for f in found if f.scanned.status != OK]
        assert [(f.scanned.base_offset, f.scanned.status) for f in bad] == [(victim.base_offset, CORRUPT)]
        assert "crc" in (bad[0].scanned.error or "").lower()
        assert len(found) == len(w.stored)  # one bad batch hides no other
        assert as_rows(found, log) == file_rows(file_audit_rows(log.directory))
    finally:
        log.close()


def test_a_torn_tail_of_the_newest_segment_is_torn_tail(tmp_path: Path) -> None:
    log, _w = filled(tmp_path)
    try:
        last = log_files(log.directory)[-1]
        os.truncate(last, last.stat().st_size - 5)  # the newest batch torn, above the recovery point
        # The log's recovery point is where it opened (0): the file audit calls the same bytes torn too.
        found = everything(log)
        assert [f.scanned.status for f in found][-1] == TORN_TAIL
        assert {f.scanned.status for f in found[:-1]} == {OK}
        assert [r["status"] for r in file_audit_rows(log.directory)][-1] == TORN_TAIL
    finally:
        log.close()


def test_a_scan_holds_one_descriptor_of_its_own_and_stays_within_the_handle_cache(tmp_path: Path) -> None:
    with max_open_files(2):
        log, _w = filled(tmp_path, 40)
        try:
            before = len(os.listdir("/proc/self/fd"))
            cursor = DigestCursor(log, 0, int(log.flushed_offset))
            most = 0
            while not cursor.done:
                cursor.take(1)
                most = max(most, len(os.listdir("/proc/self/fd")) - before)
            cursor.close()
            assert len(log_files(log.directory)) > 5
            assert most <= 2  # its dup, and at most one segment the cache opened over its bound of 2
            assert len(os.listdir("/proc/self/fd")) <= before + 1
        finally:
            log.close()


# -- pacing -------------------------------------------------------------------------------------------


def test_the_bucket_grants_its_burst_at_once_then_the_rate_and_goes_into_debt_for_a_large_take() -> None:
    bucket = TokenBucket(rate=10, burst=10, now_s=0.0)
    assert bucket.reserve(10, 0.0) == 0.0
    assert bucket.reserve(5, 0.0) == pytest.approx(0.5)
    assert bucket.reserve(5, 0.0) == pytest.approx(1.0)  # behind the first waiter
    assert bucket.reserve(1, 1.0) == pytest.approx(0.1)  # one second paid the debt of 10 back, no more
    assert bucket.reserve(1, 9.0) == 0.0  # refilled, up to the burst
    assert bucket.tokens == 9
    assert bucket.reserve(100, 100.0) == pytest.approx(9.0)  # more than the burst: granted, in debt


class FakeTime:
    def __init__(self) -> None:
        self.now_s = 0.0

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        """Sleepers overlap: the clock jumps to the latest wake-up asked for (the bucket hands them out in order)."""
        self.now_s = max(self.now_s, self.now_s + seconds)
        await asyncio.sleep(0)


def test_concurrent_scans_share_the_rate_and_each_message_waits_for_its_tokens(tmp_path: Path) -> None:
    log, _w = filled(tmp_path, 12)
    time = FakeTime()
    pacer = DigestPacer(4, clock_s=time.clock, sleep=time.sleep)

    async def scan(tag: str, sent: list[tuple[str, float, int]]) -> None:
        cursor = DigestCursor(log, 0, int(log.flushed_offset))
        async for digests in digests_of(cursor, None, pacer, 2, lambda f: digest_pb(f, "", None, 0)):
            sent.append((tag, time.now_s, len(digests)))

    async def both() -> list[tuple[str, float, int]]:
        sent: list[tuple[str, float, int]] = []
        await asyncio.gather(scan("x", sent), scan("y", sent))
        return sent

    try:
        sent = asyncio.run(both())
    finally:
        log.close()
    assert sum(n for _, _, n in sent) == 24
    # 24 digests at 4/s after a burst of 4: the last goes at (24 - 4) / 4 = 5 s, none earlier than its tokens.
    total = 0
    for _tag, at, n in sorted(sent, key=lambda s: s[1]):
        total += n
        assert at >= (total - 4) / 4 - 1e-9
    assert max(at for _, at, _ in sent) == pytest.approx(5.0)
    assert {tag for tag, _, _ in sent if _ < 2.5} == {"x", "y"}  # neither waits for the other to finish


def test_a_rate_of_zero_never_waits_and_a_negative_rate_is_refused() -> None:
    time = FakeTime()
    pacer = DigestPacer(0, clock_s=time.clock, sleep=time.sleep)
    asyncio.run(pacer.take(1_000_000))
    assert time.now_s == 0.0
    with pytest.raises(ValueError, match="audit-digest-rate"):
        DigestPacer(-1)


def test_a_digest_message_carries_the_batch_row(tmp_path: Path) -> None:
    log, w = filled(tmp_path, 2)
    try:
        found = everything(log)
        d = digest_pb(found[0], "3", 7, 0)
        h = w.stored[0].header
        assert (d.node, d.segment, d.origin_site, d.origin_epoch) == ("3", 7, "us-east-2", h.origin_epoch)
        assert (d.base_seq, d.last_seq, d.records, d.crc) == (h.base_origin_seq, h.last_origin_seq, 1, h.crc)
        assert d.append_time_ms == h.append_time_ms and d.max_timestamp_ms == h.max_timestamp
        assert isinstance(d, pb.BatchDigest)
    finally:
        log.close()
