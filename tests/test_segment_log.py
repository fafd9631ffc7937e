"""The on-disk segment log: append, read, roll, retention, lookups, reopen, disk full."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.record.batch import (
    PREFIX,
    REWRITTEN_BYTES,
    RecordInput,
    check_batch,
    decode_records,
    encode_batch,
    iter_headers,
    parse_header,
)
from georep.storage.api import BatchEntry, DiskFull, OffsetOutOfRange
from georep.storage.segment_log import LogClosed, SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from tests.support.disks import small_tmpfs
from tests.support.segments import A, B, C, Writer, log_files, make_batch, open_log, read_all
from topology.ids import SiteId


@pytest.fixture
def log(tmp_path: Path) -> Iterator[SegmentLog]:
    opened = open_log(tmp_path / "t-0", segment_bytes_max=1500, index_interval_bytes=300)
    yield opened
    opened.close()


# -- append and read ------------------------------------------------------------------------------


def test_append_returns_the_header_as_stored_and_read_gives_back_the_same_bytes(log: SegmentLog) -> None:
    w = Writer(log)
    first = w.append(A, 3)
    second = w.append(B, 2)
    assert (first.header.base_offset, first.header.append_time_ms) == (0, w.clock_ms - 1)
    assert (second.header.base_offset, second.header.next_offset) == (3, 5)
    assert log.log_end_offset == 5
    data = log.read(LocalOffset(3), 1 << 20).data
    assert PREFIX.unpack_from(data) == (3, second.batch.header.batch_length, w.clock_ms, second.batch.header.crc)
    assert data[REWRITTEN_BYTES:] == second.batch.covered
    assert check_batch(data) == second.header


def test_round_trip_across_many_segments_from_every_offset(log: SegmentLog) -> None:
    w = Writer(log)
    for i in range(60):
        w.append((A, B, C)[i % 3], 1 + i % 4, value_bytes=20 + 7 * i)
    assert log.segment_count >= 10
    for offset in range(log.log_end_offset):
        result = log.read(LocalOffset(offset), 1)  # at least one whole batch, even past max_bytes
        header = check_batch(result.data)
        assert header.size_bytes == len(result.data)
        expected = w.containing(offset)
        assert header == expected.header
        assert result.next_offset == expected.header.next_offset
        assert [r.value for r in decode_records(result.data)] == list(expected.batch.values)
        assert [r.origin_seq for r in decode_records(result.data)] == list(
            range(expected.header.base_origin_seq, expected.header.next_origin_seq)
        )
    assert read_all(log) == [
        PREFIX.pack(s.header.base_offset, s.header.batch_length, s.header.append_time_ms, s.header.crc)
        + s.batch.covered
        for s in w.stored
    ]


def test_read_returns_whole_batches_within_max_bytes_and_stops_at_the_segment_end(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=4000)
    w = Writer(log)
    for _ in range(12):
        w.append(A, 2, value_bytes=100)
    size = w.stored[0].header.size_bytes
    result = log.read(LocalOffset(1), 3 * size + size // 2)
    assert [h.base_offset for h in iter_headers(result.data, verify=True)] == [0, 2, 4]
    assert len(result.data) == 3 * size and result.next_offset == 6
    whole = log.read(LocalOffset(0), 1 << 30)
    first_segment_end = int(log_files(tmp_path)[1].stem)
    assert whole.next_offset == first_segment_end  # a read does not continue into the next segment
    assert len(whole.data) == log_files(tmp_path)[0].stat().st_size
    log.close()


def test_read_at_the_end_is_empty_and_outside_the_log_is_out_of_range(log: SegmentLog) -> None:
    assert log.read(LocalOffset(0), 100).data == b""
    Writer(log).append(A, 5)
    assert log.read(LocalOffset(5), 100) == log.read(LocalOffset(5), 100)
    assert log.read(LocalOffset(5), 100).data == b"" and log.read(LocalOffset(5), 100).next_offset == 5
    for bad in (6, -1):
        with pytest.raises(OffsetOutOfRange) as err:
            log.read(LocalOffset(bad), 100)
        assert (err.value.log_start, err.value.log_end) == (0, 5)


def test_read_never_returns_bytes_past_the_known_log_end(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    w = Writer(log)
    w.append(A, 1)
    w.append(A, 1)
    with open(log_files(tmp_path)[-1], "ab") as f:  # a torn append in progress, as far as a reader can tell
        f.write(w.stored[0].batch.covered[:50])
    result = log.read(LocalOffset(1), 1 << 20)
    assert len(result.data) == w.stored[1].header.size_bytes and result.next_offset == 2
    log.close()


def test_append_rejects_unstamped_batches_and_bodies_that_do_not_match_the_header(log: SegmentLog) -> None:
    raw = encode_batch([RecordInput(None, b"v", (), 1)])
    with pytest.raises(ValueError, match="stamped"):
        log.append(parse_header(raw), [memoryview(raw)[REWRITTEN_BYTES:]], 1)
    batch = make_batch(A, 0, [b"v"])
    with pytest.raises(ValueError, match="body holds"):
        log.append(batch.header, batch.body[:1], 1)
    assert log.log_end_offset == 0 and log.size_bytes == 0


def test_a_closed_log_refuses_reads_and_appends(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.close()
    batch = make_batch(A, 0, [b"v"])
    with pytest.raises(LogClosed):
        log.append(batch.header, batch.body, 1)
    with pytest.raises(LogClosed):
        log.read(LocalOffset(0), 1)


# -- roll ----------------------------------------------------------------------------------------


def test_roll_on_size_keeps_every_batch_inside_one_segment(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=1000)
    w = Writer(log)
    for i in range(40):
        w.append(A, 1 + i % 3, value_bytes=30 + 11 * i % 200)
    w.append(A, 1, value_bytes=3000)  # bigger than a segment: alone in a fresh one
    w.append(A, 1)
    log.close()
    files = log_files(tmp_path)
    assert len(files) == log.segment_count >= 10
    expected_base = 0
    for path in files:
        data = path.read_bytes()
        headers = iter_headers(data, verify=True)  # each file parses cleanly on its own
        assert sum(h.size_bytes for h in headers) == len(data)
        assert headers[0].base_offset == int(path.stem) == expected_base
        expected_base = headers[-1].next_offset
        assert len(data) <= 1000 or len(headers) == 1
    assert [len(iter_headers(f.read_bytes())) for f in files[-2:]] == [1, 1]
    assert files[-2].stat().st_size > 3000


def test_roll_on_age_compares_append_times(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_ms=1000)
    w = Writer(log)
    w.append(A, append_time_ms=50_000)
    w.append(A, append_time_ms=51_000)  # exactly segment_ms later: not older yet
    assert log.segment_count == 1
    w.append(A, append_time_ms=51_001)
    assert log.segment_count == 2
    w.append(A, append_time_ms=52_001)  # measured from the new segment's first append
    assert log.segment_count == 2
    log.close()
    assert [int(p.stem) for p in log_files(tmp_path)] == [0, 2]


# -- retention -----------------------------------------------------------------------------------


def segment_max_timestamps(w: Writer, bases: list[int]) -> list[int]:
    out = []
    for i, base in enumerate(bases):
        end = bases[i + 1] if i + 1 < len(bases) else 1 << 62
        out.append(max(s.header.max_timestamp for s in w.stored if base <= s.header.base_offset < end))
    return out


def test_retention_by_time_deletes_whole_sealed_segments_oldest_first(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=600, retention_ms=10_000)
    w = Writer(log)
    for i in range(20):
        w.append(A, 1, timestamp_ms=100_000 + 1000 * i)
    bases = [int(p.stem) for p in log_files(tmp_path)]
    max_ts = segment_max_timestamps(w, bases)
    now = max_ts[3] + 10_001  # segments 0..3 are past retention
    assert log.enforce_retention(now) == 4
    assert log.log_start_offset == bases[4] and [int(p.stem) for p in log_files(tmp_path)] == bases[4:]
    assert log.read(LocalOffset(bases[4]), 1).data
    with pytest.raises(OffsetOutOfRange):
        log.read(LocalOffset(bases[4] - 1), 1)
    assert log.enforce_retention(now) == 0
    end = log.log_end_offset
    assert log.enforce_retention(1 << 60) == len(bases) - 5  # everything expired: the active one stays
    assert log.segment_count == 1 and log.log_end_offset == end
    assert log.read(LocalOffset(bases[-1]), 1).data
    w.append(A)
    assert log.log_end_offset == end + 1
    log.close()


def test_retention_by_size_keeps_the_log_under_the_limit(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=800, retention_bytes=2500)
    w = Writer(log)
    for _ in range(30):
        w.append(B, 2, value_bytes=60)
    sizes = [p.stat().st_size for p in log_files(tmp_path)]
    keep = len(sizes)
    while sum(sizes[len(sizes) - keep :]) > 2500:
        keep -= 1
    assert log.enforce_retention(0) == len(sizes) - keep
    assert log.size_bytes == sum(sizes[len(sizes) - keep :]) <= 2500
    assert log.size_bytes + sizes[len(sizes) - keep - 1] > 2500  # no more deleted than needed
    assert log.segment_count == keep == len(log_files(tmp_path))
    log.close()


def test_infinite_retention_keeps_offset_zero_readable(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=500)
    w = Writer(log)
    for i in range(20):
        w.append(A, timestamp_ms=i)
    assert log.enforce_retention(1 << 62) == 0
    assert log.log_start_offset == 0 and check_batch(log.read(LocalOffset(0), 1).data) == w.stored[0].header
    log.close()


# -- origin and timestamp lookups, vector, batch entries -------------------------------------------


def check_lookups(log: SegmentLog, w: Writer, start: int = 0) -> None:
    retained = [s for s in w.stored if s.header.base_offset >= start]
    for origin, next_seq in w.next_seq.items():
        mine = [s.header for s in retained if s.header.origin == origin]
        for seq in range(next_seq + 2):
            holding = [h for h in mine if h.last_origin_seq >= seq]
            expected = holding[0].base_offset if holding else None
            assert log.offset_for_origin_seq(origin, OriginSeq(seq)) == expected, (origin, seq)
    assert log.offset_for_origin_seq(Origin(SiteId("zz"), 1), OriginSeq(0)) is None
    for ts in range(900, 1_200, 7):
        later = [s.header.base_offset for s in retained if s.header.max_timestamp >= ts]
        assert log.offset_for_timestamp(ts) == (later[0] if later else None), ts
    assert log.vector() == w.next_seq
    assert log.batch_entries() == [
        BatchEntry(
            h.origin,
            h.base_origin_seq,
            h.last_offset_delta,
            h.base_offset,
            h.max_timestamp,
            h.producer_id,
            h.producer_epoch,
            h.base_sequence,
            h.append_time_ms,
        )
        for h in (s.header for s in retained)
    ]


def fill_three_origins(w: Writer, batches: int = 45) -> None:
    for i in range(batches):
        origin = (A, B, C)[(i * 7) % 3] if i < 15 else (A, B)[i % 2]  # C stops writing early
        ts = 1_000 + (i * 37) % 150  # producer timestamps are not monotonic
        w.append(origin, 1 + i % 4, timestamp_ms=ts)


def test_origin_seq_and_timestamp_lookups_and_vector_across_restart(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=1200)
    w = Writer(log)
    fill_three_origins(w)
    check_lookups(log, w)
    log.close()
    w.log = open_log(tmp_path, segment_bytes_max=1200)
    check_lookups(w.log, w)
    w.append(C, 2)
    check_lookups(w.log, w)
    w.log.close()


@pytest.mark.parametrize("restart", ["close", "crash"])
def test_vector_survives_retention_of_every_batch_of_an_origin(tmp_path: Path, restart: str) -> None:
    log = open_log(tmp_path, segment_bytes_max=1200, retention_bytes=3000)
    w = Writer(log)
    fill_three_origins(w, batches=60)
    log.enforce_retention(0)
    start = log.log_start_offset
    assert all(s.header.base_offset < start for s in w.stored if s.header.origin == C)
    check_lookups(log, w, start)
    assert log.offset_for_origin_seq(C, OriginSeq(0)) is None and log.vector()[C] == w.next_seq[C]
    log.close() if restart == "close" else log.abandon()
    w.log = open_log(tmp_path, segment_bytes_max=1200, retention_bytes=3000)
    assert w.log.log_start_offset == start
    check_lookups(w.log, w, start)
    w.log.close()


# -- reopen and index rebuild ----------------------------------------------------------------------


def index_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix in (".index", ".oindex")}


def test_reopen_after_clean_close_trusts_the_sealed_segments(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=1000, index_interval_bytes=200)
    w = Writer(log)
    fill_three_origins(w)
    before = read_all(log)
    log.close()
    indexes = index_files(tmp_path)
    w.log = open_log(tmp_path, segment_bytes_max=1000, index_interval_bytes=200)
    report = w.log.recovery
    assert report.indexes_rebuilt == 0 and report.damaged_offset is None
    assert report.segments_trusted == w.log.segment_count - 1 and report.segments_validated == 1
    assert index_files(tmp_path) == indexes
    assert read_all(w.log) == before and w.log.log_end_offset == log.log_end_offset
    check_lookups(w.log, w)
    w.log.close()


def test_missing_index_files_are_rebuilt_identically(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=1000, index_interval_bytes=200)
    w = Writer(log)
    fill_three_origins(w)
    log.close()
    indexes = index_files(tmp_path)
    assert any(name.endswith(".index") and len(data) > 8 for name, data in indexes.items())  # sparse entries exist
    for name in indexes:
        (tmp_path / name).unlink()
    w.log = open_log(tmp_path, segment_bytes_max=1000, index_interval_bytes=200)
    assert w.log.recovery.indexes_rebuilt == w.log.segment_count == len(log_files(tmp_path))
    assert w.log.recovery.damaged_offset is None
    assert index_files(tmp_path) == indexes
    for offset in range(w.log.log_end_offset):
        assert check_batch(w.log.read(LocalOffset(offset), 1).data) == w.containing(offset).header
    check_lookups(w.log, w)
    w.log.close()


# -- flush from another thread ---------------------------------------------------------------------


def test_flush_from_a_worker_thread_while_appending_and_reading(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes_max=4000)
    w = Writer(log)
    flushed: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def flusher() -> None:
        try:
            while not stop.is_set():
                flushed.append(log.flush())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(300):
            w.append((A, B)[i % 2], 2)
            assert check_batch(log.read(LocalOffset(2 * i + 1), 1).data).base_offset == 2 * i
    finally:
        stop.set()
        thread.join()
    assert not errors and flushed
    assert flushed == sorted(flushed) and flushed[-1] <= log.log_end_offset
    assert log.flush() == log.flushed_offset == log.log_end_offset == 600
    log.close()


# -- disk full -------------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path, "size=256k") as mount:
        yield mount


def test_disk_full_leaves_nothing_half_written_and_recovers_after_retention(tiny_disk: Path) -> None:
    directory = tiny_disk / "t-0"
    config = {"segment_bytes_max": 40_000, "retention_bytes": 60_000}
    log = open_log(directory, **config)
    w = Writer(log)
    with pytest.raises(DiskFull) as err:
        for i in range(200):
            end = log.log_end_offset
            size = log.size_bytes
            w.append(A, 1, value_bytes=3000 + 97 * i)
    assert str(directory) in str(err.value) and "free disk space or lower retention" in str(err.value)
    assert w.stored and len(w.stored) < 200
    assert log.log_end_offset == end and log.size_bytes == size
    assert sum(p.stat().st_size for p in log_files(directory)) == size  # nothing of the failed batch remains
    last = log_files(directory)[-1].read_bytes()
    assert sum(h.size_bytes for h in iter_headers(last, verify=True)) == len(last)
    assert read_all(log) == [
        PREFIX.pack(s.header.base_offset, s.header.batch_length, s.header.append_time_ms, s.header.crc)
        + s.batch.covered
        for s in w.stored
    ]
    assert log.enforce_retention(0) > 0
    stored = w.append(A, 1, value_bytes=3000)
    assert stored.header.base_offset == end
    log.close()
    reopened = open_log(directory, **config)
    assert reopened.recovery.damaged_offset is None and reopened.log_end_offset == end + 1
    assert check_batch(reopened.read(end, 1).data) == stored.header
    assert reopened.vector() == {A: w.next_seq[A]}
    reopened.close()


def test_index_and_log_sizes_stay_consistent_when_the_disk_fills(tiny_disk: Path) -> None:
    directory = tiny_disk / "t-1"
    log = open_log(directory, segment_bytes_max=1 << 20, index_interval_bytes=0)
    w = Writer(log)
    with pytest.raises(DiskFull):
        for _ in range(10_000):  # small batches: the index files run out of room as often as the log
            w.append(B, 1, value_bytes=200)
    log.close()
    reopened = open_log(directory, segment_bytes_max=1 << 20, index_interval_bytes=0)
    assert reopened.recovery.indexes_rebuilt == 0 and reopened.recovery.damaged_offset is None
    assert reopened.log_end_offset == len(w.stored)
    assert os.path.getsize(log_files(directory)[0]) == sum(s.header.size_bytes for s in w.stored)
    reopened.close()
