"""One segment of a partition log: its ``.log``, ``.index`` and ``.oindex`` files.

The binary layouts of the three files are documented in
:mod:`georep.storage.segment_log`; the structs below implement them. This
module holds the per-segment mechanics: appending one batch (and undoing it
when the write fails), the batch-by-batch validation scan that recovery and
index rebuilds use, and positioning a read.

An append writes the ``.log`` only. Its index entries stay in memory (the
sparse index for every segment, the origin-index entries not yet written in
``pending``) and go to the index files when the segment seals, when the log
closes, at a checkpoint (before the recovery point moves past them) and when
more than ``PENDING_BYTES_MAX`` of them wait. Both index files are derived
from the ``.log``: recovery walks the active segment and writes whatever the
files lack, so a crash loses no record, only the work of indexing it again.
This way a written partition keeps one file open, not three (issue 22).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import struct
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import crc32c

from georep.record.batch import (
    CRC_START,
    HEADER_BYTES,
    LENGTH_PREFIX_BYTES,
    BatchHeader,
    CorruptBatch,
    check_batch,
    frame_length,
    parse_header,
)
from georep.storage.api import BytesLike, StorageError
from georep.storage.durable_file import replace_file
from georep.storage.handle_cache import HANDLES, close_quietly
from georep.storage.index_format import (
    FILE_HEADER,
    INDEX_ENTRY,
    INDEX_FORMAT_VERSION,
    INDEX_MAGIC,
    ORIGIN_ENTRY,
    ORIGIN_ENTRY_BYTES,
    ORIGIN_INDEX_FORMAT_VERSION,
    ORIGIN_INDEX_MAGIC,
    U32_MAX,
    OriginEntry,
    entries_of_file,
    file_bytes,
    iter_origin_entries,
    pack_entries,
    pack_origin_entry,
    sparse_index,
)
from georep.storage.slots import OriginKey, SegmentPlan, plan_segment, trusted_prefix

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
ORIGIN_INDEX_SUFFIX = ".oindex"

SCAN_CHUNK_BYTES = 8 << 20
# Origin-index entries kept in memory before they are written out (about 2,600 batches): bounds a hot partition's
# memory between checkpoints; a round-robin produce over 10,000 partitions never reaches it.
PENDING_BYTES_MAX = 256 << 10
_BASE_OFFSET = struct.Struct(">q")

log = logging.getLogger(__name__)

__all__ = ["ORIGIN_ENTRY", "ORIGIN_ENTRY_BYTES", "U32_MAX", "OriginEntry", "iter_origin_entries", "pack_origin_entry"]


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


def segment_paths(directory: Path, base_offset: int) -> tuple[Path, Path, Path]:
    name = segment_name(base_offset)
    return (
        directory / (name + LOG_SUFFIX),
        directory / (name + INDEX_SUFFIX),
        directory / (name + ORIGIN_INDEX_SUFFIX),
    )


def index_paths(directory: Path, base_offset: int) -> tuple[str, str]:
    """The ``.index`` and ``.oindex`` paths as strings, for ``os.open``: a checkpoint opens one at each partition a
    retention run visits, and building three ``Path`` objects was a third of the visit (``bench/checkpoint.py``)."""
    stem = os.path.join(directory, segment_name(base_offset))
    return stem + INDEX_SUFFIX, stem + ORIGIN_INDEX_SUFFIX


class UnrepairableDamage(StorageError):
    """Damage below the recovery point that the origin index cannot name: the log is refused, never cut."""


class ShortWrite(OSError):
    """A write made no progress without an error: the device is out of space."""


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


def _open_rw(path: Path | str, *, create: bool = False) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
    return os.open(path, flags, 0o600)  # a data dir's files are its owner's only (georep/storage/private.py)


def read_index_file(path: Path, magic: bytes, version: int, entry_bytes: int) -> bytes | None:
    """The entries of an index file, or ``None`` if it is missing, foreign, of another version or torn."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # not Path.read_bytes: two per segment at every start
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):  # ends at end of file: each pass reads at least one byte
            chunks.append(chunk)
    finally:
        os.close(fd)
    return entries_of_file(b"".join(chunks), magic, version, entry_bytes)


class LogBytes:
    """A segment's ``.log`` as :class:`georep.storage.slots.SegmentBytes`: what lies at a byte position.

    Reads go through one buffer of ``SCAN_CHUNK_BYTES`` (a walk from byte 0 is sequential), and a batch larger
    than the buffer is read whole.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self._size = size
        self._buf = b""
        self._at = 0

    @property
    def size(self) -> int:
        return self._size

    def _bytes(self, position: int, count: int) -> memoryview:
        if not (self._at <= position and position + count <= self._at + len(self._buf)):
            self._buf = os.pread(self.fd, max(SCAN_CHUNK_BYTES, count), position)
            self._at = position
        start = position - self._at
        return memoryview(self._buf)[start : start + count]

    def batch_at(self, position: int) -> BatchHeader | str:
        left = self._size - position
        if left < HEADER_BYTES:
            return f"torn batch: only {max(left, 0)} bytes at byte {position}"
        try:
            size = frame_length(self._bytes(position, LENGTH_PREFIX_BYTES))
            if size > left:
                return f"torn batch at byte {position}: it claims {size} bytes, {left} remain"
            header = check_batch(self._bytes(position, size))
        except CorruptBatch as exc:
            return f"{exc} (at byte {position})"
        if not header.stamped:
            return f"batch at byte {position} has no origin seq"
        return header

    def crc_of(self, position: int, size_bytes: int) -> int | None:
        if size_bytes < HEADER_BYTES or position + size_bytes > self._size:
            return None
        return int(crc32c.crc32c(self._bytes(position, size_bytes)[CRC_START:]))


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    validated: bool  # walked batch by batch (rather than trusted from its index files)
    rebuilt: bool  # index files rewritten from the log
    plan: SegmentPlan | None  # what the walk decided, when it walked
    indexed_batches_lost: int = 0  # origin-index entries past the kept end: appended, their bytes did not survive
    # Index files that lacked only the entries after their end (what a crash leaves when the entries were still in
    # memory), completed in place: derived, like a rebuild, but nothing there was wrong, so nothing is fsynced.
    extended: bool = False
    # The origin-index entries the segment holds, as loaded: the log's open folds them into memory without
    # reopening the files (with 10,000 partitions, three opens each through the handle cache).
    origin_entries: BytesLike = b""


class Segment:
    """A segment's files and what is kept in memory about them.

    The files are opened on demand through the process's :data:`georep.storage.handle_cache.HANDLES`, which
    closes least recently used segments beyond its bound; ``owner`` is the lock of the log holding the segment,
    held around every use of the descriptors (``SegmentLog`` serialises mutation).
    """

    __slots__ = (
        "_dirty",
        "_index_written",
        "_indexes_synced",
        "_log_path",
        "_oindex_written",
        "_pending",
        "_since_index",
        "_writes",
        "base_offset",
        "batch_count",
        "directory",
        "first_append_time_ms",
        "index_positions",
        "index_relative_offsets",
        "next_offset",
        "owner",
        "running_max_timestamps",
        "size",
    )

    def __init__(
        self,
        directory: Path,
        base_offset: int,
        owner: threading.Lock,
        size: int,
        next_offset: int,
        origin_entries: BytesLike,
        index_entries: BytesLike,
    ) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self._log_path = os.path.join(directory, segment_name(base_offset) + LOG_SUFFIX)  # opened at every miss
        self.owner = owner
        self.size = size
        self.next_offset = next_offset
        self._dirty = False  # written since the last fsync of all three files
        self._writes = 0  # writes so far: a flush marks the files clean only if none came after its fsync began
        self._remember(origin_entries, index_entries)

    # -- the files, through the handle cache -----------------------------------------------------

    @property
    def log_fd(self) -> int:
        return HANDLES.fds(self)[0]

    def open_files(self) -> tuple[int]:
        """The ``.log`` only: the index files are written at seal and read through a descriptor of their own."""
        return (_open_rw(self._log_path),)

    def release_files(self, fds: tuple[int, ...]) -> bool:
        """fsync unsynced writes, then close: the handle cache's eviction (``owner`` held)."""
        if self._dirty:
            try:
                for fd in fds:
                    os.fdatasync(fd)
            except OSError as exc:
                log.error(
                    "segment %s in %s: fsync before closing its files failed (%s); they stay open",
                    segment_name(self.base_offset),
                    self.directory,
                    exc,
                )
                return False
            self._dirty = False
        close_quietly(fds)
        return True

    @property
    def dirty(self) -> bool:
        """Written since the last fsync of the ``.log``: the handle cache closes clean segments first."""
        return self._dirty

    @property
    def writes(self) -> int:
        return self._writes

    def synced(self, writes: int) -> None:
        """The ``.log`` was fsynced after the first ``writes`` writes (``owner`` held): it is clean unless
        written since. A flush fsyncs outside the lock, so a write may land meanwhile; that one stays unsynced."""
        if self._writes == writes:
            self._dirty = False

    def mark_written(self) -> None:
        """Bytes went to the files outside :meth:`append` (a mended prefix, a repair, a cut)."""
        self._dirty = True
        self._writes += 1

    def _remember(self, origin_entries: BytesLike, index_entries: BytesLike) -> None:
        """Keep in memory what lookups need of the index files: the sparse index and the running max timestamps."""
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
        self._since_index = self.size - (self.index_positions[-1] if self.index_positions else 0)
        # Entries in the files (all of them, as loaded or rewritten); later ones wait in memory (module doc).
        self._index_written = len(self.index_positions)
        self._oindex_written = self.batch_count
        self._pending = bytearray()
        self._indexes_synced = True  # what the files hold is fsynced (a segment loaded or rewritten whole)

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, base_offset: int, owner: threading.Lock) -> Segment:
        """A new, empty segment, its files open (the caller fsyncs the directory)."""
        paths = segment_paths(directory, base_offset)
        fds: list[int] = []
        try:
            for path in paths:
                fds.append(_open_rw(path, create=True))
            _write_all(fds[1], [FILE_HEADER.pack(INDEX_MAGIC, INDEX_FORMAT_VERSION)], 0, FILE_HEADER.size)
            _write_all(fds[2], [FILE_HEADER.pack(ORIGIN_INDEX_MAGIC, ORIGIN_INDEX_FORMAT_VERSION)], 0, FILE_HEADER.size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            for path in paths:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        close_quietly((fds[1], fds[2]))  # written again at seal; nothing reads them before
        segment = cls(directory, base_offset, owner, 0, base_offset, b"", b"")
        segment._indexes_synced = False
        segment._dirty = True
        segment._writes += 1
        HANDLES.admit(segment, (fds[0],))
        return segment

    @classmethod
    def load(
        cls,
        directory: Path,
        base_offset: int,
        index_interval_bytes: int,
        *,
        next_base: int | None,
        durable_end: int,
        running: dict[OriginKey, int],
        trust: bool,
        owner: threading.Lock,
        synced: bool = False,
        trust_prefix: bool = False,
    ) -> tuple[Segment, LoadOutcome]:
        """Open an existing segment: trusted from its index files, or walked batch by batch.

        With ``trust`` (a sealed segment below the recovery point), the segment is trusted if its index files are
        present and agree with the log's size, with the next segment's base offset and with themselves (see
        :func:`_consistent`). Otherwise :func:`georep.storage.slots.plan_segment` walks it, with the origin index
        as the evidence of what damaged slots held; this carries the plan out: prefixes mended, a torn tail cut
        (only at or above ``durable_end``), index files rebuilt when they differ from the plan. Damage the plan
        cannot name raises :class:`UnrepairableDamage` and changes nothing. ``running`` is each origin's next
        seq before this segment (for the continuity checks); the caller advances it. The files are closed on
        return: the handle cache opens them again when the segment is used. ``synced``: the file system was
        synced after the last writer died, so a walk that changes nothing needs no fsync of its own.
        ``trust_prefix``: the walk starts after the origin index's entries below ``durable_end`` (the recovery
        point) when they are consistent (:func:`georep.storage.slots.trusted_prefix`), as a sealed segment below
        it is trusted: only what lies after the recovery point is read.
        """
        log_path, index_path, oindex_path = segment_paths(directory, base_offset)
        unwritten: tuple[int, int] | None = None  # entries already in the files, when some are not
        log_fd = _open_rw(log_path)
        try:
            log_size = os.fstat(log_fd).st_size
            evidence = read_index_file(oindex_path, ORIGIN_INDEX_MAGIC, ORIGIN_INDEX_FORMAT_VERSION, ORIGIN_ENTRY_BYTES)
            sparse = read_index_file(index_path, INDEX_MAGIC, INDEX_FORMAT_VERSION, INDEX_ENTRY.size)
            if (
                trust
                and next_base is not None
                and _consistent(base_offset, log_size, next_base, evidence, sparse, running)
            ):
                assert evidence is not None and sparse is not None
                outcome = LoadOutcome(False, False, None)
                entries, size, next_offset = evidence, log_size, next_base
            else:
                decoded = list(iter_origin_entries(evidence)) if evidence is not None else None
                plan = plan_segment(
                    base_offset,
                    LogBytes(log_fd, log_size),
                    decoded,
                    next_base=next_base,
                    durable_end=durable_end,
                    running=running,
                    trusted=trusted_prefix(base_offset, log_size, decoded or [], durable_end, running)
                    if trust_prefix
                    else (),
                )
                if plan.refused is not None:
                    raise UnrepairableDamage(refusal(log_path, plan.refused))
                carry_out(log_fd, plan, changed_only=synced)
                entries = pack_entries(plan.entries)
                sparse_now = sparse_index(plan.entries, base_offset, index_interval_bytes)
                rebuilt, unwritten = _indexes_after_walk(
                    directory, base_offset, (evidence, sparse), (entries, sparse_now), active=next_base is None
                )
                gone = sum(1 for e in decoded or () if e.base_offset >= plan.next_offset)
                outcome = LoadOutcome(True, rebuilt, plan, gone, extended=unwritten is not None)
                sparse, size, next_offset = sparse_now, plan.end_position, plan.next_offset
        finally:
            os.close(log_fd)
        segment = cls(directory, base_offset, owner, size, next_offset, entries, sparse)
        if unwritten is not None:
            segment._oindex_written, segment._index_written = unwritten
            segment._pending = bytearray(entries[unwritten[0] * ORIGIN_ENTRY_BYTES :])
            segment._indexes_synced = False
        return segment, dataclasses.replace(outcome, origin_entries=entries)

    def reindex(self, entries: bytes, index_interval_bytes: int) -> None:
        """Replace both index files with ``entries`` (and the sparse index they imply), and what is kept of them.

        The caller holds the log's lock; the files are replaced atomically and opened again on the next use.
        """
        sparse = sparse_index(iter_origin_entries(entries), self.base_offset, index_interval_bytes)
        self.sync_if_written()  # closing without it would leave writes no fsync of this partition sees
        self.close()
        write_indexes(self.directory, self.base_offset, entries, sparse)
        self._remember(entries, sparse)

    def sync(self) -> None:
        """fdatasync the ``.log`` (the index files are synced when :meth:`write_indexes_out` writes them)."""
        os.fdatasync(self.log_fd)
        self._dirty = False

    def sync_if_written(self) -> None:
        """:meth:`sync`, unless nothing was written since the last one (the file may then stay closed)."""
        if self._dirty or HANDLES.is_open(self):
            self.sync()

    def write_indexes_out(self, *, sync: bool, check: bool = False, sparse: bool = True) -> None:
        """Write the index entries waiting in memory to the end of the index files (``owner`` held); with
        ``sync``, fdatasync them if anything in them is unsynced; with ``check`` (a seal), check and sync them
        even when nothing waits; without ``sparse`` (a checkpoint), the ``.oindex`` only: the sparse index names
        no damage, and waits for the seal.

        The files are checked first, from their header, size and last entry: one that is missing, short, foreign
        or whose last entry does not end where the first waiting one begins is rebuilt whole from the ``.log``
        (:meth:`_rebuild_indexes`), never appended to. A checkpoint (``sync`` false) leaves them to the page
        cache, as an append used to: they are derived, and recovery walks what lies past the recovery point.
        """
        sparse_waits = sparse and self._index_written < len(self.index_positions)
        if not (check or self._pending or sparse_waits or (sync and not self._indexes_synced)):
            return
        fds = self._open_indexes(sparse=sparse)
        if fds is None:
            self._rebuild_indexes()
            return
        try:
            self._append_pending(fds, sync=sync)
        finally:
            close_quietly(tuple(fd for fd in fds if fd is not None))

    def _open_indexes(self, *, sparse: bool) -> tuple[int, int | None] | None:
        """The ``.oindex`` (and with ``sparse`` the ``.index``) open for writing, or None when they are missing or
        disagree with what this segment wrote to them."""
        index_path, oindex_path = index_paths(self.directory, self.base_offset)
        fds: list[int] = []
        try:
            fds.append(_open_rw(oindex_path))
            if sparse:
                fds.append(_open_rw(index_path))
            index_fd = fds[1] if sparse else None
            if self._files_agree(fds[0], index_fd):
                return fds[0], index_fd
        except FileNotFoundError:
            pass
        except BaseException:
            close_quietly(tuple(fds))
            raise
        close_quietly(tuple(fds))
        return None

    def _append_pending(self, fds: tuple[int, int | None], *, sync: bool) -> None:
        """Write the waiting entries at the files' ends; on a failure cut them back, so they stay a prefix."""
        oindex_fd, index_fd = fds
        oindex_end = FILE_HEADER.size + self._oindex_written * ORIGIN_ENTRY_BYTES
        index_end = FILE_HEADER.size + self._index_written * INDEX_ENTRY.size
        sparse = self.sparse_entries(self._index_written) if index_fd is not None else b""
        try:
            _write_all(oindex_fd, [self._pending], oindex_end, len(self._pending))
            if index_fd is not None:
                _write_all(index_fd, [sparse], index_end, len(sparse))
            if sync:
                os.fdatasync(oindex_fd)
                if index_fd is not None:
                    os.fdatasync(index_fd)
        except BaseException:
            ends = [(oindex_fd, oindex_end)] + ([(index_fd, index_end)] if index_fd is not None else [])
            for fd, size in ends:
                with contextlib.suppress(OSError):  # else the next write finds them disagreeing, and rebuilds
                    os.ftruncate(fd, size)
            raise
        self._oindex_written += len(self._pending) // ORIGIN_ENTRY_BYTES
        self._pending = bytearray()
        if index_fd is not None:
            self._index_written = len(self.index_positions)
        self._indexes_synced = sync and index_fd is not None

    def _files_agree(self, oindex_fd: int, index_fd: int | None) -> bool:
        """Whether the index files are what this segment wrote to them: header, size and the last entry's end."""
        oindex_size = FILE_HEADER.size + self._oindex_written * ORIGIN_ENTRY_BYTES
        if os.fstat(oindex_fd).st_size != oindex_size:
            return False
        if index_fd is not None and not _header_and_size(
            index_fd, INDEX_MAGIC, INDEX_FORMAT_VERSION, FILE_HEADER.size + self._index_written * INDEX_ENTRY.size
        ):
            return False
        if not self._oindex_written:  # the header is all there is
            return _header_and_size(oindex_fd, ORIGIN_INDEX_MAGIC, ORIGIN_INDEX_FORMAT_VERSION, oindex_size)
        if index_fd is not None and not _header_and_size(  # a checkpoint skips it: the seal checks it
            oindex_fd, ORIGIN_INDEX_MAGIC, ORIGIN_INDEX_FORMAT_VERSION, oindex_size
        ):
            return False
        last = os.pread(oindex_fd, ORIGIN_ENTRY_BYTES, oindex_size - ORIGIN_ENTRY_BYTES)
        if len(last) != ORIGIN_ENTRY_BYTES:
            return False
        entry = OriginEntry(*ORIGIN_ENTRY.unpack(last))
        if self._pending:
            first = OriginEntry(*ORIGIN_ENTRY.unpack_from(self._pending))
            return entry.end_position == first.position and entry.next_offset == first.base_offset
        return entry.end_position == self.size and entry.next_offset == self.next_offset

    def _rebuild_indexes(self) -> None:
        """Write both index files whole from a walk of the ``.log`` (``owner`` held): the files disagreed with it.

        The walk checks what this segment appended; if the ``.log`` itself no longer holds it, the seal fails
        rather than write an index of something else, and recovery decides at the next start."""
        log.warning(
            "segment %s in %s: its index files disagree with what was appended (missing, short or overwritten); "
            "rebuilding them from the .log",
            segment_name(self.base_offset),
            self.directory,
        )
        plan = plan_segment(
            self.base_offset,
            LogBytes(self.log_fd, self.size),
            list(iter_origin_entries(self._pending)),
            next_base=None,
            durable_end=self.next_offset,
            running={},
        )
        if plan.refused or plan.cut or plan.lost or plan.next_offset != self.next_offset:
            raise StorageError(
                f"segment {segment_name(self.base_offset)} in {self.directory}: its .log no longer holds what was "
                f"appended ({plan.refused or plan.cut or 'damaged batches'}); restart the node to recover it"
            )
        entries = pack_entries(plan.entries)
        write_indexes(self.directory, self.base_offset, entries, self.sparse_entries())
        self._oindex_written, self._index_written = len(plan.entries), len(self.index_positions)
        self._pending = bytearray()
        self._indexes_synced = True

    def close(self) -> None:
        """Close the files (without fsync: :meth:`sync` first where that matters)."""
        fds = HANDLES.discard(self)
        if fds is not None:
            close_quietly(fds)

    def delete(self) -> None:
        """Close and remove the files; the ``.log`` first, so a crash leaves at most orphan indexes."""
        self.close()
        for path in segment_paths(self.directory, self.base_offset):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # -- append ----------------------------------------------------------------------------------

    def append(
        self,
        header: BatchHeader,
        prefix: bytes,
        body: Sequence[BytesLike],
        base_offset: int,
        append_time_ms: int,
        index_interval_bytes: int,
    ) -> None:
        """Write one batch to the log, then its index entries. On any failure, undo and raise."""
        position = self.size
        size = header.size_bytes
        origin_entry = pack_origin_entry(header, base_offset, position, append_time_ms)
        log_fd = HANDLES.fds(self)[0]
        self._dirty = True
        self._writes += 1
        try:
            _write_all(log_fd, [prefix, *body], position, size)
        except BaseException:
            self._truncate_to_tracked_size(log_fd)
            raise
        if self._since_index >= index_interval_bytes:
            self.index_relative_offsets.append(base_offset - self.base_offset)
            self.index_positions.append(position)
            self._since_index = 0
        self._since_index += size
        self._pending += origin_entry
        if not self.batch_count:
            self.first_append_time_ms = append_time_ms
        previous_max = self.running_max_timestamps[-1] if self.batch_count else header.max_timestamp
        self.running_max_timestamps.append(max(previous_max, header.max_timestamp))
        self.batch_count += 1
        self.size = position + size
        self.next_offset = base_offset + header.last_offset_delta + 1
        if len(self._pending) >= PENDING_BYTES_MAX:
            try:
                self.write_indexes_out(sync=False)
            except (OSError, StorageError) as exc:  # the batch is in the .log: its entries wait for the next try
                log.error(
                    "segment %s in %s: cannot write index entries (%s); they stay in memory until the seal",
                    segment_name(self.base_offset),
                    self.directory,
                    exc,
                )

    def _truncate_to_tracked_size(self, log_fd: int) -> None:
        try:
            os.ftruncate(log_fd, self.size)
        except OSError as exc:
            # Later writes go to the tracked position and overwrite the
            # leftover; recovery cuts whatever remains past the last batch.
            log.error(
                "segment %s in %s: cannot truncate a failed append back to %d bytes: %s",
                segment_name(self.base_offset),
                self.directory,
                self.size,
                exc,
            )

    def seal(self) -> None:
        """Make the segment durable, exactly its tracked size and fully indexed before it stops being active."""
        log_fd = self.log_fd
        if os.fstat(log_fd).st_size != self.size:
            os.ftruncate(log_fd, self.size)
        self.sync()
        self.write_indexes_out(sync=True, check=True)

    # -- lookups ---------------------------------------------------------------------------------

    @property
    def max_timestamp(self) -> int:
        return self.running_max_timestamps[-1] if self.batch_count else -(1 << 63)

    def index_position(self, offset: int) -> int:
        """Byte position of the last sparse-index entry at or before ``offset`` (0 if none)."""
        i = bisect_right(self.index_relative_offsets, offset - self.base_offset) - 1
        return self.index_positions[i] if i >= 0 else 0

    def index_entry(self, offset: int) -> tuple[int, int]:
        """``(position, base offset)`` of the batch the last sparse-index entry at or before ``offset`` names
        (``(0, base_offset)`` if none): a batch boundary to walk forward from."""
        i = bisect_right(self.index_relative_offsets, offset - self.base_offset) - 1
        if i < 0:
            return 0, self.base_offset
        return self.index_positions[i], self.base_offset + self.index_relative_offsets[i]

    def first_batch_at_or_after_timestamp(self, timestamp_ms: int) -> int | None:
        """Index (within this segment) of the first batch with max_timestamp >= ``timestamp_ms``."""
        i = bisect_left(self.running_max_timestamps, timestamp_ms)
        return i if i < self.batch_count else None

    def entry_at_offset(self, offset: int) -> OriginEntry | None:
        """The origin-index entry of the batch holding ``offset`` (a bisect over the ``.oindex`` entries)."""
        with _OriginEntries(self) as entries:
            lo, hi = 0, self.batch_count
            while lo < hi:
                mid = (lo + hi) // 2
                entry = OriginEntry(*ORIGIN_ENTRY.unpack(entries.read(mid, 1)))
                if entry.next_offset <= offset:
                    lo = mid + 1
                elif entry.base_offset > offset:
                    hi = mid
                else:
                    return entry
        return None

    def sparse_entries(self, start: int = 0) -> bytes:
        """The sparse index as kept in memory from entry ``start``, in the ``.index`` file's entry layout."""
        return b"".join(
            INDEX_ENTRY.pack(rel, pos)
            for rel, pos in zip(self.index_relative_offsets[start:], self.index_positions[start:], strict=True)
        )

    def origin_entries(self, start: int = 0, count: int | None = None) -> bytes:
        """``count`` origin-index entries from entry ``start``: from the ``.oindex`` file, then from memory."""
        if count is None:
            count = self.batch_count - start
        with _OriginEntries(self) as entries:
            return entries.read(start, count)


class _OriginEntries:
    """A segment's origin-index entries: those in the ``.oindex`` file, read through a descriptor opened for this
    lookup only (when the lookup reaches them), then those still in memory. The segment's ``owner`` is held."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._fd: int | None = None

    def __enter__(self) -> _OriginEntries:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)

    def read(self, start: int, count: int) -> bytes:
        segment = self._segment
        written = segment._oindex_written
        out = b""
        if start < written and count > 0:
            if self._fd is None:
                self._fd = os.open(index_paths(segment.directory, segment.base_offset)[1], os.O_RDONLY | os.O_CLOEXEC)
            n = min(count, written - start)
            out = os.pread(self._fd, n * ORIGIN_ENTRY_BYTES, FILE_HEADER.size + start * ORIGIN_ENTRY_BYTES)
        first = max(start - written, 0) * ORIGIN_ENTRY_BYTES
        rest = (count - len(out) // ORIGIN_ENTRY_BYTES) * ORIGIN_ENTRY_BYTES
        return out + bytes(segment._pending[first : first + rest]) if rest > 0 else out


def _header_and_size(fd: int, magic: bytes, version: int, size: int) -> bool:
    return os.fstat(fd).st_size == size and os.pread(fd, FILE_HEADER.size, 0) == FILE_HEADER.pack(magic, version)


def _indexes_after_walk(
    directory: Path,
    base_offset: int,
    found: tuple[bytes | None, bytes | None],
    wanted: tuple[bytes, bytes],
    *,
    active: bool,
) -> tuple[bool, tuple[int, int] | None]:
    """What a load does with index files after the walk: ``(rebuilt, unwritten)``, where ``unwritten`` is how many
    entries of each file (origin, sparse) are in it when the others wait in memory for the caller to write."""
    if found == wanted:
        return False, None
    evidence, sparse = found
    if active and _lacks_only_a_tail(found, wanted):
        # Only the active segment's files lack a tail by design (a sealed one's were fsynced at its seal): that
        # tail waits in memory, like an append's, and the caller writes it out.
        assert evidence is not None and sparse is not None
        return False, (len(evidence) // ORIGIN_ENTRY_BYTES, len(sparse) // INDEX_ENTRY.size)
    rebuilt = _rebuild_at_load(directory, base_offset, wanted, active=active)
    return rebuilt, None if rebuilt else (0, 0)


def _rebuild_at_load(directory: Path, base_offset: int, wanted: tuple[bytes, bytes], *, active: bool) -> bool:
    """Replace a segment's index files whole; False when the disk is full and the segment is the active one (its
    entries then wait in memory, and the node still starts: an open never needs space for a derived file)."""
    try:
        write_indexes(directory, base_offset, *wanted)
    except OSError as exc:
        if not active or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return False
    return True


def _lacks_only_a_tail(found: tuple[bytes | None, bytes | None], wanted: tuple[bytes, bytes]) -> bool:
    """Whether index files hold a prefix of the entries a walk found: what a crash leaves of an active segment whose
    entries were still in memory. Anything else (a foreign header, a torn or differing entry) is replaced whole."""
    (evidence, sparse), (entries, sparse_now) = found, wanted
    return (
        evidence is not None and sparse is not None and entries.startswith(evidence) and sparse_now.startswith(sparse)
    )


def _consistent(
    base_offset: int,
    log_size: int,
    next_offset: int,
    origin_entries: bytes | None,
    index_entries: bytes | None,
    running: dict[OriginKey, int],
) -> bool:
    """Whether a sealed segment's index files may be trusted without reading its batches.

    Cheap, from the index files alone: the origin entries tile the ``.log`` byte for byte from position 0 to its
    size and the offsets from the base to the next segment's base, each origin's seqs continue (within the segment
    and from ``running``), and every sparse entry points at a batch the origin index lists. A flipped seq, offset,
    position or size, a lost entry or a torn file fails one of these; what they cannot see (a flipped timestamp or
    producer field, a flipped byte in the ``.log``) the scrubber finds later.
    """
    if origin_entries is None or index_entries is None or not origin_entries:
        return False
    seqs = dict(running)
    starts: set[tuple[int, int]] = set()
    position, offset = 0, base_offset
    for e in iter_origin_entries(origin_entries):
        if e.position != position or e.base_offset != offset or e.size_bytes < HEADER_BYTES or e.last_offset_delta < 0:
            return False
        if seqs.get(e.origin_key, e.base_origin_seq) != e.base_origin_seq:
            return False
        seqs[e.origin_key] = e.next_origin_seq
        starts.add((e.base_offset - base_offset, e.position))
        position, offset = e.end_position, e.next_offset
    if position != log_size or offset != next_offset:
        return False
    return all(entry in starts for entry in INDEX_ENTRY.iter_unpack(index_entries))


def carry_out(log_fd: int, plan: SegmentPlan, *, changed_only: bool = False) -> None:
    """Write what a plan decided into the ``.log``: mended prefixes, then the cut; then make it durable.

    ``changed_only``: the ``.log`` is known durable as it was found (the file system was synced since its
    last writer died), so the fsync is needed only when the plan changed it.
    """
    if changed_only and not plan.mended and plan.cut is None:
        return
    for slot in plan.mended:
        assert slot.prefix is not None
        if os.pwrite(log_fd, slot.prefix, slot.entry.position) != len(slot.prefix):
            raise OSError(errno.EIO, f"short write mending the prefix of the batch at byte {slot.entry.position}")
    if plan.cut is not None:
        os.ftruncate(log_fd, plan.end_position)
    os.fdatasync(log_fd)  # what was decided is durable before the recovery point or the quarantine moves


def write_indexes(directory: Path, base_offset: int, entries: bytes, sparse: bytes) -> None:
    _, index_path, oindex_path = segment_paths(directory, base_offset)
    replace_file(
        oindex_path, file_bytes(ORIGIN_INDEX_MAGIC, ORIGIN_INDEX_FORMAT_VERSION, entries), sync_directory=False
    )
    replace_file(index_path, file_bytes(INDEX_MAGIC, INDEX_FORMAT_VERSION, sparse), sync_directory=False)


def refusal(log_path: Path, why: str) -> str:
    """What an operator reads when damage below the recovery point cannot be named: where, why, and what to do."""
    return (
        f"{log_path} is damaged below the recovery point at {why}. Nothing was cut: cutting here would drop "
        "the CRC-valid batches after the damage, and a site could issue its own lost seqs again. Restore this "
        "partition directory from a backup; or stop the node, move its whole data dir away and start it empty: "
        "the site gets a new epoch and pulls every record back from the linked sites"
    )


def read_batches(
    fd: int, offset: int, position: int, limit: int, limit_offset: int, max_bytes: int
) -> tuple[bytes, int, int]:
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
