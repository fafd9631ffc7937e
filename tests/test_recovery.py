"""Recovery of the segment log after torn writes, flipped bytes and damaged directories.

Each property copies a pristine partition directory (built once per module),
damages the copy, reopens it and checks what a reader would see: every whole
batch before the damage, byte for byte, and nothing from the damaged batch on.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from georep.record.batch import BatchHeader, check_batch, iter_headers
from georep.storage.api import OffsetOutOfRange
from georep.storage.recovery_point import FILE_NAME as RECOVERY_POINT
from georep.storage.segment_log import MissingSegment, SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from tests.support.segments import A, B, C, Writer, log_files, open_log

CONFIG = {"segment_bytes_max": 2048, "index_interval_bytes": 256}
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Pristine:
    directory: Path
    batches: list[bytes]  # every batch as stored, in log order
    headers: list[BatchHeader]
    segments: list[list[tuple[int, int]]]  # per .log file: (byte position, batch index) of each batch

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
    """Reopen: batches [0, intact) are served unchanged, nothing after, and appends continue.

    ``corrupt``: whether bytes of the first lost batch remain in the file (a
    cut between two batches leaves a shorter log with nothing damaged in it).
    """
    log = open_log(directory, **CONFIG)
    end = p.headers[intact].base_offset if intact < len(p.batches) else p.log_end
    assert log.log_end_offset == end
    if intact < len(p.batches) and corrupt:
        assert log.recovery.damaged_offset == end and log.recovery.damage
    else:
        assert log.recovery.damaged_offset is None
    for i in range(intact):
        assert log.read(p.headers[i].base_offset, 1).data == p.batches[i]
    assert log.read(LocalOffset(end), 1 << 20).data == b""
    with pytest.raises(OffsetOutOfRange):
        log.read(LocalOffset(end + 1), 1)
    expected_vector: dict[Origin, int] = {}
    for h in p.headers[:intact]:
        expected_vector[h.origin] = h.next_origin_seq
    assert log.vector() == expected_vector
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
    assert [h.base_offset for h in iter_headers(again.read(again.log_start_offset, 1 << 20).data)][0] == 0
    again.close()


@PROPERTY
@given(data=st.data(), closed=st.booleans())
def test_a_torn_tail_is_cut_at_the_last_whole_batch(pristine: dict[bool, Pristine], data: st.DataObject,
                                                    closed: bool) -> None:  # fmt: skip
    p = pristine[closed]
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
@given(data=st.data(), mask=st.integers(1, 255), closed=st.booleans())
def test_a_flipped_byte_in_the_active_segment_cuts_the_log_at_its_batch(
    pristine: dict[bool, Pristine], data: st.DataObject, mask: int, closed: bool
) -> None:
    p = pristine[closed]
    last = len(p.segments) - 1
    size = len(log_files(p.directory)[last].read_bytes())
    byte = data.draw(st.integers(0, size - 1), label="byte")
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        flip(log_files(directory)[last], byte, mask)
        check_recovered(directory, p, p.batch_at(last, byte))


@PROPERTY
@given(data=st.data(), mask=st.integers(1, 255))
def test_without_a_recovery_point_a_flipped_byte_anywhere_is_found(
    pristine: dict[bool, Pristine], data: st.DataObject, mask: int
) -> None:
    p = pristine[True]
    sizes = [path.stat().st_size for path in log_files(p.directory)]
    byte = data.draw(st.integers(0, sum(sizes) - 1), label="byte")
    segment = 0
    while byte >= sizes[segment]:
        byte -= sizes[segment]
        segment += 1
    with tempfile.TemporaryDirectory() as tmp:
        directory = copy_of(p, tmp)
        (directory / RECOVERY_POINT).unlink()
        flip(log_files(directory)[segment], byte, mask)
        check_recovered(directory, p, p.batch_at(segment, byte))
        assert len(log_files(directory)) == segment + 1  # every later segment was deleted


@pytest.mark.parametrize("closed", [True, False])
def test_a_flipped_append_time_is_caught_by_the_origin_index_copy(pristine: dict[bool, Pristine], scratch: Path,
                                                                  closed: bool) -> None:  # fmt: skip
    # append_time_ms (bytes 12-20 of a batch) is outside the CRC by design; the
    # .oindex entry holds the second copy that recovery compares it with.
    p = pristine[closed]
    directory = copy_of(p, scratch)
    position, index = p.segments[-1][1]
    flip(log_files(directory)[-1], position + 19, 0x40)
    check_recovered(directory, p, index)


def test_damage_in_a_middle_segment_deletes_every_later_segment(pristine: dict[bool, Pristine],
                                                                scratch: Path) -> None:  # fmt: skip
    p = pristine[True]
    directory = copy_of(p, scratch)
    (directory / RECOVERY_POINT).unlink()
    position, index = p.segments[2][1]
    flip(log_files(directory)[2], position + 200, 0x01)
    log = open_log(directory, **CONFIG)
    assert log.recovery.segments_deleted == len(p.segments) - 3
    assert log.segment_count == 3 and log.log_end_offset == p.headers[index].base_offset
    assert sorted(f.name for f in directory.iterdir() if not f.name.startswith(RECOVERY_POINT)) == sorted(
        f"{p.headers[p.segments[s][0][1]].base_offset:020d}{suffix}" for s in range(3)
        for suffix in (".log", ".index", ".oindex"))  # fmt: skip
    log.close()


def test_a_missing_middle_segment_is_refused_never_cut(pristine: dict[bool, Pristine], scratch: Path) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    missing = log_files(directory)[3]
    missing.unlink()
    later = [f.name for f in log_files(directory)[3:]]
    start, end = p.headers[p.segments[3][0][1]].base_offset, p.headers[p.segments[4][0][1]].base_offset
    with pytest.raises(MissingSegment, match=f"holding offsets {start}..{end - 1} are missing"):
        open_log(directory, **CONFIG)
    assert [f.name for f in log_files(directory)[3:]] == later  # nothing after the hole was deleted


def test_a_cut_at_a_segment_start_leaves_an_empty_active_segment(pristine: dict[bool, Pristine],
                                                                 scratch: Path) -> None:  # fmt: skip
    p = pristine[False]
    directory = copy_of(p, scratch)
    last = log_files(directory)[-1]
    last.write_bytes(b"")
    base = int(last.stem)
    log = open_log(directory, **CONFIG)
    assert log.log_end_offset == base and log.segment_count == len(p.segments)
    assert log.read(LocalOffset(base), 100).data == b""
    assert log.recovery.indexed_batches_lost == len(p.segments[-1]) and log.recovery.damaged_offset is None
    log.abandon()
    check_recovered(directory, p, p.segments[-1][0][1], corrupt=False)


def test_inconsistent_sealed_index_files_are_rebuilt_without_losing_data(pristine: dict[bool, Pristine],
                                                                         scratch: Path) -> None:  # fmt: skip
    p = pristine[True]
    directory = copy_of(p, scratch)
    oindex = sorted(directory.glob("*.oindex"))[1]
    oindex.write_bytes(oindex.read_bytes()[:-96])  # lost its last entry
    index = sorted(directory.glob("*.index"))[2]
    index.write_bytes(b"XXXX" + index.read_bytes()[4:])  # foreign magic
    log = open_log(directory, **CONFIG)
    assert log.recovery.indexes_rebuilt == 2 and log.recovery.damaged_offset is None
    assert log.recovery.segments_trusted == len(p.segments) - 3
    log.close()
    check_recovered(directory, p, len(p.batches))
    assert sorted(directory.glob("*.oindex"))[1].read_bytes() == sorted(p.directory.glob("*.oindex"))[1].read_bytes()


def test_stray_temporary_files_are_removed(pristine: dict[bool, Pristine], scratch: Path) -> None:
    p = pristine[True]
    directory = copy_of(p, scratch)
    (directory / (RECOVERY_POINT + ".tmp")).write_bytes(b'{"format": 1, "recov')
    (directory / "00000000000000000000.oindex.tmp").write_bytes(b"GROI")
    log = open_log(directory, **CONFIG)
    assert log.recovery.files_removed == 2 and not list(directory.glob("*.tmp"))
    assert log.recovery.indexes_rebuilt == 0 and log.log_end_offset == p.log_end
    log.close()


def test_an_unreadable_recovery_point_means_validating_everything(pristine: dict[bool, Pristine],
                                                                  scratch: Path) -> None:  # fmt: skip
    p = pristine[True]
    directory = copy_of(p, scratch)
    (directory / RECOVERY_POINT).write_text("not json")
    log = open_log(directory, **CONFIG)
    assert log.recovery.segments_validated == len(p.segments) and log.recovery.segments_trusted == 0
    assert log.log_end_offset == p.log_end and log.recovery.indexes_rebuilt == 0
    log.close()
    again = open_log(directory, **CONFIG)  # open wrote a fresh recovery point
    assert again.recovery.segments_trusted == len(p.segments) - 1
    again.close()


def test_a_new_directory_opens_as_an_empty_log(scratch: Path) -> None:
    log: SegmentLog = open_log(scratch / "fresh", **CONFIG)
    assert (log.log_start_offset, log.log_end_offset, log.segment_count, log.vector()) == (0, 0, 1, {})
    log.close()
