"""One segment of a partition log: its ``.log``, ``.index`` and ``.oindex`` files.

The binary layouts of the three files are documented in
:mod:`georep.storage.segment_log`; the structs below implement them. This
module holds the per-segment mechanics: appending one batch to the three files
(and undoing it when a write fails), the batch-by-batch validation scan that
recovery and index rebuilds use, and positioning a read.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from georep.record.batch import (
    HEADER_BYTES,
    LENGTH_PREFIX_BYTES,
    BatchHeader,
    CorruptBatch,
    check_batch,
    frame_length,
    parse_header,
)
from georep.storage.api import BytesLike
from georep.storage.durable_file import replace_file

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
ORIGIN_INDEX_SUFFIX = ".oindex"

FILE_HEADER = struct.Struct(">4sB3x")  # magic, version, reserved
INDEX_MAGIC = b"GRSI"
ORIGIN_INDEX_MAGIC = b"GROI"
INDEX_FORMAT_VERSION = 1
INDEX_ENTRY = struct.Struct(">II")  # relative_offset, position
ORIGIN_ENTRY = struct.Struct(">32sIqiqIIqqhiq2x")
ORIGIN_ENTRY_APPEND_TIME_AT = 86  # byte range [86, 94) of an origin entry
ORIGIN_ENTRY_BYTES = ORIGIN_ENTRY.size  # 96
U32_MAX = 0xFFFFFFFF
SCAN_CHUNK_BYTES = 8 << 20
_BASE_OFFSET = struct.Struct(">q")

log = logging.getLogger(__name__)


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


def segment_paths(directory: Path, base_offset: int) -> tuple[Path, Path, Path]:
    name = segment_name(base_offset)
    return (directory / (name + LOG_SUFFIX), directory / (name + INDEX_SUFFIX),
            directory / (name + ORIGIN_INDEX_SUFFIX))  # fmt: skip


class ShortWrite(OSError):
    """A write made no progress without an error: the device is out of space."""


def pack_origin_entry(header: BatchHeader, base_offset: int, position: int, append_time_ms: int) -> bytes:
    """One ``.oindex`` entry for ``header`` stored at ``base_offset`` and byte ``position``."""
    return ORIGIN_ENTRY.pack(
        header.origin_site.encode("ascii"), header.origin_epoch, header.base_origin_seq,
        header.last_offset_delta, base_offset, position, header.size_bytes, header.max_timestamp,
        header.producer_id, header.producer_epoch, header.base_sequence, append_time_ms,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class OriginEntry:
    """One decoded ``.oindex`` entry."""

    origin_site: bytes  # NUL-padded
    origin_epoch: int
    base_origin_seq: int
    last_offset_delta: int
    base_offset: int
    position: int
    size_bytes: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    append_time_ms: int

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def next_origin_seq(self) -> int:
        return self.base_origin_seq + self.last_offset_delta + 1


def iter_origin_entries(entries: BytesLike) -> Iterator[OriginEntry]:
    for fields in ORIGIN_ENTRY.iter_unpack(entries):
        yield OriginEntry(*fields)


def _write_all(fd: int, buffers: Sequence[BytesLike], position: int, size: int) -> None:
    """Write ``size`` bytes from ``buffers`` at ``position``: one ``pwritev`` unless it comes up short."""
    done = os.pwritev(fd, buffers, position)
    if done == size:
        return
    # A regular file writes short when space runs out part way (the next call
    # then fails with ENOSPC) or past 2 GiB in one call; keep going to find out.
    views = [memoryview(b).cast("B") for b in buffers]
    for _ in range(64):
        if done >= size:
            return
        rest: list[memoryview] = []
        skip = done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.pwritev(fd, rest, position + done)
        if n <= 0:
            raise ShortWrite(errno.ENOSPC, f"short write: {done} of {size} bytes")
        done += n
    raise ShortWrite(errno.ENOSPC, f"short write: {done} of {size} bytes after repeated attempts")


def _open_rw(path: Path, *, create: bool = False) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
    return os.open(path, flags, 0o600)  # a data dir's files are its owner's only (georep/storage/private.py)


def read_index_file(path: Path, magic: bytes, entry_bytes: int) -> bytes | None:
    """The entries of an index file, or ``None`` if it is missing, foreign or torn."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < FILE_HEADER.size or (len(data) - FILE_HEADER.size) % entry_bytes:
        return None
    file_magic, version = FILE_HEADER.unpack_from(data)
    if file_magic != magic or version != INDEX_FORMAT_VERSION:
        return None
    return data[FILE_HEADER.size :]


@dataclass(slots=True)
class ScanResult:
    """What a batch-by-batch validation of a ``.log`` found."""

    valid_end: int  # byte position after the last whole, valid batch
    next_offset: int  # the local offset the next batch must have
    origin_entries: bytearray
    index_entries: bytearray
    damage: str | None  # why the scan stopped before the file's end
    indexed_batches_lost: int  # origin-index entries past the valid end: batches that were appended, now gone


def scan_log(fd: int, base_offset: int, log_size: int, index_interval_bytes: int,
             recorded_entries: bytes | None) -> ScanResult:  # fmt: skip
    """Validate a segment's batches (framing, CRC, offset continuity) and build its indexes.

    Stops at the first batch that is torn, corrupt, out of sequence, or whose
    ``append_time_ms`` (outside the CRC) disagrees with ``recorded_entries``,
    the existing origin index, on an otherwise identical entry.
    """
    origin_entries = bytearray()
    index_entries = bytearray()
    since_index = 0
    pos = 0
    expected = base_offset
    count = 0
    buf = b""
    buf_at = 0
    damage: str | None = None
    at_time = slice(ORIGIN_ENTRY_APPEND_TIME_AT, ORIGIN_ENTRY_APPEND_TIME_AT + 8)
    while pos < log_size:  # each pass advances pos by at least HEADER_BYTES or stops
        if log_size - pos < HEADER_BYTES:
            damage = f"torn batch: only {log_size - pos} bytes at byte {pos}"
            break
        if pos + HEADER_BYTES > buf_at + len(buf):
            buf = os.pread(fd, max(SCAN_CHUNK_BYTES, HEADER_BYTES), pos)
            buf_at = pos
        try:
            size = frame_length(buf, pos - buf_at)
            if pos + size > log_size:
                damage = f"torn batch at byte {pos}: it claims {size} bytes, {log_size - pos} remain"
                break
            if pos + size > buf_at + len(buf):
                buf = os.pread(fd, max(SCAN_CHUNK_BYTES, size), pos)
                buf_at = pos
            header = check_batch(buf, pos - buf_at)
        except CorruptBatch as exc:
            damage = str(exc)
            break
        if header.base_offset != expected:
            damage = f"batch at byte {pos} has base_offset {header.base_offset}, expected {expected}"
            break
        if not header.stamped:
            damage = f"batch at byte {pos} has no origin seq"
            break
        if header.base_offset - base_offset > U32_MAX or pos > U32_MAX:
            damage = f"batch at byte {pos} is beyond what a segment can index"
            break
        try:
            entry = pack_origin_entry(header, header.base_offset, pos, header.append_time_ms)
        except (UnicodeEncodeError, struct.error) as exc:
            damage = f"batch at byte {pos} has an origin that cannot be indexed: {exc}"
            break
        if recorded_entries is not None and len(recorded_entries) >= (count + 1) * ORIGIN_ENTRY_BYTES:
            recorded = recorded_entries[count * ORIGIN_ENTRY_BYTES : (count + 1) * ORIGIN_ENTRY_BYTES]
            if recorded[: at_time.start] == entry[: at_time.start] and recorded[at_time] != entry[at_time]:
                # append_time_ms is outside the CRC; the origin index holds a
                # second copy, and the log cannot tell which of the two is damaged.
                damage = f"batch at byte {pos}: append_time_ms disagrees with the origin index"
                break
        if since_index >= index_interval_bytes:
            index_entries += INDEX_ENTRY.pack(header.base_offset - base_offset, pos)
            since_index = 0
        since_index += size
        origin_entries += entry
        pos += size
        expected = header.next_offset
        count += 1
    recorded_count = 0 if recorded_entries is None else len(recorded_entries) // ORIGIN_ENTRY_BYTES
    return ScanResult(pos, expected, origin_entries, index_entries, damage, max(0, recorded_count - count))


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    validated: bool  # scanned batch by batch (rather than trusted)
    rebuilt: bool  # index files rewritten from the log
    damage: str | None  # why the log was cut; None when it was whole
    damaged_position: int  # byte position of the cut (the old size when whole)
    indexed_batches_lost: int = 0


class Segment:
    """A segment's open files and what is kept in memory about them.

    Not thread-safe on its own: ``SegmentLog`` serialises mutation.
    """

    __slots__ = (
        "directory", "base_offset", "log_fd", "index_fd", "oindex_fd", "size", "next_offset", "batch_count",
        "first_append_time_ms", "index_relative_offsets", "index_positions", "running_max_timestamps",
        "_since_index", "_index_end", "_oindex_end",
    )  # fmt: skip

    def __init__(self, directory: Path, base_offset: int, log_fd: int, index_fd: int, oindex_fd: int,
                 size: int, next_offset: int, origin_entries: BytesLike, index_entries: BytesLike) -> None:  # fmt: skip
        self.directory = directory
        self.base_offset = base_offset
        self.log_fd = log_fd
        self.index_fd = index_fd
        self.oindex_fd = oindex_fd
        self.size = size
        self.next_offset = next_offset
        self.batch_count = len(origin_entries) // ORIGIN_ENTRY_BYTES
        self.first_append_time_ms = -1
        # The sparse index in memory: relative offsets and positions, both increasing.
        self.index_relative_offsets: array[int] = array("q")
        self.index_positions: array[int] = array("q")
        for rel, position in INDEX_ENTRY.iter_unpack(index_entries):
            self.index_relative_offsets.append(rel)
            self.index_positions.append(position)
        # Running maximum of the batches' max_timestamp: monotonic, so the first
        # batch with max_timestamp >= t is a bisect.
        self.running_max_timestamps: array[int] = array("q")
        running = -(1 << 63)
        for entry in iter_origin_entries(origin_entries):
            if self.first_append_time_ms < 0:
                self.first_append_time_ms = entry.append_time_ms
            running = max(running, entry.max_timestamp)
            self.running_max_timestamps.append(running)
        self._since_index = size - (self.index_positions[-1] if self.index_positions else 0)
        self._index_end = FILE_HEADER.size + len(self.index_positions) * INDEX_ENTRY.size
        self._oindex_end = FILE_HEADER.size + self.batch_count * ORIGIN_ENTRY_BYTES

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, base_offset: int) -> Segment:
        """A new, empty segment (the caller fsyncs the directory)."""
        paths = segment_paths(directory, base_offset)
        fds: list[int] = []
        try:
            for path in paths:
                fds.append(_open_rw(path, create=True))
            _write_all(fds[1], [FILE_HEADER.pack(INDEX_MAGIC, INDEX_FORMAT_VERSION)], 0, FILE_HEADER.size)
            _write_all(fds[2], [FILE_HEADER.pack(ORIGIN_INDEX_MAGIC, INDEX_FORMAT_VERSION)], 0, FILE_HEADER.size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            for path in paths:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        return cls(directory, base_offset, fds[0], fds[1], fds[2], 0, base_offset, b"", b"")

    @classmethod
    def load(cls, directory: Path, base_offset: int, index_interval_bytes: int,
             trusted_next_offset: int | None) -> tuple[Segment, LoadOutcome]:  # fmt: skip
        """Open an existing segment, validating it unless it may be trusted.

        ``trusted_next_offset`` is given for sealed segments below the recovery
        point: the segment is then trusted if its index files are present and
        consistent with the log's size and with the next segment's base offset.
        Otherwise every batch is validated; the log is cut at the first damaged
        batch, and index files that do not match the validated log are rebuilt.
        """
        log_path, index_path, oindex_path = segment_paths(directory, base_offset)
        log_fd = _open_rw(log_path)
        try:
            log_size = os.fstat(log_fd).st_size
            origin_entries = read_index_file(oindex_path, ORIGIN_INDEX_MAGIC, ORIGIN_ENTRY_BYTES)
            index_entries = read_index_file(index_path, INDEX_MAGIC, INDEX_ENTRY.size)
            if trusted_next_offset is not None and _consistent(
                base_offset, log_size, trusted_next_offset, origin_entries, index_entries
            ):
                assert origin_entries is not None and index_entries is not None
                outcome = LoadOutcome(False, False, None, log_size)
                next_offset = trusted_next_offset
                size = log_size
            else:
                scan = scan_log(log_fd, base_offset, log_size, index_interval_bytes, origin_entries)
                if scan.damage is not None:
                    os.ftruncate(log_fd, scan.valid_end)
                os.fdatasync(log_fd)  # what was validated is durable before the recovery point moves
                rebuilt = bytes(scan.origin_entries) != origin_entries or bytes(scan.index_entries) != index_entries
                if rebuilt:
                    replace_file(oindex_path, FILE_HEADER.pack(ORIGIN_INDEX_MAGIC, INDEX_FORMAT_VERSION)
                                 + scan.origin_entries, sync_directory=False)  # fmt: skip
                    replace_file(index_path, FILE_HEADER.pack(INDEX_MAGIC, INDEX_FORMAT_VERSION)
                                 + scan.index_entries, sync_directory=False)  # fmt: skip
                origin_entries = bytes(scan.origin_entries)
                index_entries = bytes(scan.index_entries)
                outcome = LoadOutcome(True, rebuilt, scan.damage, scan.valid_end, scan.indexed_batches_lost)
                next_offset = scan.next_offset
                size = scan.valid_end
            index_fd = _open_rw(index_path)
        except BaseException:
            os.close(log_fd)
            raise
        try:
            oindex_fd = _open_rw(oindex_path)
        except BaseException:
            os.close(log_fd)
            os.close(index_fd)
            raise
        segment = cls(directory, base_offset, log_fd, index_fd, oindex_fd, size, next_offset,
                      origin_entries, index_entries)  # fmt: skip
        return segment, outcome

    def sync(self) -> None:
        """fdatasync the log and both index files."""
        os.fdatasync(self.log_fd)
        os.fdatasync(self.index_fd)
        os.fdatasync(self.oindex_fd)

    def close(self) -> None:
        for fd in (self.log_fd, self.index_fd, self.oindex_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def delete(self) -> None:
        """Close and remove the files; the ``.log`` first, so a crash leaves at most orphan indexes."""
        self.close()
        for path in segment_paths(self.directory, self.base_offset):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # -- append ----------------------------------------------------------------------------------

    def append(self, header: BatchHeader, prefix: bytes, body: Sequence[BytesLike], base_offset: int,
               append_time_ms: int, index_interval_bytes: int) -> None:  # fmt: skip
        """Write one batch to the log, then its index entries. On any failure, undo and raise."""
        position = self.size
        size = header.size_bytes
        origin_entry = pack_origin_entry(header, base_offset, position, append_time_ms)
        index_entry = None
        if self._since_index >= index_interval_bytes:
            index_entry = INDEX_ENTRY.pack(base_offset - self.base_offset, position)
        try:
            _write_all(self.log_fd, [prefix, *body], position, size)
            if index_entry is not None:
                _write_all(self.index_fd, [index_entry], self._index_end, INDEX_ENTRY.size)
            _write_all(self.oindex_fd, [origin_entry], self._oindex_end, ORIGIN_ENTRY_BYTES)
        except BaseException:
            self._truncate_to_tracked_sizes()
            raise
        if index_entry is not None:
            self.index_relative_offsets.append(base_offset - self.base_offset)
            self.index_positions.append(position)
            self._index_end += INDEX_ENTRY.size
            self._since_index = 0
        self._since_index += size
        self._oindex_end += ORIGIN_ENTRY_BYTES
        if not self.batch_count:
            self.first_append_time_ms = append_time_ms
        previous_max = self.running_max_timestamps[-1] if self.batch_count else header.max_timestamp
        self.running_max_timestamps.append(max(previous_max, header.max_timestamp))
        self.batch_count += 1
        self.size = position + size
        self.next_offset = base_offset + header.last_offset_delta + 1

    def _truncate_to_tracked_sizes(self) -> None:
        for fd, size in ((self.log_fd, self.size), (self.index_fd, self._index_end),
                         (self.oindex_fd, self._oindex_end)):  # fmt: skip
            try:
                os.ftruncate(fd, size)
            except OSError as exc:
                # Later writes go to the tracked position and overwrite the
                # leftover; recovery cuts whatever remains past the last batch.
                log.error("segment %s in %s: cannot truncate a failed append back to %d bytes: %s",
                          segment_name(self.base_offset), self.directory, size, exc)  # fmt: skip

    def seal(self) -> None:
        """Make the segment durable and exactly its tracked size before it stops being active."""
        if os.fstat(self.log_fd).st_size != self.size:
            os.ftruncate(self.log_fd, self.size)
        self.sync()

    # -- lookups ---------------------------------------------------------------------------------

    @property
    def max_timestamp(self) -> int:
        return self.running_max_timestamps[-1] if self.batch_count else -(1 << 63)

    def index_position(self, offset: int) -> int:
        """Byte position of the last sparse-index entry at or before ``offset`` (0 if none)."""
        i = bisect_right(self.index_relative_offsets, offset - self.base_offset) - 1
        return self.index_positions[i] if i >= 0 else 0

    def first_batch_at_or_after_timestamp(self, timestamp_ms: int) -> int | None:
        """Index (within this segment) of the first batch with max_timestamp >= ``timestamp_ms``."""
        i = bisect_left(self.running_max_timestamps, timestamp_ms)
        return i if i < self.batch_count else None

    def entry_at_offset(self, offset: int) -> OriginEntry | None:
        """The origin-index entry of the batch holding ``offset`` (a bisect over the ``.oindex`` file)."""
        lo, hi = 0, self.batch_count
        while lo < hi:
            mid = (lo + hi) // 2
            entry = OriginEntry(*ORIGIN_ENTRY.unpack(self.origin_entries(mid, 1)))
            if entry.next_offset <= offset:
                lo = mid + 1
            elif entry.base_offset > offset:
                hi = mid
            else:
                return entry
        return None

    def origin_entries(self, start: int = 0, count: int | None = None) -> bytes:
        """``count`` origin-index entries from entry ``start``, read from the ``.oindex`` file."""
        if count is None:
            count = self.batch_count - start
        return os.pread(self.oindex_fd, count * ORIGIN_ENTRY_BYTES, FILE_HEADER.size + start * ORIGIN_ENTRY_BYTES)


def _consistent(base_offset: int, log_size: int, next_offset: int,
                origin_entries: bytes | None, index_entries: bytes | None) -> bool:  # fmt: skip
    """Whether a sealed segment's index files agree with its log and its successor."""
    if origin_entries is None or index_entries is None or not origin_entries:
        return False
    first = OriginEntry(*ORIGIN_ENTRY.unpack_from(origin_entries, 0))
    last = OriginEntry(*ORIGIN_ENTRY.unpack_from(origin_entries, len(origin_entries) - ORIGIN_ENTRY_BYTES))
    if first.base_offset != base_offset or first.position != 0:
        return False
    if last.position + last.size_bytes != log_size or last.next_offset != next_offset:
        return False
    if index_entries:
        _, last_position = INDEX_ENTRY.unpack_from(index_entries, len(index_entries) - INDEX_ENTRY.size)
        if last_position >= log_size:
            return False
    return True


def read_batches(fd: int, offset: int, position: int, limit: int, limit_offset: int,
                 max_bytes: int) -> tuple[bytes, int, int]:  # fmt: skip
    """Whole batches from the one containing ``offset``, within ``[position, limit)`` of one segment.

    ``position`` is a batch boundary at or before the batch holding ``offset``
    (from the sparse index); ``limit`` is the segment's size when the read
    began, so bytes of a later append are never returned; ``limit_offset`` is
    the local offset at ``limit``. Returns the bytes, the next offset and the
    bytes' position in the segment. Raises ``CorruptBatch`` when the framing
    does not hold (the caller looks for the damage with the origin index).
    """
    start = position
    prefix = os.pread(fd, LENGTH_PREFIX_BYTES, start)
    size = frame_length(prefix)
    (base,) = _BASE_OFFSET.unpack_from(prefix)
    if base > offset:
        raise CorruptBatch(f"sparse index points past offset {offset}: batch at byte {start} has base {base}")
    # Forward scan of 12-byte prefixes: stop at the last batch whose base is <= offset.
    while start + size < limit:
        prefix = os.pread(fd, LENGTH_PREFIX_BYTES, start + size)
        (next_base,) = _BASE_OFFSET.unpack_from(prefix)
        if next_base > offset:
            break
        start += size
        size = frame_length(prefix)
    want = min(max(max_bytes, size), limit - start)
    data = os.pread(fd, want, start)
    if len(data) != want:
        raise CorruptBatch(f"segment is shorter than its recorded size: read {len(data)} of {want} bytes")
    if start + want == limit:  # the segment holds whole batches only, up to its recorded size
        return data, limit_offset, start
    end = 0
    last = 0
    while end + LENGTH_PREFIX_BYTES <= want:  # at least one batch fits: want >= size
        n = frame_length(data, end)
        if end + n > want:
            break
        last = end
        end += n
    next_offset = parse_header(data, last).next_offset
    return (data if end == want else data[:end]), next_offset, start
