"""Start-up reads only what lies after the recovery point; damage below it is still found before it is served."""

from __future__ import annotations

from pathlib import Path

import pytest

from georep.storage.api import BatchDamaged
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset
from tests.support.segments import A, B, Writer, log_files, open_log


def flip(path: Path, byte: int) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 0x5A
    path.write_bytes(bytes(data))


def crashed_log(directory: Path) -> tuple[Writer, int]:
    """One active segment: 10 batches below the recovery point (a clean close), 5 after it, then a crash."""
    log = open_log(directory)
    w = Writer(log)
    for i in range(10):
        w.append((A, B)[i % 2], 2, value_bytes=50)
    log.close()
    log = open_log(directory)
    w.log = log
    for _ in range(5):
        w.append(A, 2, value_bytes=50)
    log.flush()
    log.abandon()  # as kill -9 leaves it
    return w, 20


def test_open_does_not_read_the_batches_below_the_recovery_point_but_a_read_of_damage_there_is_refused(
    tmp_path: Path,
) -> None:
    w, _ = crashed_log(tmp_path)
    damaged = w.stored[3].header
    position = sum(s.header.size_bytes for s in w.stored[:3])
    flip(log_files(tmp_path)[0], position + 40)  # inside the CRC-covered bytes of the 4th batch
    log = SegmentLog.open(tmp_path, w.log.config, 0)
    try:
        assert log.recovery.damaged_offset is None
        assert log.damaged_batches() == []  # not read at start: the walk began at the recovery point
        assert log.log_end_offset == 30  # everything after the recovery point was walked and kept
        with pytest.raises(BatchDamaged):
            log.read(LocalOffset(damaged.base_offset), 1 << 20)
        assert [d.base_offset for d in log.damaged_batches()] == [damaged.base_offset]  # quarantined on reading
    finally:
        log.close()


def test_a_flipped_byte_after_the_recovery_point_is_still_cut_at_open(tmp_path: Path) -> None:
    w, recovery_point = crashed_log(tmp_path)
    position = sum(s.header.size_bytes for s in w.stored[:12])
    flip(log_files(tmp_path)[0], position + 40)  # the 13th batch: after the recovery point
    log = SegmentLog.open(tmp_path, w.log.config, 0)
    try:
        assert log.recovery.damaged_offset == w.stored[12].header.base_offset
        assert log.log_end_offset == w.stored[12].header.base_offset >= recovery_point
    finally:
        log.close()


def test_the_retention_run_moves_the_recovery_point_so_a_restart_reads_only_what_came_after(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    w = Writer(log)
    for _ in range(10):
        w.append(A, 2, value_bytes=50)
    log.flush()
    log.enforce_retention(0)  # the node's periodic run: nothing to delete, the recovery point moves to 20
    for _ in range(3):
        w.append(B, 2, value_bytes=50)
    log.flush()
    log.abandon()
    flip(log_files(tmp_path)[0], sum(s.header.size_bytes for s in w.stored[:3]) + 40)
    reopened = SegmentLog.open(tmp_path, log.config, 0)
    try:
        assert reopened.damaged_batches() == [] and reopened.log_end_offset == 26
        with pytest.raises(BatchDamaged):
            reopened.read(LocalOffset(w.stored[3].header.base_offset), 1 << 20)
    finally:
        reopened.close()
