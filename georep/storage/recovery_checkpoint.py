"""The recovery-point checkpoint: one file holding the recovery point of every partition of a node's ``logs/``.

As Kafka's ``recovery-point-offset-checkpoint``: a node with 10,000 partitions stopped cleanly once wrote 10,000
``recovery-point`` files (each a write, an fsync, a rename and a directory fsync: about 30 s). Now each log keeps
its recovery point in memory (:class:`RecoveryCheckpoint` is the :class:`~georep.storage.recovery_point.RecoveryPoints`
a node's logs are opened with) and the node writes them all in one file, ``logs/recovery-point-checkpoint``:

* at the end of a start-up (after every partition opened), at each retention run (``--retention-check-ms``) when
  a point moved, and at a clean stop after every log was fsynced and closed;
* atomically (:func:`~georep.storage.durable_file.replace_file`: temp, fsync, rename, directory fsync), as UTF-8
  JSON with its own CRC-32C (:mod:`georep.storage.checked_json`), on one line (shown indented here), each entry
  serialised once while its point stays the same (a save at 100,000 partitions takes 0.2 s, 0.7 s when every
  point moved, where serialising the whole document took 4 s)::

    {"crc32c": 3735928559,
     "format": 1,
     "partitions": {"orders-0": {"dir_ino": 1234567, "recovery_point": 1234, "vector_offset": 1200,
                                 "vector": {"us-east@1700000000": 17}}}}

  Each entry has the meaning of a ``recovery-point`` file (:mod:`georep.storage.recovery_point`); ``dir_ino`` is
  the inode of the partition directory it was written for, so a directory restored from a backup, or made anew
  under the same name, is not taken for the one the entry speaks of.

Why a file written only now and then is safe. Every point in it was true when it was written: everything below
``recovery_point`` was fsynced, and ``vector`` covers what lies below ``vector_offset``. A log only grows above its
recovery point (recovery cuts only above it), so an older point is a lower one, which only makes the next start
validate more. The one thing an old entry could miss is what retention deleted since, above its
``vector_offset``: retention writes the ``log-start`` file first, and :func:`SegmentLog.open
<georep.storage.segment_log.SegmentLog.open>` takes the vector below the log start from it when the entry covers
less.

It is derived, so the data outranks it: a missing, torn or mismatched file (checksum), an entry whose directory
is another (``dir_ino``), and an entry that claims more than its log holds (``SegmentLog.open`` checks:
a point past the data, a vector offset past the log end) all mean the same as a missing entry: that partition
(or every one) is validated from its segments, as after a crash with no recovery point, and a warning says so.
Entries of partitions that no longer exist are dropped at the next write.

Upgrade. A partition with no entry that still has its old ``recovery-point`` file is opened with that file once;
after the checkpoint holding its entry is durable, the old file is removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from georep.storage.checked_json import DamagedStateFile, dumps_checked_canonical, read_checked
from georep.storage.durable_file import replace_file
from georep.storage.recovery_point import FILE_NAME as PARTITION_FILE
from georep.storage.recovery_point import RecoveryPoint, read_recovery_point
from offsets.coordinates import InvalidOrigin, LocalOffset, Origin, OriginSeq
from topology.ids import InvalidSiteId

_quoted = json.encoder.encode_basestring_ascii  # a JSON string as json.dumps writes it (ASCII)

FILE_NAME = "recovery-point-checkpoint"
FORMAT = 1

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Entry:
    dir_ino: int
    point: RecoveryPoint


class RecoveryCheckpoint:
    """The recovery points of every partition directory in ``logs_dir``, kept in memory and written as one file.

    Thread-safe: logs write their points from worker threads (a topic create, a flush) while the event loop
    writes the file."""

    may_be_wrong = True  # written now and then, and keyed by a name: SegmentLog.open checks its claims

    def __init__(self, logs_dir: Path, entries: dict[str, _Entry], *, readable: bool) -> None:
        self.logs_dir = logs_dir
        self.path = logs_dir / FILE_NAME
        self.readable = readable  # False: the file was there but damaged (every partition is validated)
        self._found = entries  # as read at start: consulted once per partition, then dropped
        self._points: dict[str, _Entry] = {}
        self._legacy: set[str] = set()  # partitions opened from an old recovery-point file, removed once written
        self._moved: list[str] = []  # partitions whose entry was written for another directory of their name
        self._lock = threading.Lock()
        self._saving = threading.Lock()  # held through a save, the file's write included
        self._dirty = False
        self._texts: dict[str, tuple[_Entry, str]] = {}  # each entry's member text, serialised once (save)

    @classmethod
    def load(cls, logs_dir: Path) -> RecoveryCheckpoint:
        """The checkpoint in ``logs_dir``; an empty one, with a warning, when the file is missing or damaged."""
        path = logs_dir / FILE_NAME
        try:
            doc = read_checked(path)
            if doc is None:
                return cls(logs_dir, {}, readable=True)
            if doc["format"] != FORMAT:
                raise ValueError(f"format {doc['format']!r}, this build reads {FORMAT}")
            partitions = doc["partitions"]
            if not isinstance(partitions, dict):
                raise ValueError("'partitions' is not an object")
            entries = {str(name): _parse_entry(raw) for name, raw in partitions.items()}
        except (DamagedStateFile, ValueError, KeyError, TypeError, AttributeError, InvalidOrigin, InvalidSiteId) as exc:
            log.warning(
                "%s is unreadable (%s): every partition is validated from its segments at this start, and the "
                "file is written anew",
                path,
                exc,
            )
            return cls(logs_dir, {}, readable=False)
        return cls(logs_dir, entries, readable=True)

    # -- the RecoveryPoints a log is opened with ----------------------------------------------------------

    def read(self, directory: Path, names: Collection[str]) -> RecoveryPoint | None:
        """``directory``'s recovery point: its checkpoint entry if that is for this very directory; else its old
        ``recovery-point`` file (``names``: the directory's listing), read once."""
        name = directory.name
        with self._lock:
            entry = self._found.pop(name, None)
        if entry is not None:
            if PARTITION_FILE in names:  # its removal after the last migration was lost in a crash
                with self._lock:
                    self._legacy.add(name)
            ino = _inode(directory)
            with self._lock:
                if entry.dir_ino == ino:  # still true: kept for the next write, unless the open moves or distrusts it
                    self._points.setdefault(name, entry)
                    return entry.point
                self._moved.append(name)  # logged once for all by started(): a copied data dir moves every one
            log.debug("partition log %s: entry for inode %d, this directory is %d", directory, entry.dir_ino, ino)
            return None
        if PARTITION_FILE not in names:
            return None
        point = read_recovery_point(directory)
        with self._lock:
            self._legacy.add(name)
            if point is not None:
                self._points.setdefault(name, _Entry(_inode(directory), point))
        return point

    def write(self, directory: Path, point: RecoveryPoint) -> None:
        """Keep ``point`` for ``directory`` (in memory: :meth:`save` writes the file)."""
        entry = _Entry(_inode(directory), point)
        with self._lock:
            self._points[directory.name] = entry
            self._dirty = True

    def distrust(self, directory: Path, why: str) -> None:
        """The open of ``directory`` found its point claiming more than the log holds: dropped (the open then
        validates every segment and writes a true one)."""
        with self._lock:
            self._points.pop(directory.name, None)
            self._dirty = True
        log.error(
            "partition log %s: the recovery point in %s claims more than the log holds (%s): not trusted; the "
            "partition is validated from its segments and its entry written anew",
            directory,
            FILE_NAME,
            why,
        )

    # -- the node's ----------------------------------------------------------------------------------------

    def forget(self, names: Iterable[str]) -> None:
        """Partition directories that were removed: their entries go at the next :meth:`save`."""
        with self._lock:
            for name in names:
                self._found.pop(name, None)
                if self._points.pop(name, None) is not None:
                    self._dirty = True

    def started(self, opened: Collection[str]) -> None:
        """The node's start-up opened the directories ``opened``: entries of any other are dropped (logged)."""
        with self._lock:
            stale = sorted(set(self._found) - set(opened))
            self._found.clear()
            self._dirty = True
            legacy = len(self._legacy)
            moved, self._moved = self._moved, []
        if moved:
            log.warning(
                "%s has entries written for other directories of the names of %d partition(s) (%s): a data dir "
                "copied or restored, or a partition made anew; they were validated from their segments",
                self.path,
                len(moved),
                _some(sorted(moved)),
            )
        if legacy:
            log.info(
                "%d partition(s) started from their old per-partition %s file (an upgrade); %s replaces them",
                legacy,
                PARTITION_FILE,
                self.path,
            )
        if stale:
            log.warning(
                "%s names %d partition(s) this node does not have (%s): dropped", self.path, len(stale), _some(stale)
            )

    def save(self, *, force: bool = False) -> bool:
        """Write the file if a point moved since the last write (or ``force``); whether it wrote. Then remove
        the old per-partition files it replaces. Raises ``OSError`` (the last file written stays).

        One save at a time: a retention run writes it in a thread, which a stop does not wait for before its own
        save, and two writers of the one temporary file would mix their bytes."""
        with self._saving:
            return self._save(force)

    def _save(self, force: bool) -> bool:
        with self._lock:
            if not (self._dirty or force):
                return False
            # Entries not read yet (a partition not opened so far) stay: they are checked when it is opened.
            kept = {**self._found, **self._points}
            text = self._canonical(kept)
            legacy = sorted(self._legacy & set(self._points))
            self._dirty = False
        try:
            replace_file(self.path, dumps_checked_canonical(text))
        except BaseException:
            with self._lock:
                self._dirty = True
            raise
        for name in legacy:  # only now: the checkpoint holds their points durably
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.logs_dir / name / PARTITION_FILE)
        with self._lock:
            self._legacy.difference_update(legacy)
        if legacy:
            log.info("%s written; removed %d old per-partition %s file(s)", self.path, len(legacy), PARTITION_FILE)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._points)

    def _canonical(self, kept: dict[str, _Entry]) -> str:
        """The file's canonical text (lock held): each entry serialised once while it stays the same object, so a
        save costs a join of the node's entries plus the serialisation of those that moved, not 4 s of
        ``json.dumps`` at 100,000 partitions."""
        texts = self._texts
        fresh: dict[str, tuple[_Entry, str]] = {}
        for name, entry in kept.items():
            cached = texts.get(name)
            fresh[name] = (
                cached if cached is not None and cached[0] is entry else (entry, f"{_quoted(name)}:{_member(entry)}")
            )
        self._texts = fresh
        members = ",".join(fresh[name][1] for name in sorted(fresh))
        return f'{{"format":{FORMAT},"partitions":{{{members}}}}}'


def recorded_point(directory: Path) -> RecoveryPoint | None:
    """The recovery point a node recorded for the partition ``directory``, for a reader that changes nothing (the
    audit's file mode): its entry in the checkpoint of the directory's parent, when written for this directory;
    else its own ``recovery-point`` file (an older build's, or a log kept on its own, as a multi-node site's
    segment copies); else ``None``. The checkpoint is parsed once per version of the file."""
    try:
        st = os.stat(directory.parent / FILE_NAME)
    except FileNotFoundError:
        entries: dict[str, _Entry] = {}
    else:
        entries = _recorded(str(directory.parent), st.st_mtime_ns, st.st_size)
    entry = entries.get(directory.name)
    if entry is not None and entry.dir_ino == _inode(directory):
        return entry.point
    return read_recovery_point(directory) if (directory / PARTITION_FILE).exists() else None


@functools.lru_cache(maxsize=8)
def _recorded(logs_dir: str, mtime_ns: int, size: int) -> dict[str, _Entry]:
    del mtime_ns, size  # the cache key: a rewritten file is read again
    checkpoint = RecoveryCheckpoint.load(Path(logs_dir))
    return dict(checkpoint._found)


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _inode(directory: Path) -> int:
    return os.stat(directory).st_ino


def _parse_entry(raw: Any) -> _Entry:
    point = RecoveryPoint(
        LocalOffset(_non_negative(raw["recovery_point"])),
        LocalOffset(_non_negative(raw["vector_offset"])),
        {Origin.parse(k): OriginSeq(_non_negative(v)) for k, v in raw["vector"].items()},
    )
    return _Entry(_non_negative(raw["dir_ino"]), point)


def _member(entry: _Entry) -> str:
    """The entry's canonical text (what :func:`~georep.storage.checked_json.canonical` gives for its object),
    written out: four times faster, which is 2 s of a node's CPU less in a save after 100,000 partitions moved.
    ``test_each_save_writes_what_serialising_the_whole_document_gives`` compares the two."""
    p = entry.point
    vector = ",".join(f"{_quoted(o)}:{int(seq)}" for o, seq in sorted((str(o), seq) for o, seq in p.vector.items()))
    return (
        f'{{"dir_ino":{entry.dir_ino},"recovery_point":{int(p.recovery_point)},"vector":{{{vector}}},'
        f'"vector_offset":{int(p.vector_offset)}}}'
    )


def _non_negative(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
