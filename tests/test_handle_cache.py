"""Open segment files are a bounded cache: many partitions, few descriptors, and nothing lost or misdirected."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.record.batch import PREFIX
from georep.storage.handle_cache import HANDLES, set_max_open_files
from georep.storage.segment_log import SegmentLog
from tests.support.segments import A, B, Writer, max_open_files, open_log, read_all

CAP = 60
SLACK = 20  # the test's own files, the interpreter's, and segments of logs locked at the instant (none here)


def stored(w: Writer) -> list[bytes]:
    """The bytes each appended batch must read back as."""
    return [
        PREFIX.pack(s.header.base_offset, s.header.batch_length, s.header.append_time_ms, s.header.crc)
        + s.batch.covered
        for s in w.stored
    ]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def capped() -> Iterator[None]:
    with max_open_files(CAP):
        yield


@pytest.fixture
def tiny() -> Iterator[None]:
    """Two segments' files at most: nearly every use of a segment closes another's."""
    before = HANDLES.max_open_files
    set_max_open_files(2)  # one file per segment: its .log
    yield
    set_max_open_files(before)


def test_reading_and_writing_many_partitions_keeps_open_files_under_the_bound(tmp_path: Path, capped: None) -> None:
    base = open_fds()
    logs = [open_log(tmp_path / f"t-{i}", segment_bytes_max=600) for i in range(200)]
    writers = [Writer(log) for log in logs]
    peak = open_fds()
    for _ in range(3):
        for w in writers:
            w.append(A, 2, value_bytes=60)
            w.log.flush()
            peak = max(peak, open_fds())
    for log in logs:
        assert read_all(log)
        peak = max(peak, open_fds())
    assert peak - base <= CAP + SLACK, f"{peak - base} files open for 200 partitions with a bound of {CAP}"
    for w in writers:  # every record written through evicted and reopened files reads back whole
        assert read_all(w.log) == stored(w)
    for log in logs:
        log.close()
    reopened = [open_log(tmp_path / f"t-{i}", segment_bytes_max=600) for i in range(200)]
    for log, w in zip(reopened, writers, strict=True):
        assert read_all(log) == stored(w)
        log.close()
    assert open_fds() - base <= SLACK


def test_concurrent_writers_never_write_through_a_descriptor_the_cache_closed(tmp_path: Path, tiny: None) -> None:
    """A closed descriptor's number is soon reused for another file: closing under a writer would put one
    partition's batch into another's segment, which the reads below would see."""
    logs = [open_log(tmp_path / f"t-{i}", segment_bytes_max=2000) for i in range(60)]
    writers = [Writer(log) for log in logs]
    locks = [threading.Lock() for _ in logs]  # Writer keeps its own list: one thread per writer at a time
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for n in range(150):
                i = (seed * 7 + n * 13) % len(logs)
                with locks[i]:
                    writers[i].append((A, B)[n % 2], 1, value_bytes=30)
                if n % 5 == 0:
                    logs[(i + 3) % len(logs)].flush()
                    read_all(logs[(i + 5) % len(logs)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for w in writers:
        assert read_all(w.log) == stored(w)
        w.log.close()
    for i in range(len(logs)):
        log = SegmentLog.open(tmp_path / f"t-{i}", logs[i].config, 0)
        assert log.recovery.damage is None and log.recovery.indexed_batches_lost == 0
        assert read_all(log) == stored(writers[i])
        log.close()
