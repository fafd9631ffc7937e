"""Recovery of the segment log after torn writes, flipped bytes, zeroed pages and damaged directories.

Each property copies a pristine partition directory (built once per module), damages the copy, reopens it and
checks what a reader would see. Below the recovery point nothing is ever cut: the damaged batches are
quarantined with the coordinates the origin index gives them, everything else is served byte for byte, the
vector stays whole, and the pristine batches (a peer's copies) repair the log to the byte. Above it (the active
segment of a crashed log) a torn write is cut at the last whole batch and the vector winds back to what is stored.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from georep.record.batch import BatchHeader, check_batch, iter_headers
from georep.storage.api import BatchDamaged, DamagedBatch, OffsetOutOfRange, StorageError
from georep.storage.index_format import FILE_HEADER, ORIGIN_ENTRY_BYTES
from georep.storage.log_start import FILE_NAME as LOG_START
from georep.storage.recovery_point import FILE_NAME as RECOVERY_POINT
from georep.storage.segment import UnrepairableDamage
from georep.storage.segment_log import DAMAGED_FILE, MissingSegment, SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from tests.support.examples import examples
from tests.support.segments import A, B, C, Writer, log_files, open_log

CONFIG = {"segment_bytes_max": 2048, "index_interval_bytes": 256}
PROPERTY = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Pristine:
    directory: Path
    batches: list[bytes] = field(repr=False)  # every batch as stored, in log order
    headers: list[BatchHeader] = field(repr=False)
    segments: list[list[tuple[int, int]]] = field(repr=False)  # per .log file: (byte position, batch index)

    def __repr__(self) -> str:
        return f"Pristine({self.directory})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what Hypothesis prints of a failing case
        printer.text(repr(self))

    @property
    def log_end(self) -> int:
        return self.headers[-1].next_offset

    def batch_at(self, segment: int, byte: int) -> int:
        """Index of the batch of ``segment`` that holds ``byte`` (or the first one ending after it)."""
        for position, index in self.segments[segment]:
            if byte < position + len(self.batches[index]):
                return index
        return len(self.batches)  # past the segment's last batch: nothing damaged


def build(directory: Path, *, close: bool) -> Pristine:
    log = open_log(directory, **CONFIG)
    w = Writer(log)
    for i in range(30):
        w.append((A, B)[i % 3 == 0], 1 + i % 4, value_bytes=50 + (i * 53) % 250)
    if close:
        log.close()
    else:
        log.abandon()  # as a killed process leaves it: recovery point from the last roll only
    batches: list[bytes] = []
    segments: list[list[tuple[int, int]]] = []
    for path in log_files(directory):
        data = path.read_bytes()
        positions: list[tuple[int, int]] = []
        pos = 0
        for h in iter_headers(data, verify=True):
            positions.append((pos, len(batches)))
            batches.append(data[pos : pos + h.size_bytes])
            pos += h.size_bytes
        segments.append(positions)
    assert len(segments) >= 5 and [s.header for s in w.stored] == [check_batch(b) for b in batches]
    return Pristine(directory, batches, [s.header for s in w.stored], segments)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Pristine]:
    """{closed: pristine log}: one closed cleanly, one abandoned as by a crash."""
    return {closed: build(tmp_path_factory.mktemp("pristine") / "t-0", close=closed) for closed in (True, False)}


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def copy_of(p: Pristine, tmp: str | Path) -> Path:
    directory = Path(tmp) / "t-0"
    shutil.copytree(p.directory, directory)
    return directory


def flip(path: Path, byte: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= mask
    path.write_bytes(bytes(data))


def check_recovered(directory: Path, p: Pristine, intact: int, *, corrupt: bool = True) -> None:
    """Reopen a log cut by recovery: batches [0, intact) are served unchanged, nothing after, and appends continue.

    Only a crashed log (its recovery point at the last roll) is ever cut, and only above that point.
    ``corrupt``: whether bytes of the first lost batch remain in the file (a cut between two batches leaves a
    shorter log with nothing damaged in it).
    """
    log = open_log(directory, **CONFIG)
    end = p.headers[intact].base_offset if intact < len(p.batches) else p.log_end
    assert log.log_end_offset == end and log.damaged_batches() == []
    if intact < len(p.batches) and corrupt:
        assert log.recovery.damaged_offset == end and log.recovery.damage
    else:
        assert log.recovery.damaged_offset is None
    for i in range(intact):
        assert log.read(p.headers[i].base_offset, 1).data == p.batches[i]
    assert log.read(LocalOffset(end), 1 << 20).data == b""
    with pytest.raises(OffsetOutOfRange):
        log.read(LocalOffset(end + 1), 1)
    expected_vector = vector_of(p.headers[:intact])
    assert log.vector() == expected_vector  # wound back to what is stored, so links pull the rest again
    for origin, next_seq in expected_vector.items():
        assert log.offset_for_origin_seq(origin, OriginSeq(next_seq)) is None
    # Appends continue at the cut, and survive another restart.
    w = Writer(log, next_seq=dict(expected_vector))
    stored = w.append(C, 2)
    assert stored.header.base_offset == end
    log.close()
    again = open_log(directory, **CONFIG)
    assert again.recovery.damaged_offset is None and again.log_end_offset == end + 2
    assert check_batch(again.read(LocalOffset(end + 1), 1).data) == stored.header
    assert next(h.base_offset for h in iter_headers(again.read(again.log_start_offset, 1 << 20).data)) == 0
    again.close()


def check_quarantined(directory: Path, p: Pristine, lost: set[int]) -> None:
    """Reopen a damaged log that may not be cut: the batches ``lost`` (indexes) are quarantined with their
    coordinates, every other batch is served unchanged, the vector is whole, and the pristine copies (a peer's)
    repair it to the byte."""
    log = open_log(directory, **CONFIG)
    assert log.log_end_offset == p.log_end and log.recovery.damaged_offset is None
    assert log.vector() == vector_of(p.headers)
    quarantined = {d.base_offset: d for d in scrubbed(log)}  # a sealed segment is trusted until scrubbed
    assert sorted(quarantined) == sorted(p.headers[i].base_offset for i in lost)
    for i, h in enumerate(p.headers):
        if i in lost:
            with pytest.raises(BatchDamaged):
                log.read(h.base_offset, 1)
            d = quarantined[h.base_offset]
            assert (d.origin, d.base_origin_seq, d.last_origin_seq, d.size_bytes, d.crc) == (
                h.origin,
                h.base_origin_seq,
                h.last_origin_seq,
                h.size_bytes,
                h.crc,
            )
        else:
            assert log.read(h.base_offset, 1).data == p.batches[i]
    for i in sorted(lost):
        log.repair(p.headers[i].base_offset, p.batches[i])
    assert log.damaged_batches() == []
    log.close()
    assert [f.read_bytes() for f in log_files(directory)] == [f.read_bytes() for f in log_files(p.directory)]


def vector_of(headers: list[BatchHeader]) -> dict[Origin, int]:
    vector: dict[Origin, int] = {}
    for h in headers:
        vector[h.origin] = h.next_origin_seq
    return vector


def batches_touched(p: Pristine, segment: int, first: int, end: int) -> set[int]:
    """Indexes of the batches of ``segment`` whose CRC-covered bytes [24, size) change when bytes [first, end)
    are zeroed or flipped (``zero``); damage to a batch's 24 local bytes alone is mended from its index entry."""
    out = set()
    for position, index in p.segments[segment]:
        lo, hi = max(first, position + 24), min(end, position + len(p.batches[index]))
        if lo < hi:
            out.add(index)
    return out


def zero_changes(p: Pristine, segment: int, first: int, end: int) -> set[int]:
    return {
        i
        for i in batches_touched(p, segment, first, end)
        for pos, j in p.segments[segment]
        if j == i and p.batches[i][max(first - pos, 24) : end - pos].strip(b"\0")
    }


@PROPERTY
@given(data=st.data())
def test_a_torn_tail_below_the_recovery_point_is_quarantined_never_cut(
    pristine: dict[bool, Pristine], data: st.DataObject
) -> None:
    """Issue 20, item 1: a log closed cleanly has its recovery point at its end, so a tail cut from any of its
    segments (the sealed ones included) loses nothing the origin index cannot name and a peer cannot give back."""
    p = pristine[True]
    segment = data.draw(st.integers(0, len(p.segments) - 1), label="segment")
    size = len(log_files(p.directory)[segment].read_bytes())
    cut = data.draw(st.integers(0, size - 1), label="cut")
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        with open(log_files(directory)[segment], "r+b") as f:
            f.truncate(cut)
        check_quarantined(directory, p, {i for pos, i in p.segments[segment] if pos + len(p.batches[i]) > cut})


@PROPERTY
@given(data=st.data())
def test_a_torn_tail_above_the_recovery_point_is_cut_at_the_last_whole_batch(
    pristine: dict[bool, Pristine], data: st.DataObject
) -> None:
    p = pristine[False]
    last = len(p.segments) - 1
    size = len(log_files(p.directory)[last].read_bytes())
    cut = data.draw(st.integers(0, size), label="cut")
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        with open(log_files(directory)[last], "r+b") as f:
            f.truncate(cut)
        intact = p.batch_at(last, cut)
        between_batches = cut in {pos for pos, _ in p.segments[last]}
        check_recovered(directory, p, intact, corrupt=not between_batches)


@PROPERTY
@given(data=st.data(), mask=st.integers(1, 255))
def test_a_flipped_byte_in_the_active_segment_after_a_crash_cuts_the_log_at_its_batch(
    pristine: dict[bool, Pristine], data: st.DataObject, mask: int
) -> None:
    p = pristine[False]
    last = len(p.segments) - 1
    size = len(log_files(p.directory)[last].read_bytes())
    byte = data.draw(st.integers(0, size - 1), label="byte")
    index = p.batch_at(last, byte)
    position = next(pos for pos, i in p.segments[last] if i == index)
    # The append time is outside the CRC, and its second copy (the .oindex entry) of an active segment is written at
    # a checkpoint, a seal or a clean stop: this crash left none, so a flip there cannot be told (a sealed
    # segment's is mended: test_a_flipped_append_time_is_mended_from_the_origin_index_copy).
    assume(not 12 <= byte - position < 20)
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        flip(log_files(directory)[last], byte, mask)
        if byte - position < 8:
            check_recovered(directory, p, len(p.batches))  # the base offset: mended by continuity
        else:
            check_recovered(directory, p, index)


@PROPERTY
@given(data=st.data(), mask=st.integers(1, 255), closed=st.booleans(), recovery_point=st.booleans())
def test_a_flipped_byte_below_the_recovery_point_costs_only_its_batch(
    pristine: dict[bool, Pristine], data: st.DataObject, mask: int, closed: bool, recovery_point: bool
) -> None:
    """Anywhere in a closed log, or in a sealed segment of a crashed one, with or without a readable recovery
    point: a sealed segment is never cut (it was fsynced when it rolled)."""
    p = pristine[closed]
    segments = len(p.segments) if closed and recovery_point else len(p.segments) - 1
    segment = data.draw(st.integers(0, segments - 1), label="segment")
    size = len(log_files(p.directory)[segment].read_bytes())
    byte = data.draw(st.integers(0, size - 1), label="byte")
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        if not recovery_point:
            (directory / RECOVERY_POINT).unlink()
        flip(log_files(directory)[segment], byte, mask)
        if closed:
            check_quarantined(directory, p, batches_touched(p, segment, byte, byte + 1))
        else:
            log = open_log(directory, **CONFIG)  # a crashed log: only its sealed segments are checked here
            assert sorted(d.base_offset for d in scrubbed(log)) == sorted(
                p.headers[i].base_offset for i in batches_touched(p, segment, byte, byte + 1)
            )
            log.close()


def scrubbed(log: SegmentLog) -> list[DamagedBatch]:
    offset = log.log_start_offset
    for _ in range(10_000):
        if offset >= log.log_end_offset:
            break
        offset = log.scrub(offset, 1000).next_offset
    return log.damaged_batches()


@PROPERTY
@given(data=st.data())
def test_a_zeroed_page_loses_only_the_batches_it_touches(pristine: dict[bool, Pristine], data: st.DataObject) -> None:
    p = pristine[True]
    segment = data.draw(st.integers(0, len(p.segments) - 1), label="segment")
    size = len(log_files(p.directory)[segment].read_bytes())
    start = data.draw(st.integers(0, size - 1), label="start")
    length = data.draw(st.integers(1, 1024), label="length")
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        path = log_files(directory)[segment]
        raw = bytearray(path.read_bytes())
        end = min(size, start + length)
        raw[start:end] = bytes(end - start)
        path.write_bytes(bytes(raw))
        check_quarantined(directory, p, zero_changes(p, segment, start, end))


@pytest.mark.parametrize("closed", [True, False])
def test_a_flipped_append_time_is_mended_from_the_origin_index_copy(
    pristine: dict[bool, Pristine], scratch: Path, closed: bool
) -> None:
    # append_time_ms (bytes 12-20 of a batch) is outside the CRC by design; the .oindex entry holds the second copy.
    # It is written when the segment seals, at a clean stop and at a checkpoint: a crashed log's active segment
    # has none (its entries were in memory), so there the flip is made in the last sealed segment.
    p = pristine[closed]
    directory = copy_of(p, scratch)
    segment = -1 if closed else -2
    position, _index = p.segments[segment][1]
    flip(log_files(directory)[segment], position + 19, 0x40)
    check_quarantined(directory, p, set())


def test_damage_in_a_middle_segment_never_deletes_a_later_segment(
    pristine: dict[bool, Pristine], scratch: Path
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    (directory / RECOVERY_POINT).unlink()
    position, index = p.segments[2][1]
    flip(log_files(directory)[2], position + 200, 0x01)
    log = open_log(directory, **CONFIG)
    assert log.segment_count == len(p.segments) and log.log_end_offset == p.log_end
    assert [d.base_offset for d in log.damaged_batches()] == [p.headers[index].base_offset]
    log.close()


def test_a_lost_log_file_whose_origin_index_survives_is_quarantined_whole(
    pristine: dict[bool, Pristine], scratch: Path
) -> None:
    p = pristine[True]
    for segment in (0, 3, len(p.segments) - 1):  # the first (not a retention leftover), a middle one, the active one
        directory = copy_of(p, scratch / str(segment))
        log_files(directory)[segment].unlink()
        check_quarantined(directory, p, {i for _pos, i in p.segments[segment]})


def test_a_missing_middle_segment_without_its_origin_index_is_refused_never_cut(
    pristine: dict[bool, Pristine], scratch: Path
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    missing = log_files(directory)[3]
    for path in (missing, missing.with_suffix(".oindex")):
        path.unlink()
    later = [f.name for f in log_files(directory)[3:]]
    start, end = p.headers[p.segments[3][0][1]].base_offset, p.headers[p.segments[4][0][1]].base_offset
    with pytest.raises(MissingSegment, match=f"holding offsets {start}..{end - 1} are missing"):
        open_log(directory, **CONFIG)
    assert [f.name for f in log_files(directory)[3:]] == later  # nothing after the hole was deleted


def test_damage_below_the_recovery_point_that_no_index_names_is_refused(
    pristine: dict[bool, Pristine], scratch: Path
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    victim = log_files(directory)[2]
    victim.with_suffix(".oindex").unlink()
    flip(victim, p.segments[2][1][0] + 50, 0x08)
    before = {f.name: f.read_bytes() for f in directory.iterdir() if f.suffix == ".log"}
    with pytest.raises(UnrepairableDamage, match=f"{victim.name} is damaged below the recovery point.*new epoch"):
        open_log(directory, **CONFIG)
    assert {f.name: f.read_bytes() for f in directory.iterdir() if f.suffix == ".log"} == before  # nothing cut


def test_a_cut_at_a_segment_start_leaves_an_empty_active_segment(pristine: dict[bool, Pristine], scratch: Path) -> None:
    p = pristine[False]
    directory = copy_of(p, scratch)
    last = log_files(directory)[-1]
    last.write_bytes(b"")
    base = int(last.stem)
    log = open_log(directory, **CONFIG)
    assert log.log_end_offset == base and log.segment_count == len(p.segments)
    assert log.read(LocalOffset(base), 100).data == b""
    # The crash left the active segment's index entries in memory only: no file names the batches that were lost.
    assert log.recovery.indexed_batches_lost == 0 and log.recovery.damaged_offset is None
    log.abandon()
    check_recovered(directory, p, p.segments[-1][0][1], corrupt=False)


def test_inconsistent_sealed_index_files_are_rebuilt_without_losing_data(
    pristine: dict[bool, Pristine], scratch: Path
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    oindex = sorted(directory.glob("*.oindex"))[1]
    oindex.write_bytes(oindex.read_bytes()[:-ORIGIN_ENTRY_BYTES])  # lost its last entry
    index = sorted(directory.glob("*.index"))[2]
    index.write_bytes(b"XXXX" + index.read_bytes()[4:])  # foreign magic
    log = open_log(directory, **CONFIG)
    assert log.recovery.indexes_rebuilt == 2 and log.recovery.damaged_offset is None
    assert log.recovery.segments_trusted == len(p.segments) - 3
    log.close()
    check_recovered(directory, p, len(p.batches))
    assert sorted(directory.glob("*.oindex"))[1].read_bytes() == sorted(p.directory.glob("*.oindex"))[1].read_bytes()


@pytest.mark.parametrize("field", ["base_origin_seq", "position", "size_bytes", "base_offset"])
def test_a_lying_origin_index_entry_is_rebuilt_from_the_batches_never_trusted(
    pristine: dict[bool, Pristine], scratch: Path, field: str
) -> None:
    """Issue 20, item 2 at the storage layer: an .oindex entry of a sealed segment names another seq (or
    position, size, offset) than its CRC-valid batch; the log must not believe it."""
    p = pristine[True]
    directory = copy_of(p, scratch)
    oindex = sorted(directory.glob("*.oindex"))[1]
    raw = bytearray(oindex.read_bytes())
    at = (
        FILE_HEADER.size
        + 2 * ORIGIN_ENTRY_BYTES
        + {"base_origin_seq": 43, "position": 59, "size_bytes": 63, "base_offset": 55}[field]
    )
    raw[at] ^= 0x02
    oindex.write_bytes(bytes(raw))
    log = open_log(directory, **CONFIG)
    assert log.recovery.indexes_rebuilt == 1 and log.damaged_batches() == []
    assert log.vector() == vector_of(p.headers)
    for origin, seqs in _seqs(p).items():
        for seq, base in seqs:
            assert log.offset_for_origin_seq(origin, OriginSeq(seq)) == base
    log.close()
    assert oindex.read_bytes() == sorted(p.directory.glob("*.oindex"))[1].read_bytes()


def _seqs(p: Pristine) -> dict[Origin, list[tuple[int, int]]]:
    out: dict[Origin, list[tuple[int, int]]] = {}
    for h in p.headers:
        out.setdefault(h.origin, []).append((h.base_origin_seq, h.base_offset))
    return out


def test_stray_temporary_files_are_removed(pristine: dict[bool, Pristine], scratch: Path) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    (directory / (RECOVERY_POINT + ".tmp")).write_bytes(b'{"format": 1, "recov')
    (directory / "00000000000000000000.oindex.tmp").write_bytes(b"GROI")
    log = open_log(directory, **CONFIG)
    assert log.recovery.files_removed == 2 and not list(directory.glob("*.tmp"))
    assert log.recovery.indexes_rebuilt == 0 and log.log_end_offset == p.log_end
    log.close()


@pytest.mark.parametrize("damage", ["not json", "flipped digit"])
def test_an_unreadable_recovery_point_means_validating_everything(
    pristine: dict[bool, Pristine], scratch: Path, damage: str
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    path = directory / RECOVERY_POINT
    if damage == "not json":
        path.write_text("not json")
    else:  # still JSON: only the checksum catches it
        text = path.read_text()
        digit = next(i for i, c in enumerate(text) if c.isdigit() and text[i - 1] == " ")
        path.write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1 :])
    log = open_log(directory, **CONFIG)
    assert log.recovery.segments_validated == len(p.segments) and log.recovery.segments_trusted == 0
    assert log.log_end_offset == p.log_end and log.recovery.indexes_rebuilt == 0
    assert log.vector() == vector_of(p.headers)
    log.close()
    again = open_log(directory, **CONFIG)  # open wrote a fresh recovery point
    assert again.recovery.segments_trusted == len(p.segments) - 1
    again.close()


def test_after_retention_the_vector_below_the_log_start_survives_a_lost_recovery_point(scratch: Path) -> None:
    log = open_log(scratch / "t-0", **CONFIG, retention_bytes=3000)
    w = Writer(log)
    for i in range(30):
        w.append((A, B)[i % 5 == 0], 2, value_bytes=120)
    assert log.enforce_retention(now_ms=0) > 0 and log.log_start_offset > 0
    vector = log.vector()
    log.close()
    (scratch / "t-0" / RECOVERY_POINT).unlink()
    again = open_log(scratch / "t-0", **CONFIG)
    assert again.vector() == vector
    again.close()
    for name in (RECOVERY_POINT, LOG_START):
        (scratch / "t-0" / name).unlink(missing_ok=True)
    with pytest.raises(StorageError, match=r"both missing or damaged.*new epoch"):
        open_log(scratch / "t-0", **CONFIG)


@pytest.mark.parametrize("damage", ["unreadable", "lists a good batch"])
def test_the_quarantine_list_is_derived_from_the_batches(
    pristine: dict[bool, Pristine], scratch: Path, damage: str
) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    position, index = p.segments[1][2]
    flip(log_files(directory)[1], position + 60, 0x10)
    log = open_log(directory, **CONFIG)
    assert [d.base_offset for d in scrubbed(log)] == [p.headers[index].base_offset]
    log.close()
    listed = directory / DAMAGED_FILE
    if damage == "unreadable":
        listed.write_bytes(listed.read_bytes()[:40])
    else:
        shutil.copy(log_files(p.directory)[1], log_files(directory)[1])  # the batch is good again
    log = open_log(directory, **CONFIG)
    want = [p.headers[index].base_offset] if damage == "unreadable" else []
    assert [d.base_offset for d in log.damaged_batches()] == want
    log.close()


def test_a_new_directory_opens_as_an_empty_log(scratch: Path) -> None:
    log: SegmentLog = open_log(scratch / "fresh", **CONFIG)
    assert (log.log_start_offset, log.log_end_offset, log.segment_count, log.vector()) == (0, 0, 1, {})
    log.close()


def test_the_first_segments_lost_after_retention_are_refused_never_skipped(scratch: Path) -> None:
    """Found by the damage campaign (seed 403): the first .log of a log lost, and the log started at its second
    segment, its vector still claiming the records of the first. Retention writes the log start first, so a log
    whose segments start later than that lost its first segments; one whose files retention left is tidied."""
    log = open_log(scratch / "t-0", **CONFIG, retention_bytes=6000)
    w = Writer(log)
    for i in range(40):
        w.append((A, B)[i % 5 == 0], 2, value_bytes=120)
    assert log.enforce_retention(now_ms=0) > 0
    log.close()
    first = log_files(scratch / "t-0")[0]
    start = int(first.stem)
    (scratch / "t-0" / "00000000000000000000.oindex").write_bytes(b"GROI")  # what a crash in retention leaves
    again = open_log(scratch / "t-0", **CONFIG)
    assert again.log_start_offset == start and not (scratch / "t-0" / "00000000000000000000.oindex").exists()
    again.close()
    for path in (first, first.with_suffix(".oindex"), first.with_suffix(".index")):
        path.unlink()
    second = int(log_files(scratch / "t-0")[0].stem)
    with pytest.raises(MissingSegment, match=f"holding offsets {start}..{second - 1} are missing"):
        open_log(scratch / "t-0", **CONFIG)
