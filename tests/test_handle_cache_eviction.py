"""Evicting segment files under a produce over more partitions than the handle cache holds (issue 22).

A partition's flush leaves its segment clean (its ``.log`` fsynced: the index entries wait in memory until the
segment seals), so the cache closes it without an fsync.
Before, a flush synced only the ``.log`` and a segment stayed "written" until it closed: with 10,000 partitions
written in turn and a bound of 1,000 files, every append on the event loop's thread evicted a segment with three
fdatasyncs (44% of the node's samples in py-spy). Closing never loses an fsync: a segment written since its last
sync is still fsynced before its files close, including one written while its flush was running.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from georep.storage.handle_cache import HANDLES, set_max_open_files
from tests.support.segments import A, Writer, open_log, read_all

LOGS = 6


@pytest.fixture
def two_segments() -> Iterator[None]:
    """Room for two segments' files: writing a third partition evicts one."""
    before = HANDLES.max_open_files
    set_max_open_files(2)  # one file per segment: its .log
    yield
    set_max_open_files(before)


@pytest.fixture
def eviction_syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fdatasyncs run by the handle cache's eviction (Segment.release_files), one entry per call."""
    calls: list[int] = []
    real: Callable[[int], None] = os.fdatasync

    def counted(fd: int) -> None:
        if sys._getframe(1).f_code.co_name == "release_files":
            calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    return calls


def test_partitions_written_in_turn_and_flushed_are_evicted_without_an_fsync(
    tmp_path: Path, two_segments: None, eviction_syncs: list[int]
) -> None:
    writers = [Writer(open_log(tmp_path / f"t-{i}")) for i in range(LOGS)]
    for w in writers:
        w.log.flush()
    eviction_syncs.clear()  # creating a partition writes its files' headers: those were synced when evicted
    for _ in range(3):
        for w in writers:  # each append opens this partition's files and evicts the least recently used
            w.append(A, 1, value_bytes=50)
            w.log.flush()  # as the node does for every batch at acks=leader
    assert eviction_syncs == [], f"{len(eviction_syncs)} fsyncs on the appending thread to close flushed segments"
    for w in writers:
        assert len(read_all(w.log)) == 3
        w.log.close()


def test_a_segment_written_since_its_last_flush_is_fsynced_before_its_files_close(
    tmp_path: Path, two_segments: None, eviction_syncs: list[int]
) -> None:
    first, second, third = (Writer(open_log(tmp_path / f"t-{i}")) for i in range(3))
    for w in (first, second, third):
        w.append(A, 1, value_bytes=50)  # none flushed: the third evicts the first, dirty
    assert eviction_syncs, "a segment with unsynced writes was closed without an fsync"
    for w in (first, second, third):
        assert len(read_all(w.log)) == 1
        w.log.close()


def test_a_write_that_lands_while_the_flush_syncs_keeps_the_segment_dirty(
    tmp_path: Path, two_segments: None, eviction_syncs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = (Writer(open_log(tmp_path / f"t-{i}")) for i in range(3))
    first.append(A, 1, value_bytes=50)
    synced: Callable[[int], None] = os.fdatasync
    late: list[Any] = []

    def write_during_the_flush(fd: int) -> None:
        if not late:  # the flush took its descriptors and released the log's lock: another append gets in
            late.append(first.append(A, 1, value_bytes=50))
        synced(fd)

    monkeypatch.setattr(os, "fdatasync", write_during_the_flush)
    first.log.flush()
    monkeypatch.setattr(os, "fdatasync", synced)
    assert late
    second.append(A, 1, value_bytes=50)
    eviction_syncs.clear()
    third.append(A, 1, value_bytes=50)  # evicts the least recently used: first, written since its flush began
    assert eviction_syncs, "a segment written during its flush was closed without an fsync"
    for w in (first, second, third):
        w.log.close()


def test_new_partitions_are_evicted_without_an_fsync_before_their_first_write(
    tmp_path: Path, two_segments: None, eviction_syncs: list[int]
) -> None:
    """A topic wider than the cache (issue 22): its new partitions' empty segments were dirty, so creating it, and
    then the first write of each, closed one with an fdatasync on the event loop's thread per partition."""
    logs = [open_log(tmp_path / f"t-{i}") for i in range(LOGS)]  # each open evicts an older one, never written
    writers = [Writer(log) for log in logs]
    for w in writers:
        w.append(A, 1, value_bytes=50)  # evicts a partition written only if it was not flushed: none here yet
        w.log.flush()
    assert eviction_syncs == []
    for log in logs:
        log.close()
    lost = tmp_path / "t-new"
    log = open_log(lost)
    log.close()
    for path in lost.glob("*.log"):  # an empty segment lost in a crash: the next open starts the log again
        path.unlink()
    again = open_log(lost)
    assert (again.log_end_offset, again.vector()) == (0, {})
    again.close()
