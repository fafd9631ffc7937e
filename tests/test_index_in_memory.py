"""The active segment's index entries live in memory (issue 22): an append writes the ``.log`` only.

They reach the index files when the segment seals, at a checkpoint (before the recovery point passes them) and at a
clean stop; recovery walks the active segment and writes what a crash left out. These tests hold the trust rules to
that: a crash loses no acknowledged record, damage below the recovery point is still named by the origin index, an
index file found damaged at a seal is rebuilt from the ``.log`` rather than appended to, and a produce over more
partitions than the handle cache opens one file per append and keeps the descriptors bounded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from georep.record.batch import PREFIX
from georep.storage import segment as segment_module
from georep.storage.api import BatchDamaged
from georep.storage.index_format import FILE_HEADER, ORIGIN_ENTRY_BYTES, entry_for
from georep.storage.segment_log import SegmentLog
from tests.support.segments import A, B, Stored, Writer, log_files, max_open_files, open_log, read_all

CONFIG = {"segment_bytes_max": 1 << 20, "index_interval_bytes": 256}


def stored_bytes(s: Stored) -> bytes:
    h = s.header
    return PREFIX.pack(h.base_offset, h.batch_length, h.append_time_ms, h.crc) + s.batch.covered


def check_every_record(log: SegmentLog, w: Writer) -> None:
    """Every stored batch reads back whole by its offset, and is found by each of its origin seqs."""
    for s in w.stored:
        h = s.header
        assert log.read(h.base_offset, 1).data == stored_bytes(s)
        for seq in (h.base_origin_seq, h.last_origin_seq):
            assert log.offset_for_origin_seq(h.origin, seq) == h.base_offset
    assert log.vector() == w.next_seq


def oindex_of(log_path: Path) -> bytes:
    return log_path.with_suffix(".oindex").read_bytes()[FILE_HEADER.size :]


def expected_oindex(stored: list[Stored]) -> bytes:
    """The ``.oindex`` entries of ``stored`` (one segment's batches, in order), as the log's bytes imply them."""
    out, position = b"", 0
    for s in stored:
        out += entry_for(s.header, s.header.base_offset, position, s.header.append_time_ms).pack()
        position += s.header.size_bytes
    return out


def write(w: Writer, count: int) -> None:
    for i in range(count):
        w.append((A, B)[i % 3 == 0], 1 + i % 3, value_bytes=40 + (i * 37) % 200)


def test_a_crash_with_the_index_in_memory_loses_no_acknowledged_record(tmp_path: Path) -> None:
    directory = tmp_path / "t-0"
    log = open_log(directory, **CONFIG)
    w = Writer(log)
    write(w, 40)
    log.flush()  # acknowledged: the .log is durable
    active = log_files(directory)[-1]
    assert oindex_of(active) == b"", "an append wrote its index entry to the file"
    log.abandon()  # as kill -9 leaves it: the entries in memory are gone
    with active.open("ab") as f:  # and a write torn by the kill
        f.write(stored_bytes(w.stored[0])[:70])

    reopened = open_log(directory, **CONFIG)
    assert reopened.recovery.damaged_offset == w.stored[-1].header.next_offset  # the torn tail, and nothing more
    assert reopened.recovery.indexes_extended == 1
    check_every_record(reopened, w)
    assert oindex_of(active) == expected_oindex(w.stored)  # recovery wrote what the crash left out
    reopened.abandon()  # a second crash at once: the files now hold it all, and the next start trusts them
    again = open_log(directory, **CONFIG)
    assert again.recovery.indexes_extended == 0 and again.recovery.indexes_rebuilt == 0
    check_every_record(again, w)
    again.close()


def test_a_checkpoint_writes_the_entries_before_the_recovery_point_passes_them(tmp_path: Path) -> None:
    """Below the recovery point recovery cuts nothing: it names damage by the origin index. So the entries of the
    batches the point covers must be in the file, or a damaged batch there would refuse the whole log."""
    directory = tmp_path / "t-0"
    log = open_log(directory, **CONFIG)
    w = Writer(log)
    write(w, 20)
    log.flush()
    log.enforce_retention(now_ms=20_000)  # the node's periodic checkpoint: the recovery point moves to the flush
    active = log_files(directory)[-1]
    assert oindex_of(active) == expected_oindex(w.stored)
    write(w, 5)  # after the checkpoint: in memory only
    log.flush()
    log.abandon()
    damaged = w.stored[7]
    position = sum(s.header.size_bytes for s in w.stored[:7])
    raw = bytearray(active.read_bytes())
    raw[position + 60] ^= 0x10  # inside the CRC-covered bytes
    active.write_bytes(bytes(raw))

    reopened = open_log(directory, **CONFIG)
    assert reopened.log_end_offset == w.stored[-1].header.next_offset  # nothing cut
    with pytest.raises(BatchDamaged):  # trusted at the start, as a sealed segment is; found by the first read
        reopened.read(damaged.header.base_offset, 1)
    assert [d.base_offset for d in reopened.damaged_batches()] == [damaged.header.base_offset]
    reopened.repair(damaged.header.base_offset, stored_bytes(damaged))  # a peer's copy fills the named slot
    check_every_record(reopened, w)
    reopened.close()


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "foreign", "missing"])
def test_an_index_file_found_damaged_at_the_seal_is_rebuilt_from_the_log(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "t-0"
    log = open_log(directory, segment_bytes_max=3000, index_interval_bytes=256)
    w = Writer(log)
    write(w, 6)
    log.flush()
    log.enforce_retention(now_ms=20_000)  # writes the entries so far
    first = log_files(directory)[0]
    oindex = first.with_suffix(".oindex")
    data = bytearray(oindex.read_bytes())
    if damage == "truncated":
        oindex.write_bytes(bytes(data[:-30]))
    elif damage == "overwritten":
        data[-ORIGIN_ENTRY_BYTES:] = bytes(ORIGIN_ENTRY_BYTES)
        oindex.write_bytes(bytes(data))
    elif damage == "foreign":
        oindex.write_bytes(b"XXXX" + bytes(data[4:]))
    else:
        oindex.unlink()
    sealed_count = len(w.stored)
    while log.segment_count == 1:
        sealed_count = len(w.stored)
        write(w, 1)
    assert oindex_of(first) == expected_oindex(w.stored[:sealed_count])
    check_every_record(log, w)
    log.close()
    reopened = open_log(directory, segment_bytes_max=3000, index_interval_bytes=256)
    assert reopened.recovery.indexes_rebuilt == 0
    check_every_record(reopened, w)
    reopened.close()


def test_a_clean_stop_writes_every_entry_and_the_next_start_walks_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "t-0"
    log = open_log(directory, **CONFIG)
    w = Writer(log)
    write(w, 30)
    log.close()
    assert oindex_of(log_files(directory)[-1]) == expected_oindex(w.stored)
    reopened = open_log(directory, **CONFIG)
    assert reopened.recovery.indexes_extended == 0 and reopened.recovery.indexes_rebuilt == 0
    check_every_record(reopened, w)
    reopened.close()


CAP = 20
LOGS = 3 * CAP
SLACK = 10  # the test's own files and the interpreter's


@pytest.fixture
def capped() -> Iterator[None]:
    with max_open_files(CAP):
        yield


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each kind of segment file (by suffix) was opened."""
    counts: dict[str, int] = {}
    real: Callable[..., int] = os.open

    def counting(path: str | os.PathLike[str], *args: int) -> int:
        suffix = os.path.splitext(os.fspath(path))[1]
        counts[suffix] = counts.get(suffix, 0) + 1
        return real(path, *args)

    monkeypatch.setattr(os, "open", counting)
    return counts


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_partitions_written_in_turn_open_one_file_per_append_and_stay_bounded(
    tmp_path: Path, capped: None, opened: dict[str, int]
) -> None:
    base = open_fds()
    writers = [Writer(open_log(tmp_path / f"t-{i}", **CONFIG)) for i in range(LOGS)]
    peak = open_fds()
    opened.clear()
    rounds = 4
    for _ in range(rounds):
        for w in writers:  # cyclic: the least recently used segment is always the next one written
            w.append(A, 1, value_bytes=60)
            w.log.flush()
            peak = max(peak, open_fds())
    assert peak - base <= CAP + SLACK, f"{peak - base} files open for {LOGS} partitions with a bound of {CAP}"
    assert opened.get(".index", 0) == opened.get(".oindex", 0) == 0, opened
    assert opened.get(".log", 0) <= rounds * LOGS, opened
    for w in writers:  # the producer table's first use reads the active segment's entries: from memory
        assert len(w.log.batch_entries()) == rounds
    assert opened.get(".oindex", 0) == 0, opened
    for w in writers:
        assert read_all(w.log) == [stored_bytes(s) for s in w.stored]
        w.log.close()
    assert open_fds() - base <= SLACK


def test_a_hot_partition_writes_its_entries_out_beyond_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory per partition is bounded between checkpoints: past ``PENDING_BYTES_MAX`` the entries go to the file."""
    monkeypatch.setattr(segment_module, "PENDING_BYTES_MAX", 5 * ORIGIN_ENTRY_BYTES)
    directory = tmp_path / "t-0"
    log = open_log(directory, **CONFIG)
    w = Writer(log)
    write(w, 12)
    active = log_files(directory)[-1]
    assert oindex_of(active) == expected_oindex(w.stored[:10])  # written at the 5th and the 10th append
    assert len(log.batch_entries()) == 12  # from the file, then from memory
    log.flush()
    log.abandon()
    reopened = open_log(directory, **CONFIG)
    check_every_record(reopened, w)
    reopened.close()
