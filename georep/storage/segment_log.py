"""The on-disk partition log: segment files, indexes, roll, retention and recovery.

One directory per topic-partition::

    00000000000000000000.log      batches back to back
    00000000000000000000.index    sparse offset index
    00000000000000000000.oindex   origin index, one entry per batch
    00000000000000004711.log      the next segment; a name is its first batch's base_offset
    ...
    recovery-point                see georep.storage.recovery_point

All integers are big-endian, signed unless marked ``u``.

``.log``: no file header. Whole batches back to back, each in the layout of
``georep.record.batch`` (which carries its own format version, the ``magic``
byte at offset 24 of every batch). The first batch's ``base_offset`` equals the
file name; each following batch's ``base_offset`` is the previous batch's
``base_offset + last_offset_delta + 1``. A batch never straddles two segments.

``.index``: the sparse offset index::

    offset size field              meaning
    ------ ---- ------------------ ---------------------------------------------
         0    4 magic              b"GRSI"
         4    1 version            1
         5    3 reserved           0
         8    - entries            8 bytes each:
                 0   4u relative_offset  batch base_offset - segment base offset
                 4   4u position         byte position of that batch in the .log

    A batch gets an entry when at least ``index_interval_bytes`` of log were
    written since the last entry's batch began (counted from position 0 when
    there is none yet), so the index is a pure function of the log and the
    interval. A lookup uses the last entry at or below the wanted offset, or
    position 0, and scans forward over 12-byte batch prefixes.

``.oindex``: the origin index, one entry per batch, in log order::

    offset size field              meaning
    ------ ---- ------------------ ---------------------------------------------
         0    4 magic              b"GROI"
         4    1 version            1
         5    3 reserved           0
         8    - entries            96 bytes each:
                 0   32 origin_site        ASCII, NUL-padded (as in the batch)
                32   4u origin_epoch
                36    8 base_origin_seq
                44    4 last_offset_delta  records_count - 1
                48    8 base_offset        local offset (absolute)
                56   4u position           byte position of the batch in the .log
                60   4u size_bytes         whole batch, 12 + batch_length
                64    8 max_timestamp      producer time, ms
                72    8 producer_id
                80    2 producer_epoch
                82    4 base_sequence
                86    8 append_time_ms     second copy of the batch's, see Recovery
                94    2 reserved           0

Index files start with a magic and a version so that a newer layout is
recognised and rebuilt from the log rather than misread. ``.log`` files carry
no header: each batch already carries its version, and a header would break
the "batches back to back" shape that the Spark audit reads.

Append. The log rolls before an append when the active segment is not empty
and the batch would take it past ``segment_bytes_max``, or its first batch's
append time is more than ``segment_ms`` before this one, or the batch's
relative offset would not fit in 32 bits. So a batch bigger than
``segment_bytes_max`` goes alone into a fresh segment. The 24-byte local
prefix and the caller's body buffers go out in one ``os.pwritev`` at the
tracked log end (position-tracked fd, no ``O_APPEND``: a failed write is
truncated away and the next one overwrites whatever could not be); then the
index entries. If any of the three writes fails, all three files are cut back
to their previous sizes, and ENOSPC/EDQUOT become ``DiskFull``.

Read. A read returns whole batches from the batch holding the offset, up to
``max_bytes`` but at least one, and never crosses a segment boundary: at a
segment's end it stops, and ``next_offset`` (the next segment's base offset)
continues in the next read. It never returns bytes past the segment size
recorded when the read began, so a concurrent append is never seen torn.

Retention deletes whole sealed segments, oldest first, never the active one:
by time (a segment's largest producer ``max_timestamp`` < now - retention_ms)
and by size (while the log holds more than ``retention_bytes``).

Recovery (``SegmentLog.open``). Stray ``.tmp`` files and index files without a
``.log`` are removed. A sealed segment that ends at or below the recovery
point is trusted when its index files are present and consistent (whole
entries, the last origin entry ending exactly at the ``.log`` size and at the
next segment's base offset); otherwise it is validated as below. The segment
holding the recovery point, every later one and always the last are
validated batch by batch: framing, CRC-32C and offset continuity; in the last
one, the walk starts after the origin-index entries that end at or below the
recovery point and tile the segment (``slots.trusted_prefix``), when the
quarantine list is readable. The 24-byte
prefix is outside the CRC; of its fields, ``base_offset`` is checked by
continuity, ``batch_length`` by framing and CRC, ``crc`` by the CRC, and
``append_time_ms`` against the origin index's copy. At the first torn or
damaged batch the ``.log`` is cut there and every later segment is deleted,
with a warning: nothing after damage is served. Index files that disagree
with the validated log are rebuilt. Then the recovery point moves to the log
end.

Concurrency. ``flush()`` may run in a worker thread while another thread
appends and reads. One ``threading.Lock`` guards the in-memory state; fsync and
read I/O run outside it on a ``dup`` of the file descriptor, so closing or
deleting a segment meanwhile cannot redirect them to another file. The
descriptors come from the process's handle cache
(``georep/storage/handle_cache.py``), which closes a segment's files only
while its log's lock is free.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import shutil
import threading
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

from georep.record.batch import (
    READ_RECORDS_BYTES_MAX,
    REWRITTEN_BYTES,
    BatchHeader,
    CorruptBatch,
    InvalidBatch,
    check_batch,
    local_prefix,
    parse_header,
)
from georep.record.validate import check_records
from georep.storage.api import (
    BatchDamaged,
    BatchEntry,
    BytesLike,
    DamagedBatch,
    DiskFull,
    LogConfig,
    OffsetOutOfRange,
    PartitionLog,
    ReadResult,
    RepairRefused,
    ScrubStep,
    SegmentBatches,
    StorageError,
    copy_for_repair,
    quarantined,
)
from georep.storage.batch_scan import ScanBounds
from georep.storage.checked_json import DamagedStateFile, dumps_checked, loads_checked
from georep.storage.durable_file import TMP_SUFFIX, fsync_directory, replace_file
from georep.storage.index_format import OriginEntry, iter_origin_entries, pack_entries, sparse_index
from georep.storage.log_start import FILE_NAME as LOG_START_FILE
from georep.storage.log_start import LogStart, read_log_start, write_log_start
from georep.storage.origin_index import OriginIndex
from georep.storage.recovery_point import FILE_NAME as RECOVERY_POINT_FILE
from georep.storage.recovery_point import (
    PARTITION_FILES,
    RecoveryPoint,
    RecoveryPoints,
    read_recovery_point,
    write_recovery_point,
)
from georep.storage.segment import (
    INDEX_SUFFIX,
    LOG_SUFFIX,
    ORIGIN_ENTRY,
    ORIGIN_INDEX_SUFFIX,
    U32_MAX,
    LogBytes,
    Segment,
    UnrepairableDamage,
    carry_out,
    read_batches,
    refusal,
    segment_name,
    segment_paths,
)
from georep.storage.slots import OriginKey, SegmentPlan, plan_segment
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from topology.ids import SiteId

log = logging.getLogger(__name__)

DAMAGED_FILE = "damaged.json"  # the quarantine list: batches whose bytes failed their check
# Bumped at every change of any log's quarantine list, in any thread (a reader only compares it with what it saw
# last): a node's repair loop walks its partitions' lists again only after it moved (georep/server/replicator.py).
quarantine_changes = [0]

_SEGMENT_FILE = re.compile(r"(\d{20})(\.log|\.index|\.oindex)")


class LogClosed(StorageError):
    """The partition log was closed (or deleted); reopen it with ``SegmentLog.open``."""


class MissingSegment(StorageError):
    """A segment file is missing from the middle of a partition log: the node refuses to open it."""


class PointBeyondLog(StorageError):
    """A recovery point that claims more than the partition log holds."""


class InvalidLogConfig(ValueError):
    """A ``LogConfig`` value the segment log cannot work with."""


@dataclasses.dataclass(slots=True)
class RecoveryReport:
    """What ``SegmentLog.open`` found and did."""

    segments_trusted: int = 0
    segments_validated: int = 0
    indexes_rebuilt: int = 0  # segments whose .index/.oindex were rewritten from the log
    # Active segments whose index files lacked the entries after their end (kept in memory until a seal, a clean
    # stop or a checkpoint wrote them: what a crash leaves), completed in place from the walk of the log.
    indexes_extended: int = 0
    files_removed: int = 0  # stray .tmp files and orphan index files
    files_restored: int = 0  # empty .log files put back beside a surviving origin index
    damaged_offset: LocalOffset | None = None  # where the log was cut, if it was
    damage: str | None = None
    # Batches the origin index lists past the recovered log end: appended, but
    # their bytes did not survive (a torn tail, or a cut exactly between batches
    # that leaves nothing corrupt behind, as when the OS lost unflushed pages).
    indexed_batches_lost: int = 0
    lost: int = 0  # batches quarantined at open: their slots hold bytes that fail their check


def check_config(config: LogConfig) -> None:
    if not 1 <= config.segment_bytes_max <= U32_MAX:
        raise InvalidLogConfig(
            f"segment_bytes_max {config.segment_bytes_max} is outside [1, {U32_MAX}]: segment positions are 32-bit"
        )
    if config.segment_ms < 0:
        raise InvalidLogConfig(f"segment_ms {config.segment_ms} is negative")
    if config.index_interval_bytes < 0:
        raise InvalidLogConfig(f"index_interval_bytes {config.index_interval_bytes} is negative")
    if config.retention_ms < -1 or config.retention_bytes < -1:
        raise InvalidLogConfig("retention_ms and retention_bytes must be >= 0, or -1 for no limit")


class SegmentLog:
    """A ``PartitionLog`` kept in segment files in one directory. Build it with :meth:`open`."""

    def __init__(
        self,
        directory: Path,
        config: LogConfig,
        segments: list[Segment],
        origins: OriginIndex,
        vector: dict[Origin, OriginSeq],
        vector_offset: int,
        sealed_vector: dict[Origin, OriginSeq],
        recovery: RecoveryReport,
        lock: threading.Lock,
        points: RecoveryPoints = PARTITION_FILES,
    ) -> None:
        self.directory = directory
        self._points = points  # where the recovery point is kept
        self.config = config
        self.recovery = recovery
        self._device: int | None = None  # the file system's device, read when a grouped flush first asks
        self._lock = lock  # the segments' owner: the handle cache closes their files only while it is free
        self._segments = segments
        self._bases = [s.base_offset for s in segments]
        self._origins = origins
        self._vector = vector
        # {origin: next seq} over every batch below _vector_offset, which is
        # >= the active segment's base: what the recovery-point file persists.
        self._vector_offset = vector_offset
        self._sealed_vector = sealed_vector
        # The log's vector at each segment's base, beside _segments (segment_at); _from_segments sets them.
        self._start_vectors: list[dict[Origin, OriginSeq]] = [{} for _ in segments]
        self._log_start = LocalOffset(segments[0].base_offset)
        self._log_end = LocalOffset(segments[-1].next_offset)
        self._flushed = self._log_end
        self._flushed_vector = dict(vector)  # {origin: next seq} over everything below _flushed
        self._size = sum(s.size for s in segments)
        self._closed = False
        self._origin_names: dict[tuple[bytes, int], Origin] = {}
        self._point_at = -1  # the recovery point's offset as last written (or found at open)
        self._damaged: dict[int, DamagedBatch] = {}  # base offset -> quarantined batch (DAMAGED_FILE)
        self._invalid: set[int] = set()  # base offsets of stored batches whose records no reader accepts (reported)
        self.damage_found_total = 0
        self.repaired_total = 0
        self.retention_due_ms: int | None = None  # set by each enforce_retention: the broker's retention schedule

    # -- open and recovery -----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: Path,
        config: LogConfig,
        now_ms: int,
        *,
        filesystem_synced: bool = False,
        points: RecoveryPoints = PARTITION_FILES,
    ) -> SegmentLog:
        """Create or recover the partition log in ``directory``.

        ``now_ms`` is accepted for symmetry with the other clock-taking calls;
        recovery makes no time-based decision (the age roll compares append
        times, and retention runs only when asked).

        ``filesystem_synced``: the caller synced the file system after the log's last writer died and before
        this open (``sync_filesystem``, once for all of a node's partitions). Everything found on disk is then
        already durable, so an open that changes nothing does no fsync: the directory is fsynced only when
        recovery created, removed or rewrote a file, and the recovery point is left where it is (a lower
        recovery point is always true: the next open validates a little more).

        ``points``: where the recovery point is kept (the directory's own file by default; a node's checkpoint of
        every partition). A point from a keeper that ``may_be_wrong`` and that claims more than the log holds is
        dropped, and the log validated from its segments.
        """
        del now_ms
        check_config(config)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        report = RecoveryReport()
        names = os.listdir(directory)  # one listing: a file it lacks is not opened to find that out
        kept = read_log_start(directory) if LOG_START_FILE in names else None
        bases = _tidy_directory(directory, names, report, None if kept is None else kept.log_start)
        point = points.read(directory, names)
        listed = _read_damaged(directory) if DAMAGED_FILE in names else []
        if listed is None:
            log.warning(
                "partition log %s: %s is unreadable; every segment is walked to find the damage again",
                directory,
                DAMAGED_FILE,
            )
        recover = functools.partial(cls._recover, directory, config, bases, kept, listed, filesystem_synced, points)
        try:
            opened = recover(point, report)
        except (UnrepairableDamage, PointBeyondLog) as exc:
            if point is None or not points.may_be_wrong:
                raise
            points.distrust(directory, str(exc))
            report = RecoveryReport(files_removed=report.files_removed, files_restored=report.files_restored)
            opened = recover(None, report)
        if report.indexes_rebuilt or report.damaged_offset is not None or report.files_removed or report.lost:
            log.info("partition log %s recovered: %s", directory, report)
        return opened

    @classmethod
    def _recover(
        cls,
        directory: Path,
        config: LogConfig,
        bases: list[int],
        kept: LogStart | None,
        listed: list[DamagedBatch] | None,
        filesystem_synced: bool,
        points: RecoveryPoints,
        point: RecoveryPoint | None,
        report: RecoveryReport,
    ) -> SegmentLog:
        """:meth:`open`'s recovery of the segments ``bases`` with the recovery point ``point``. Raises
        :class:`PointBeyondLog` when a ``point`` that ``may_be_wrong`` claims bytes the last segment lacks."""
        segments: list[Segment] = []
        loaded: list[BytesLike] = []  # each segment's origin-index entries
        lost: list[DamagedBatch] = []
        lock = threading.Lock()
        lock.acquire()  # held while opening: the handle cache leaves these segments' files alone meanwhile
        try:
            _load_segments(
                directory,
                config,
                bases,
                point,
                listed is not None,
                (segments, loaded, lost),
                report,
                lock,
                filesystem_synced,
            )
            if point is not None and points.may_be_wrong:
                _check_claim(directory, point, segments, lost)
            # What retention kept starts at the log-start file's offset (0 without one: nothing was deleted, or an
            # older build deleted, which the check of a log whose segments start later must let pass).
            expected = kept.log_start if kept is not None else 0
            if segments and kept is not None and segments[0].base_offset > expected:
                raise MissingSegment(_missing(directory, expected, segments[0].base_offset))
            created = None
            if not segments:
                start = point.recovery_point if point is not None else expected
                if start > expected:  # every segment file is gone: nothing created the log at this offset
                    raise MissingSegment(_missing(directory, expected, start))
                created = Segment.create(directory, start, lock)
                segments.append(created)
                loaded.append(b"")
            report.lost = len(lost)
            changed = bool(
                report.indexes_rebuilt
                or report.files_removed
                or report.files_restored
                or report.damaged_offset is not None
                or lost
            )
            if not filesystem_synced or changed or len(segments) != len(bases):
                fsync_directory(directory)
            if created is not None:
                # Clean: nothing was written to it, and an open that finds it gone creates it again (above). Dirty,
                # each new partition cost an fdatasync when the handle cache first closed it, on the event loop:
                # a topic wider than the cache paid one per partition at its create and again at its first write.
                created.synced(created.writes)
            opened = cls._from_segments(directory, config, (segments, loaded), point, report, lock, points)
            opened._quarantine_at_open(listed or [], lost)
            if not filesystem_synced or point is None or changed:
                opened._write_recovery_point()
            else:
                opened._point_at = point.recovery_point
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        finally:
            lock.release()
        return opened

    @classmethod
    def create_at(
        cls, directory: Path, config: LogConfig, base_offset: int, vector: dict[Origin, OriginSeq], now_ms: int
    ) -> SegmentLog:
        """A new, empty log whose first offset is ``base_offset`` and whose vector starts at ``vector``.

        For a segment of a partition whose earlier segments live on other nodes (a member of a segment's
        ensemble, ``georep/storage/replica_store.py``): offsets and the vector go on from where the partition's
        previous segment ended. ``directory`` must not exist. The recovery point is written before the segment
        file (and the ``log-start`` file before both), so a crash in between leaves a directory that :meth:`open`
        starts empty at ``base_offset``.
        """
        check_config(config)
        directory = Path(directory)
        directory.mkdir(parents=True)
        if base_offset:  # first: what starts the log later than offset 0 is known before anything else exists
            write_log_start(directory, LogStart(LocalOffset(base_offset), dict(vector)))
        write_recovery_point(directory, RecoveryPoint(LocalOffset(base_offset), LocalOffset(base_offset), dict(vector)))
        Segment.create(directory, base_offset, threading.Lock()).close()
        fsync_directory(directory)
        fsync_directory(directory.parent)
        # everything it holds was just made durable: the open neither syncs the directory nor rewrites the point
        return cls.open(directory, config, now_ms, filesystem_synced=True)

    @classmethod
    def cut(cls, directory: Path, config: LogConfig, end_offset: int, now_ms: int) -> SegmentLog:
        """Open the log in ``directory`` cut back to ``end_offset``: every batch at or after it is removed.

        The log must be closed, and ``end_offset`` must be a batch boundary in its last segment (a replica's
        copy of one segment, cut to the end its ensemble sealed it at: ``cluster/recovery.py``). The ``.log`` is
        truncated and fsynced first; its indexes are removed and rebuilt by :meth:`open`, so a crash anywhere in
        between leaves a log that opens either whole or cut, never torn.
        """
        directory = Path(directory)
        bases = sorted(
            int(p.name[: -len(LOG_SUFFIX)])
            for p in directory.glob("*" + LOG_SUFFIX)
            if p.name[: -len(LOG_SUFFIX)].isdigit()
        )
        if not bases or end_offset < bases[-1]:
            raise ValueError(
                f"partition log {directory}: cannot cut at offset {end_offset}: only the last segment "
                f"(from offset {bases[-1] if bases else '?'}) can be cut"
            )
        log_path, index_path, oindex_path = segment_paths(directory, bases[-1])
        data = log_path.read_bytes()
        position, offset = 0, bases[-1]
        while offset < end_offset:
            if position >= len(data):
                raise ValueError(
                    f"partition log {directory}: cannot cut at offset {end_offset}: the log ends at offset {offset}"
                )
            header = check_batch(data, position)
            if header.base_offset != offset:
                raise ValueError(
                    f"partition log {directory}: the batch at byte {position} starts at offset "
                    f"{header.base_offset}, not {offset}"
                )
            position += header.size_bytes
            offset = header.next_offset
        if offset != end_offset:
            raise ValueError(
                f"partition log {directory}: offset {end_offset} is inside the batch ending at {offset}: "
                "a cut must fall between batches"
            )
        if position < len(data):
            point = read_recovery_point(directory)
            if point is not None and point.recovery_point > end_offset:  # the cut goes below it: lower it first
                write_recovery_point(directory, dataclasses.replace(point, recovery_point=LocalOffset(end_offset)))
            fd = os.open(log_path, os.O_WRONLY)
            try:
                os.ftruncate(fd, position)
                os.fsync(fd)
            finally:
                os.close(fd)
            for stale in (index_path, oindex_path):
                stale.unlink(missing_ok=True)
            fsync_directory(directory)
        return cls.open(directory, config, now_ms)

    @classmethod
    def _from_segments(
        cls,
        directory: Path,
        config: LogConfig,
        loaded: tuple[list[Segment], list[BytesLike]],
        point: RecoveryPoint | None,
        report: RecoveryReport,
        lock: threading.Lock,
        points: RecoveryPoints,
    ) -> SegmentLog:
        """The log over loaded segments: its vector, the origin index and each segment's start vector.

        Below the first retained segment, the vector comes from the recovery point (or, when that is unreadable,
        from the ``log-start`` file); from there on, from the segments' own batches.
        """
        segments, entries = loaded
        active_base = segments[-1].base_offset
        log_start = segments[0].base_offset
        vector, covered = _vector_below(directory, point, log_start, segments[-1].next_offset)
        vector_offset = max(covered, active_base)
        opened = cls(directory, config, segments, OriginIndex(), vector, vector_offset, {}, report, lock, points)
        opened._index_segments(vector, covered, entries)
        if log_start and read_log_start(directory) is None:  # made by an older build, or lost: the second copy again
            write_log_start(directory, LogStart(LocalOffset(log_start), dict(opened._start_vectors[0])))
        return opened

    def _index_segments(
        self, vector: dict[Origin, OriginSeq], covered: int, loaded: Sequence[BytesLike] | None = None
    ) -> None:
        """Fold every segment's origin entries into the origin index, the vector and the start vectors.

        ``vector`` is ``{origin: next seq}`` over every batch below offset ``covered`` (deleted ones included);
        batches at or above it are read back from the segments (or taken from ``loaded``: each segment's entries,
        as the open loaded them).
        """
        origins = OriginIndex()
        names: dict[tuple[bytes, int], Origin] = {}
        active_base = self._segments[-1].base_offset
        sealed_vector: dict[Origin, OriginSeq] | None = dict(vector) if covered >= active_base else None
        segment_ends: list[dict[Origin, int]] = []  # per segment, {origin: next seq after its batches there}
        first: dict[Origin, tuple[int, int]] = {}  # origin -> (base offset, base seq) of its first retained batch
        for i, segment in enumerate(self._segments):
            if segment.base_offset == active_base and sealed_vector is None:
                sealed_vector = dict(vector)
            ends: dict[Origin, int] = {}
            for entry in iter_origin_entries(segment.origin_entries() if loaded is None else loaded[i]):
                origin = _origin_of(names, entry)
                next_seq = entry.next_origin_seq
                origins.add(origin, next_seq, entry.base_offset)
                first.setdefault(origin, (entry.base_offset, entry.base_origin_seq))
                if next_seq > ends.get(origin, 0):
                    ends[origin] = next_seq
                if next_seq > vector.get(origin, 0):  # per-origin max, so batches below `covered` change nothing
                    vector[origin] = OriginSeq(next_seq)
            segment_ends.append(ends)
        assert sealed_vector is not None
        self._origins, self._origin_names, self._vector = origins, names, vector
        self._sealed_vector = sealed_vector
        self._vector_offset = max(covered, active_base)
        self._start_vectors = _start_vectors(sealed_vector, self._vector_offset, first, segment_ends)

    # -- the PartitionLog protocol ---------------------------------------------------------------

    @property
    def log_start_offset(self) -> LocalOffset:
        return self._log_start

    @property
    def log_end_offset(self) -> LocalOffset:
        return self._log_end

    @property
    def size_bytes(self) -> int:
        """Bytes of batches held (the ``.log`` files; indexes not counted)."""
        return self._size

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def flushed_offset(self) -> LocalOffset:
        return self._flushed

    def vector(self) -> dict[Origin, OriginSeq]:
        with self._lock:
            return dict(self._vector)

    def flushed_vector(self) -> dict[Origin, OriginSeq]:
        with self._lock:
            return dict(self._flushed_vector)

    def append(self, header: BatchHeader, body: Sequence[BytesLike], append_time_ms: int) -> BatchHeader:
        if not header.stamped:
            raise ValueError("only a batch stamped with its origin and origin seq can be appended")
        body_bytes = 0
        for buf in body:
            body_bytes += buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if body_bytes != header.size_bytes - REWRITTEN_BYTES:
            raise ValueError(f"body holds {body_bytes} bytes, the header says {header.size_bytes - REWRITTEN_BYTES}")
        config = self.config
        with self._lock:
            self._check_open()
            base = self._log_end
            segment = self._segments[-1]
            try:
                if segment.size and (
                    segment.size + header.size_bytes > config.segment_bytes_max
                    or append_time_ms - segment.first_append_time_ms > config.segment_ms
                    or base - segment.base_offset > U32_MAX
                ):
                    self._roll()
                    segment = self._segments[-1]
                prefix = local_prefix(base, header.batch_length, append_time_ms, header.crc)
                segment.append(header, prefix, body, base, append_time_ms, config.index_interval_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(
                        f"partition log {self.directory}: no space left to append {header.size_bytes} bytes at "
                        f"offset {base} ({exc.strerror}): free disk space or lower retention; reads continue"
                    ) from exc
                raise
            self._size += header.size_bytes
            self._log_end = LocalOffset(base + header.last_offset_delta + 1)
            origin = header.origin
            next_seq = header.next_origin_seq
            self._origins.add(origin, next_seq, base)
            if next_seq > self._vector.get(origin, 0):
                self._vector[origin] = next_seq
        return header._replace(base_offset=base, append_time_ms=append_time_ms)

    def read(self, offset: LocalOffset, max_bytes: int) -> ReadResult:
        """Whole batches from the one holding ``offset``, each checked (framing, CRC, offsets) before it is
        returned. Reaching a damaged batch quarantines it: the read returns the batches before it, or raises
        ``BatchDamaged`` if it is the first."""
        for _attempt in range(2):  # a second time after the damage was found and quarantined
            with self._lock:
                self._check_open()
                if not self._log_start <= offset <= self._log_end:
                    raise OffsetOutOfRange(offset, self._log_start, self._log_end)
                if offset == self._log_end:
                    return ReadResult(b"", offset)
                for d in self._damaged.values():
                    if d.base_offset <= offset < d.next_offset:
                        raise BatchDamaged(d)
                segment = self._segments[bisect_right(self._bases, offset) - 1]
                name = segment_name(segment.base_offset) + LOG_SUFFIX
                known = sorted((d.position, d.base_offset) for d in self._damaged.values() if d.segment == name)
                position = segment.index_position(offset)
                limit, limit_offset = segment.size, segment.next_offset
                if known:
                    # Frame from the origin index, not by walking length prefixes across the damage,
                    # and stop before the first quarantined batch after the read's start.
                    entry = segment.entry_at_offset(offset)
                    position = entry.position if entry is not None else position
                    limit, limit_offset = next(
                        ((at, base) for at, base in known if at > position), (limit, limit_offset)
                    )
                fd = os.dup(segment.log_fd)
            try:
                data, next_offset, _start = read_batches(fd, offset, position, limit, limit_offset, max_bytes)
                bad = _first_bad_batch(data, offset)
            except CorruptBatch as exc:
                bad = str(exc)
            finally:
                os.close(fd)
            if bad is None:
                return ReadResult(data, LocalOffset(next_offset))
            # Walk the segment: quarantine what is damaged, rebuild an index that misled the read; read again.
            found, rebuilt = self._revalidate(segment, bad)
            if not found and not rebuilt:
                break
        raise StorageError(
            f"partition log {self.directory}: offset {offset} cannot be read even after checking "
            "its segment against the origin index; run 'georep scrub --now' and see the node log"
        )

    def _revalidate(self, segment: Segment, hint: str) -> tuple[list[DamagedBatch], bool]:
        """Walk ``segment`` again, as recovery does, and act on the plan: ``(newly quarantined, mended)``, where
        mended means an index file was rebuilt or a batch's local prefix rewritten.

        The walk runs outside the lock over the segment's bytes as they were when it began (appends after that
        are kept as they are). Nothing is cut at run time: the durable end is the segment's end.
        """
        with self._lock:
            self._check_open()
            i = self._segments.index(segment)
            count = segment.batch_count
            evidence = list(iter_origin_entries(segment.origin_entries(0, count)))
            size, end = segment.size, segment.next_offset
            next_base = self._bases[i + 1] if i + 1 < len(self._bases) else None
            running = {_origin_key(o): int(seq) for o, seq in self._start_vectors[i].items()}
            fd = os.dup(segment.log_fd)
        try:
            plan = plan_segment(
                segment.base_offset, LogBytes(fd, size), evidence, next_base=next_base, durable_end=end, running=running
            )
        finally:
            os.close(fd)
        name = segment_name(segment.base_offset) + LOG_SUFFIX
        if plan.refused is not None:
            raise UnrepairableDamage(refusal(self.directory / name, plan.refused) + f" (first noticed as: {hint})")
        with self._lock:
            self._check_open()
            if segment not in self._segments:
                return [], False  # retention deleted it meanwhile
            carry_out(segment.log_fd, plan)
            entries = pack_entries(plan.entries) + segment.origin_entries(count, segment.batch_count - count)
            sparse = sparse_index(iter_origin_entries(entries), segment.base_offset, self.config.index_interval_bytes)
            rebuilt = entries != segment.origin_entries() or sparse != segment.sparse_entries()
            if rebuilt:
                segment.reindex(entries, self.config.index_interval_bytes)
                self._reindex()
                log.warning(
                    "partition log %s: the origin index of %s disagreed with its CRC-valid batches (first "
                    "noticed as: %s); rebuilt it from them",
                    self.directory,
                    name,
                    hint,
                )
            for slot in plan.mended:
                log.warning(
                    "partition log %s: %s byte %d: only the batch's local prefix was damaged (its CRC-covered "
                    "bytes match the origin index); rewrote it",
                    self.directory,
                    name,
                    slot.entry.position,
                )
            new = [damaged_slot(s.entry, name, s.reason) for s in plan.lost if s.entry.base_offset not in self._damaged]
            self.damage_found_total += len(new)
            for d in new:
                self._damaged[d.base_offset] = d
                log.error(
                    "partition log %s: quarantined %s: %s (first noticed as: %s); it is served to no one "
                    "until repaired from a peer",
                    self.directory,
                    d.describe(),
                    d.reason,
                    hint,
                )
            if new:
                _write_damaged(self.directory, self._damaged)
        return new, rebuilt or bool(plan.mended)

    def _reindex(self) -> None:
        """Fold every segment's (rebuilt) origin index into memory again (lock held); the vector below the log
        start is the first segment's start vector, and the recovery point is written anew from it."""
        below = dict(self._start_vectors[0])
        self._index_segments(below, self._log_start)
        flushed: dict[Origin, OriginSeq] = dict(below)
        for segment in self._segments:
            for entry in iter_origin_entries(segment.origin_entries()):
                if entry.next_offset <= self._flushed:
                    origin = _origin_of(self._origin_names, entry)
                    flushed[origin] = OriginSeq(max(flushed.get(origin, 0), entry.next_origin_seq))
        self._flushed_vector = flushed
        self._write_recovery_point()

    def _quarantine_at_open(self, listed: list[DamagedBatch], lost: list[DamagedBatch]) -> None:
        """The quarantine after recovery: the slots the walks found lost, and the listed ones whose bytes still
        fail their check. A listed slot that holds the good batch its index entry names is released: the list
        is derived from the data, never the other way round."""
        quarantine = {d.base_offset: d for d in lost}
        released = 0
        for d in listed:
            if d.base_offset in quarantine or not self._log_start <= d.base_offset < self._log_end:
                continue
            segment = self._segments[bisect_right(self._bases, d.base_offset) - 1]
            entry = segment.entry_at_offset(d.base_offset)
            if entry is None or _check_stored(segment.log_fd, entry) is None:
                released += 1
                log.warning(
                    "partition log %s: %s listed %s, which holds a good batch: released from quarantine",
                    self.directory,
                    DAMAGED_FILE,
                    d.describe(),
                )
                continue
            quarantine[d.base_offset] = damaged_slot(entry, segment_name(segment.base_offset) + LOG_SUFFIX, d.reason)
        self._damaged = quarantine
        self.damage_found_total += len(lost)
        if lost or released or len(quarantine) != len(listed):
            _write_damaged(self.directory, self._damaged)
        elif quarantine:
            quarantined.add(self.directory)
            quarantine_changes[0] += 1  # a log opened late (a replica copy) brings its listed damage along
        for d in quarantine.values():
            log.error(
                "partition log %s: %s stay quarantined (%s): served to no one until repaired from a peer",
                self.directory,
                d.describe(),
                d.reason,
            )

    def scrub(self, offset: int, max_bytes: int) -> ScrubStep:
        """Check the batches from ``offset`` (about ``max_bytes`` of them, in one segment), below the flushed
        offset, against the origin index; walk the segment again where they disagree (quarantining damage,
        rebuilding an index that lies about good batches)."""
        with self._lock:
            self._check_open()
            offset = max(offset, self._log_start)
            end = self._flushed
            if offset >= end:
                return ScrubStep(int(self._log_end), 0, [])
            segment = self._segments[bisect_right(self._bases, offset) - 1]
            entry = segment.entry_at_offset(offset)
            if entry is None:
                return ScrubStep(int(segment.next_offset), 0, [])
            first = (entry.position, entry.base_offset)
            entries = segment.origin_entries(0, segment.batch_count)
            in_quarantine = {d.base_offset for d in self._damaged.values()}
            fd = os.dup(segment.log_fd)
        checked = 0
        bad: str | None = None
        invalid: list[str] = []
        next_offset = offset
        try:
            for e in iter_origin_entries(entries):
                if (e.position, e.base_offset) < first:
                    continue
                if e.base_offset >= end or checked >= max_bytes:
                    break
                if bad is None and e.base_offset not in in_quarantine:
                    data = os.pread(fd, e.size_bytes, e.position)
                    bad = _stored_problem(data, e)
                    why = None if bad is not None or e.base_offset in self._invalid else _invalid_records(data)
                    if why is not None:
                        self._invalid.add(e.base_offset)
                        invalid.append(f"offsets {e.base_offset}..{e.next_offset - 1}: {why}")
                checked += e.size_bytes
                next_offset = e.next_offset
        finally:
            os.close(fd)
        found, rebuilt = self._revalidate(segment, f"found by the scrubber: {bad}") if bad else ([], False)
        return ScrubStep(max(next_offset, offset + (0 if checked else 1)), checked, found, int(rebuilt), invalid)

    def damaged_batches(self) -> list[DamagedBatch]:
        with self._lock:
            return [self._damaged[b] for b in sorted(self._damaged)]

    def repair(self, base_offset: int, batch: bytes) -> DamagedBatch:
        """Fill a quarantined slot with a peer's copy of its batch: only the same batch (origin, seqs, length and
        CRC as the slot), and never over a CRC-valid batch."""
        with self._lock:
            self._check_open()
            damaged = self._damaged.get(base_offset)
            if damaged is None:
                raise RepairRefused(f"partition log {self.directory}: no quarantined batch at offset {base_offset}")
            header = copy_for_repair(damaged, batch)
            segment = self._segments[bisect_right(self._bases, base_offset) - 1]
            entry = segment.entry_at_offset(base_offset)
            if entry is None or entry.position != damaged.position or entry.size_bytes != damaged.size_bytes:
                raise RepairRefused(
                    f"the slot of {damaged.describe()} is no longer where the quarantine list says; "
                    "run 'georep scrub --now' to check the segment again"
                )
            if _check_stored(segment.log_fd, entry) is not None:
                prefix = local_prefix(base_offset, header.batch_length, entry.append_time_ms, header.crc)
                fixed = prefix + bytes(memoryview(batch)[REWRITTEN_BYTES:])
                if os.pwrite(segment.log_fd, fixed, damaged.position) != len(fixed):
                    raise OSError(errno.EIO, f"short write repairing {damaged.describe()}")
                os.fsync(segment.log_fd)
                still = _check_stored(segment.log_fd, entry)
                if still is not None:
                    raise StorageError(
                        f"partition log {self.directory}: {damaged.describe()} reads back damaged "
                        f"after the repair was written ({still}): the disk may be failing"
                    )
            del self._damaged[base_offset]
            _write_damaged(self.directory, self._damaged)
            self.repaired_total += 1
        log.warning("partition log %s: repaired %s from a peer's copy", self.directory, damaged.describe())
        return damaged

    def offset_for_origin_seq(self, origin: Origin, seq: OriginSeq) -> LocalOffset | None:
        """Base offset of the batch of ``origin`` holding ``seq``, or of its first later retained batch.

        ``None`` when no retained batch of ``origin`` holds a seq >= ``seq``:
        either nothing from ``seq`` on was appended yet (``seq >= vector()[origin]``)
        or retention deleted all of it; ``vector()`` tells the two apart.
        """
        with self._lock:
            return self._origins.first_batch_from(origin, seq)

    def offset_for_timestamp(self, timestamp_ms: int) -> LocalOffset | None:
        with self._lock:
            self._check_open()
            for segment in self._segments:
                # Every batch of an earlier segment has max_timestamp < timestamp_ms.
                if segment.batch_count and segment.max_timestamp >= timestamp_ms:
                    i = segment.first_batch_at_or_after_timestamp(timestamp_ms)
                    assert i is not None
                    entry = OriginEntry(*ORIGIN_ENTRY.unpack(segment.origin_entries(i, 1)))
                    return LocalOffset(entry.base_offset)
            return None

    def batch_entries(self) -> list[BatchEntry]:
        out: list[BatchEntry] = []
        with self._lock:
            self._check_open()
            for segment in self._segments:
                out += self._entries(segment)
        return out

    def segment_at(self, offset: int) -> SegmentBatches:
        with self._lock:
            self._check_open()
            if not self._log_start <= offset <= self._log_end:
                raise OffsetOutOfRange(offset, self._log_start, self._log_end)
            i = bisect_right(self._bases, offset) - 1
            segment = self._segments[i]
            return SegmentBatches(
                LocalOffset(segment.base_offset), dict(self._start_vectors[i]), self._entries(segment)
            )

    def _entries(self, segment: Segment) -> list[BatchEntry]:
        """``segment``'s batches from its origin index (lock held)."""
        return [
            BatchEntry(
                _origin_of(self._origin_names, e),
                OriginSeq(e.base_origin_seq),
                e.last_offset_delta,
                LocalOffset(e.base_offset),
                e.max_timestamp,
                e.producer_id,
                e.producer_epoch,
                e.base_sequence,
                e.append_time_ms,
            )
            for e in iter_origin_entries(segment.origin_entries())
        ]

    def flush(self) -> LocalOffset:
        """fsync the active segment's ``.log``; returns the flushed log end. Safe from a worker thread.

        Sealed segments were fsynced when they rolled, so the active one is all that can be dirty. Its index
        entries are in memory until it seals (recovery walks the active segment and writes what its index files
        lack). The segment is then clean, so the handle cache closes it without an fsync on the event loop's
        thread, which at 10,000 partitions written in turn was three fdatasyncs per append.
        """
        with self._lock:
            if self._closed:
                return self._flushed
            end = self._log_end
            vector = dict(self._vector)
            segment = self._segments[-1]
            writes = segment.writes
            fd = os.dup(segment.log_fd)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        with self._lock:
            segment.synced(writes)
            if end > self._flushed:
                self._flushed = end
                self._flushed_vector = vector
            return self._flushed

    @property
    def device(self) -> int:
        """The device of the file system holding the log (``st_dev``): a grouped flush syncs only its own."""
        if self._device is None:
            self._device = os.stat(self.directory).st_dev
        return self._device

    def flush_mark(self) -> FlushMark | None:
        """What a sync of the whole file system that starts after this call makes durable (None: closed).

        :func:`flush_together` takes marks of many logs, runs one ``syncfs``, then :meth:`flushed_to` each."""
        with self._lock:
            if self._closed:
                return None
            segment = self._segments[-1]
            return FlushMark(self._log_end, dict(self._vector), segment, segment.writes)

    def flushed_to(self, mark: FlushMark) -> LocalOffset:
        """A sync of the file system that began after ``mark`` was taken succeeded: all of it is durable."""
        with self._lock:
            mark.segment.synced(mark.writes)  # syncfs covers the index files too
            if mark.end > self._flushed:
                self._flushed = mark.end
                self._flushed_vector = mark.vector
            return self._flushed

    def enforce_retention(self, now_ms: int) -> int:
        """Delete what retention says, and move the recovery point up to the flushed offset (the node runs this
        every ``--retention-check-ms``, as Kafka checkpoints its recovery points): the next start-up after a
        crash then reads only what was written since."""
        deleted = 0
        with self._lock:
            self._check_open()
            self._checkpoint()
            doomed = self._expired_segments(now_ms)
            if doomed:
                # The second copy of the vector below the new log start goes first (georep/storage/log_start.py).
                write_log_start(
                    self.directory, LogStart(LocalOffset(self._bases[doomed]), dict(self._start_vectors[doomed]))
                )
            while deleted < doomed:
                oldest = self._segments[0]
                self._segments.pop(0)
                self._bases.pop(0)
                self._start_vectors.pop(0)
                self._size -= oldest.size
                oldest.delete()
                deleted += 1
            if deleted:
                self._log_start = LocalOffset(self._segments[0].base_offset)
                self._origins.trim(self._log_start)
                if any(b < self._log_start for b in self._damaged):
                    self._damaged = {b: d for b, d in self._damaged.items() if b >= self._log_start}
                    _write_damaged(self.directory, self._damaged)
                log.info(
                    "partition log %s: retention deleted %d segment(s); log start is now %d",
                    self.directory,
                    deleted,
                    self._log_start,
                )
            self.retention_due_ms = _retention_due(self._segments, self.config)
        return deleted

    def _expired_segments(self, now_ms: int) -> int:
        """How many of the oldest segments retention deletes now (lock held); never the active one."""
        config = self.config
        size = self._size
        count = 0
        for segment in self._segments[:-1]:
            expired = config.retention_ms >= 0 and segment.max_timestamp < now_ms - config.retention_ms
            oversize = config.retention_bytes >= 0 and size > config.retention_bytes
            if not (expired or oversize):
                break
            size -= segment.size
            count += 1
        return count

    def close(self) -> None:
        """fsync, write the recovery point (the log end) and close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._segments[-1].sync_if_written()
                self._flushed = self._log_end
                self._flushed_vector = dict(self._vector)
                indexed = _write_indexes_at_close(self._segments[-1])  # the next start then walks nothing
                if indexed and self._point_at != self._log_end:  # 10,000 idle partitions stop without 20,000 fsyncs
                    self._write_recovery_point()
            finally:
                for segment in self._segments:
                    segment.close()

    # -- beyond the protocol ---------------------------------------------------------------------

    def delete(self) -> None:
        """Close and remove the partition directory (topic deletion)."""
        with self._lock:
            self._closed = True
            for segment in self._segments:
                segment.close()
        shutil.rmtree(self.directory)

    def abandon(self) -> None:
        """Close the files without fsync or a recovery point, as a killed process leaves them.

        For tests and crash drills: the next ``open`` recovers as after a crash.
        """
        with self._lock:
            self._closed = True
            for segment in self._segments:
                segment.close()

    # -- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosed(f"partition log {self.directory} is closed")

    def _roll(self) -> None:
        """Seal the active segment and start a new one at the log end (lock held)."""
        end = self._log_end
        self._segments[-1].seal()
        sealed_vector = dict(self._vector)
        if end > self._flushed:
            self._flushed, self._flushed_vector = end, dict(sealed_vector)
        self._points.write(self.directory, RecoveryPoint(end, end, sealed_vector))
        self._point_at = end
        self._vector_offset, self._sealed_vector = end, sealed_vector
        segment = Segment.create(self.directory, end, self._lock)
        try:
            fsync_directory(self.directory)
        except BaseException:
            segment.delete()
            raise
        self._segments.append(segment)
        self._bases.append(end)
        self._start_vectors.append(dict(sealed_vector))

    def _checkpoint(self) -> None:
        """Write the recovery point at the flushed offset if it moved since it was last written (lock held).

        Everything below ``_flushed`` was fsynced, and the vector offset (the active segment's base or later)
        lies at or below it, so the file claims nothing that a crash could take back."""
        if self._flushed <= self._point_at or self._vector_offset > self._flushed:
            return
        point = RecoveryPoint(self._flushed, LocalOffset(self._vector_offset), self._sealed_vector)
        try:
            # The origin index names what damage below the recovery point held (recovery trusts and mends by it
            # there, and cuts nothing): its entries reach the file before the point passes them.
            self._segments[-1].write_indexes_out(sync=False, sparse=False)
            self._points.write(self.directory, point)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return  # the last one stays true; startup validates more
        self._point_at = self._flushed

    def _write_recovery_point(self) -> None:
        """Move the recovery point to the log end, at open and close.

        Not fatal on a full disk: the file from the last roll stays valid (its
        vector offset is still the active segment's base), so a node with a
        full disk can still start, serve reads and shut down; the next startup
        just validates more. The roll's write, in contrast, must succeed.
        """
        point = RecoveryPoint(self._log_end, LocalOffset(self._vector_offset), self._sealed_vector)
        try:
            self._points.write(self.directory, point)
            self._point_at = self._log_end
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning(
                "partition log %s: cannot write the recovery point (%s); startup will validate more",
                self.directory,
                exc.strerror,
            )


@dataclasses.dataclass(frozen=True, slots=True)
class FlushMark:
    """A log's end and vector when a grouped flush began, and its active segment's write count then."""

    end: LocalOffset
    vector: dict[Origin, OriginSeq]
    segment: Segment
    writes: int


def flush_together(logs: Sequence[SegmentLog], filesystem_fd: int) -> list[LocalOffset]:
    """Flush many logs of one file system with one ``syncfs`` of ``filesystem_fd`` (a directory on it) instead of
    one fdatasync each: their flushed offsets, in order. Safe from a worker thread.

    ``syncfs`` returns once everything written to the file system before it began is on disk, and (Linux 5.8 and
    later) fails if any writeback of it failed since ``filesystem_fd`` last reported: then no log is marked
    flushed and the error is raised for all of them, as each log's own fsync would have raised it. A caller uses
    it only for logs on the file system of ``filesystem_fd`` and where :data:`GROUP_FLUSH_SUPPORTED`."""
    marks = [log.flush_mark() for log in logs]
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here: flush each log on its own")
    if _SYNCFS(filesystem_fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs failed: {os.strerror(err)}")
    return [log.flushed_offset if mark is None else log.flushed_to(mark) for log, mark in zip(logs, marks, strict=True)]


def _kernel_reports_syncfs_errors() -> bool:
    """syncfs reports writeback errors from Linux 5.8 on; before, it returned 0 whatever happened."""
    release = os.uname().release
    parts = re.match(r"(\d+)\.(\d+)", release)
    return os.uname().sysname == "Linux" and parts is not None and (int(parts[1]), int(parts[2])) >= (5, 8)


_SYNCFS = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
GROUP_FLUSH_SUPPORTED = _SYNCFS is not None and _kernel_reports_syncfs_errors()


def create_empty_log(
    directory: Path, config: LogConfig, now_ms: int, *, points: RecoveryPoints = PARTITION_FILES
) -> SegmentLog:
    """A new, empty log in ``directory`` (made here), with nothing synced: the caller syncs the file system
    (``sync_filesystem``, once for a whole create of topics) before anything relies on it. A crash before that
    leaves an empty directory or an empty segment, which :meth:`SegmentLog.open` takes as a new log; one fsync of
    each new directory had been most of the cost of creating a topic (issue 25: 100,000 topics on first use)."""
    check_config(config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.iterdir()):
        Segment.create(directory, 0, threading.Lock()).close()
    # What is on disk is all this process wrote: the open then neither syncs the directory nor the point.
    return SegmentLog.open(directory, config, now_ms, filesystem_synced=True, points=points)


def sync_filesystem(path: Path) -> None:
    """Make everything written to the file system holding ``path`` durable: one ``syncfs``, before a node opens
    its partitions with ``filesystem_synced`` (``os.sync`` where ``syncfs`` is missing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    syncfs = getattr(libc, "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _vector_below(
    directory: Path, point: RecoveryPoint | None, log_start: int, log_end: int
) -> tuple[dict[Origin, OriginSeq], int]:
    """The persisted vector and the offset it covers up to: ``(vector, covered)``.

    From the recovery point when it is readable and covers the log start. Otherwise (none, or an older point
    from a node's checkpoint, written before retention deleted more) from the ``log-start`` file, which covers
    everything below the log start; with neither, a log starting above offset 0 is refused: the vector of what
    retention deleted would be forgotten, and the site could re-pull it, or issue its own deleted seqs again.
    """
    if point is not None:
        if point.vector_offset > log_end:
            raise PointBeyondLog(
                f"partition log {directory}: the recovery point's vector covers offsets up to {point.vector_offset}, "
                f"but the log ends at {log_end}: the log was cut below its recovery point, which recovery never "
                "does. Restore the partition directory from a backup, or move the node's whole data dir away and "
                "start it empty (a new epoch; every record is pulled back from the linked sites)"
            )
        if point.vector_offset >= log_start:
            return dict(point.vector), point.vector_offset
    if not log_start:
        return {}, 0
    start = read_log_start(directory)
    if start is None or start.log_start < log_start:
        raise StorageError(
            f"partition log {directory}: {RECOVERY_POINT_FILE} and {LOG_START_FILE} are both missing or damaged, and "
            f"the log starts at offset {log_start}: what retention deleted below it is no longer known. Restore "
            "either file from a backup, or move the node's whole data dir away and start it empty (a new epoch; "
            "every record is pulled back from the linked sites)"
        )
    if point is None:
        log.warning(
            "partition log %s: no readable %s; the vector below offset %d comes from %s",
            directory,
            RECOVERY_POINT_FILE,
            start.log_start,
            LOG_START_FILE,
        )
    vector = dict(start.vector)
    for origin, seq in (point.vector if point is not None else {}).items():  # a vector is a per-origin maximum
        vector[origin] = max(vector.get(origin, OriginSeq(0)), seq)
    return vector, start.log_start


def _check_claim(directory: Path, point: RecoveryPoint, segments: list[Segment], lost: list[DamagedBatch]) -> None:
    """Raise :class:`PointBeyondLog` when ``point`` claims bytes the last segment does not have: a slot below it
    that lies past the end of the ``.log`` file (a flipped byte leaves the bytes there; only a point written for
    other data, or a file cut short, puts a claimed batch past the end)."""
    if not segments:
        return
    name = segment_name(segments[-1].base_offset) + LOG_SUFFIX
    claimed = [d for d in lost if d.segment == name]
    if not claimed:
        return
    size = os.stat(directory / name).st_size
    beyond = [d for d in claimed if d.position + d.size_bytes > size]
    if beyond:
        raise PointBeyondLog(
            f"recovery point {point.recovery_point}, but {name} holds {size} bytes and the batch at offset "
            f"{beyond[0].base_offset} would end at byte {beyond[0].position + beyond[0].size_bytes}"
        )


def _start_vectors(
    vector: dict[Origin, OriginSeq],
    vector_offset: int,
    first: dict[Origin, tuple[int, int]],
    segment_ends: list[dict[Origin, int]],
) -> list[dict[Origin, OriginSeq]]:
    """The log's vector at each segment's base, at open: only the vector at ``vector_offset`` is persisted.

    Below the log start, for each origin: the base seq of its first retained batch if that batch lies below
    ``vector_offset``; else (none retained there) all of its records below ``vector_offset`` were deleted, and
    ``vector`` says how far they went. Exact by I1 and I3: a site holds each origin's records as a gapless prefix,
    in origin-seq order, so the records of an origin below its first retained batch are exactly those before that
    batch's base seq. Each later segment's start is the previous one's advanced by its batches (per-origin max).
    """
    start: dict[Origin, OriginSeq] = {}
    for origin, upto in vector.items():
        at = first.get(origin)
        seq = at[1] if at is not None and at[0] < vector_offset else int(upto)
        if seq:
            start[origin] = OriginSeq(seq)
    out: list[dict[Origin, OriginSeq]] = []
    for ends in segment_ends:
        out.append(dict(start))
        for origin, next_seq in ends.items():
            if next_seq > start.get(origin, 0):
                start[origin] = OriginSeq(next_seq)
    return out


def _retention_due(segments: list[Segment], config: LogConfig) -> int | None:
    """When the oldest sealed segment's newest record leaves ``retention_ms`` (``_expired_segments``' rule); None:
    no limit by time, or no sealed segment (a write must roll one first)."""
    if config.retention_ms < 0 or len(segments) < 2:
        return None
    return segments[0].max_timestamp + config.retention_ms + 1


def _write_damaged(directory: Path, damaged: dict[int, DamagedBatch]) -> None:
    """Persist a log's quarantine list (its lock held): it must survive restarts, or damage would be forgotten."""
    if damaged:
        quarantined.add(directory)
    else:
        quarantined.discard(directory)
    quarantine_changes[0] += 1
    path = directory / DAMAGED_FILE
    if not damaged:
        path.unlink(missing_ok=True)
        return
    rows = [dataclasses.asdict(d) | {"origin": str(d.origin)} for _, d in sorted(damaged.items())]
    replace_file(path, dumps_checked({"format": 2, "batches": rows}))


def _read_damaged(directory: Path) -> list[DamagedBatch] | None:
    """The quarantine list as ``damaged.json`` has it: ``[]`` when there is none, ``None`` when it is unreadable.

    It is derived, like the indexes: an unreadable list is found again by walking every segment, and every entry
    is checked against the bytes before it is believed (``SegmentLog._quarantine_at_open``).
    """
    path = directory / DAMAGED_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        # A bare list was written before the checksum.
        rows = json.loads(data) if data.lstrip().startswith(b"[") else loads_checked(data)["batches"]
        return [DamagedBatch(**(row | {"origin": Origin.parse(row["origin"])})) for row in rows]
    except (DamagedStateFile, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("partition log %s: %s is unreadable (%s)", directory, DAMAGED_FILE, exc)
        return None


def _origin_key(origin: Origin) -> OriginKey:
    return (origin.site.encode("ascii").ljust(32, b"\0"), origin.epoch)


def _first_bad_batch(data: bytes, offset: int) -> str | None:
    """Why the batches read for ``offset`` cannot be served (CRC, framing, offsets), or None."""
    view = memoryview(data)
    pos = 0
    expected = -1
    while pos < len(data):
        try:
            header = check_batch(view, pos)
        except CorruptBatch as exc:
            return str(exc)
        if expected < 0:
            if not header.base_offset <= offset < header.next_offset:
                return f"the batch read for offset {offset} holds {header.base_offset}..{header.next_offset - 1}"
        elif header.base_offset != expected:
            return f"batch at byte {pos} of the read has base offset {header.base_offset}, not {expected}"
        expected = header.next_offset
        pos += header.size_bytes
    return None


def _check_stored(fd: int, entry: OriginEntry) -> str | None:
    """Why the batch an origin-index entry describes is damaged in the ``.log``, or None."""
    return _stored_problem(os.pread(fd, entry.size_bytes, entry.position), entry)


def _invalid_records(data: bytes) -> str | None:
    """Why a whole, CRC-valid stored batch holds records no reader accepts (it was stored before every batch was
    validated: issue 20), or None. Not damage: every site holds the same bytes, so no peer can repair it."""
    try:
        check_records(data, parse_header(data), READ_RECORDS_BYTES_MAX)
    except InvalidBatch as exc:
        return str(exc)
    return None


def _stored_problem(data: bytes, entry: OriginEntry) -> str | None:
    if len(data) != entry.size_bytes:
        return f"the segment ends {entry.size_bytes - len(data)} bytes into the batch"
    try:
        header = check_batch(data)
    except CorruptBatch as exc:
        return str(exc)
    stored = {
        "base_offset": header.base_offset,
        "size": header.size_bytes,
        "origin_site": header.origin_site,
        "origin_epoch": header.origin_epoch,
        "base_origin_seq": header.base_origin_seq,
        "records": header.records_count,
        "crc": header.crc,
        "append_time_ms": header.append_time_ms,
        "max_timestamp": header.max_timestamp,
        "producer_id": header.producer_id,
        "producer_epoch": header.producer_epoch,
        "base_sequence": header.base_sequence,
    }
    indexed = {
        "base_offset": entry.base_offset,
        "size": entry.size_bytes,
        "origin_site": entry.origin_site.rstrip(b"\0").decode("ascii", "replace"),
        "origin_epoch": entry.origin_epoch,
        "base_origin_seq": entry.base_origin_seq,
        "records": entry.last_offset_delta + 1,
        "crc": entry.crc,
        "append_time_ms": entry.append_time_ms,
        "max_timestamp": entry.max_timestamp,
        "producer_id": entry.producer_id,
        "producer_epoch": entry.producer_epoch,
        "base_sequence": entry.base_sequence,
    }
    differ = [f"{k} {stored[k]} where the origin index says {indexed[k]}" for k in stored if stored[k] != indexed[k]]
    return f"its header has {', '.join(differ)}" if differ else None


def _origin_of(names: dict[tuple[bytes, int], Origin], entry: OriginEntry) -> Origin:
    key = (entry.origin_site, entry.origin_epoch)
    origin = names.get(key)
    if origin is None:
        site = SiteId(entry.origin_site.rstrip(b"\0").decode("ascii", "replace"))
        origin = names[key] = Origin(site, entry.origin_epoch)
    return origin


def _tidy_directory(directory: Path, names: list[str], report: RecoveryReport, log_start: int | None) -> list[int]:
    """Remove stray ``.tmp`` files; return the segments' base offsets.

    Index files without a ``.log`` below ``log_start`` (the ``log-start`` file's, written before retention
    deletes) are what a crash during retention leaves (a segment is deleted ``.log`` first): removed. Anywhere
    else a ``.log`` was lost while its origin index survived, which no crash does: an empty ``.log`` is put back,
    so that recovery quarantines every batch the index names there and repairs them from peers, instead of
    refusing the whole log or, for the first segment, starting the log later and losing its records silently.
    """
    logs: set[int] = set()
    indexes: list[tuple[int, Path]] = []
    for name in names:  # names, not paths: 10,000 partitions' listings at start
        if name.endswith(TMP_SUFFIX):
            log.warning("partition log %s: removing stray %s", directory, name)
            (directory / name).unlink()
            report.files_removed += 1
            continue
        match = _SEGMENT_FILE.fullmatch(name)
        if match is None:
            continue
        if match.group(2) == LOG_SUFFIX:
            logs.add(int(match.group(1)))
        else:
            indexes.append((int(match.group(1)), directory / name))
    for base, path in sorted(indexes):
        if base in logs:
            continue
        deleted = log_start is not None and base < log_start
        if not deleted and path.name.endswith(ORIGIN_INDEX_SUFFIX):
            log.error(
                "partition log %s: %s has lost its .log; its batches are quarantined until repaired",
                directory,
                path.name,
            )
            (directory / (path.name[: -len(ORIGIN_INDEX_SUFFIX)] + LOG_SUFFIX)).touch(mode=0o600)
            report.files_restored += 1
            logs.add(base)
        elif deleted:
            log.warning("partition log %s: removing %s, which has no .log", directory, path.name)
            path.unlink()
            report.files_removed += 1
    return sorted(logs)


def _load_segments(
    directory: Path,
    config: LogConfig,
    bases: list[int],
    point: RecoveryPoint | None,
    may_trust: bool,
    out: tuple[list[Segment], list[BytesLike], list[DamagedBatch]],
    report: RecoveryReport,
    owner: threading.Lock,
    synced: bool,
) -> None:
    """Load every segment in order into ``out``'s ``segments`` (and their origin-index entries into ``loaded``);
    what their plans find lost goes into ``lost``.

    A sealed segment is never cut (its end is its own durable end: it was fsynced when it rolled); the last one
    is cut only at or above the recovery point, where a crash can leave a torn write.
    """
    segments, loaded, lost = out
    durable = point.recovery_point if point is not None else 0
    running: dict[OriginKey, int] = {}
    for i, base in enumerate(bases):
        if segments and base != segments[-1].next_offset:
            # A roll fsyncs the sealed segment first, so no crash leaves this: a segment file was deleted or
            # lost along with its origin index. Cutting the log here would throw away every good segment after it.
            raise MissingSegment(_missing(directory, segments[-1].next_offset, base))
        next_base = bases[i + 1] if i + 1 < len(bases) else None
        trust = may_trust and next_base is not None and next_base <= durable
        segment, outcome = Segment.load(
            directory,
            base,
            config.index_interval_bytes,
            next_base=next_base,
            durable_end=durable if next_base is None else next_base,
            running=running,
            trust=trust,
            owner=owner,
            synced=synced,
            trust_prefix=may_trust and next_base is None,
        )
        segments.append(segment)
        loaded.append(outcome.origin_entries)
        if outcome.extended:
            _write_lacking_indexes(segment)
        for entry in iter_origin_entries(outcome.origin_entries):
            running[entry.origin_key] = entry.next_origin_seq
        report.segments_validated += outcome.validated
        report.segments_trusted += not outcome.validated
        report.indexes_rebuilt += outcome.rebuilt
        report.indexes_extended += outcome.extended
        report.indexed_batches_lost += outcome.indexed_batches_lost
        if outcome.plan is not None:
            _report_plan(directory, segment, outcome.plan, lost, report)


def _write_indexes_at_close(segment: Segment) -> bool:
    """Write and fsync the active segment's waiting index entries at a clean stop (``owner`` held): False when they
    could not be (the recovery point then stays where it is, and the next start walks the segment)."""
    try:
        segment.write_indexes_out(sync=True)
    except (OSError, StorageError) as exc:
        log.warning(
            "partition log %s: cannot write the index files of segment %s at close (%s); the next start rebuilds "
            "them from the log",
            segment.directory,
            segment_name(segment.base_offset),
            exc,
        )
        return False
    return True


def _write_lacking_indexes(segment: Segment) -> None:
    """Write the index entries a crash left out of the active segment's files (``owner`` held), without fsync: the
    recovery point then stays covered by the origin index. On a full disk they wait in memory, as an append's do,
    and the node still starts."""
    try:
        segment.write_indexes_out(sync=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning(
            "partition log %s: no space to write the index entries of segment %s (%s); they are kept in memory",
            segment.directory,
            segment_name(segment.base_offset),
            exc.strerror,
        )


def _missing(directory: Path, start: int, end: int) -> str:
    return (
        f"partition log {directory}: the segment file(s) holding offsets {start}..{end - 1} are missing, and so "
        "is their origin index. Restore them from a backup; or stop the node, move its whole data dir away and "
        "start it empty: the site gets a new epoch and pulls every record back"
    )


def _report_plan(
    directory: Path, segment: Segment, plan: SegmentPlan, lost: list[DamagedBatch], report: RecoveryReport
) -> None:
    name = segment_name(segment.base_offset) + LOG_SUFFIX
    for slot in plan.mended:
        log.warning(
            "partition log %s: %s byte %d: only the batch's local prefix was damaged (its CRC-covered "
            "bytes match the origin index); rewrote it",
            directory,
            name,
            slot.entry.position,
        )
    for found in plan.lost:
        lost.append(damaged_slot(found.entry, name, found.reason))
    if plan.cut is not None:
        report.damaged_offset = LocalOffset(plan.next_offset)
        report.damage = f"segment {name}: {plan.cut}"
        log.warning(
            "partition log %s: %s; cut there (above the recovery point, so never acknowledged by an "
            "fsync that recovery could see)",
            directory,
            report.damage,
        )


def damaged_slot(entry: OriginEntry, segment: str, reason: str) -> DamagedBatch:
    site = SiteId(entry.origin_site.rstrip(b"\0").decode("ascii", "replace"))
    return DamagedBatch(
        entry.base_offset,
        entry.next_offset,
        Origin(site, entry.origin_epoch),
        entry.base_origin_seq,
        entry.next_origin_seq - 1,
        segment,
        entry.position,
        entry.size_bytes,
        reason,
        entry.crc,
    )


def _conforms(segment_log: SegmentLog) -> PartitionLog:
    """mypy checks here that SegmentLog implements the PartitionLog protocol."""
    return segment_log


__all__ = [
    "INDEX_SUFFIX",
    "LOG_SUFFIX",
    "ORIGIN_INDEX_SUFFIX",
    "InvalidLogConfig",
    "LogClosed",
    "RecoveryReport",
    "SegmentLog",
    "check_config",
]


# A digest scan's walk of a log (georep/storage/digests.py): functions of the module rather than methods, so
# SegmentLog keeps to its size; they read its segments under its lock as its methods do.
def scan_plan(log: SegmentLog, from_offset: int, end_offset: int) -> list[tuple[int, ScanBounds]]:
    """Where a digest scan of ``[from_offset, end_offset)`` walks, one :class:`ScanBounds` per segment file
    (``georep/storage/digests.py``), with the file's base offset: each file's size now, the first one from the
    sparse-index entry at or before ``from_offset``. Nothing is opened here; :func:`scan_fd` opens one file at
    a time."""
    out: list[tuple[int, ScanBounds]] = []
    with log._lock:
        log._check_open()
        point = max(log._point_at, 0)
        first = max(from_offset, log._log_start)
        for i, segment in enumerate(log._segments):
            if (segment.next_offset <= first and segment.size > 0) or segment.base_offset >= end_offset:
                continue
            position, base = 0, segment.base_offset
            if segment.base_offset < first:
                position, base = segment.index_entry(first)
            last = i == len(log._segments) - 1
            out.append((segment.base_offset, ScanBounds(base, segment.size, last, point, position, end_offset)))
    return out


def scan_fd(log: SegmentLog, segment_base: int) -> int | None:
    """A descriptor of its own (the caller closes it) on the ``.log`` whose base is ``segment_base``, opened
    through the handle cache; None when retention deleted the segment since :func:`scan_plan`."""
    with log._lock:
        log._check_open()
        i = bisect_right(log._bases, segment_base) - 1
        if i < 0 or log._bases[i] != segment_base:
            return None
        return os.dup(log._segments[i].log_fd)
