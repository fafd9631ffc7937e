"""A bound on the segment files a process keeps open: the least recently used segments close first.

A node with 10,000 partitions would otherwise keep a file open for each segment it ever used and hit its descriptor
limit, as Kafka would without its bound on index mmaps. Every use of a segment's descriptor goes through
:meth:`HandleCache.fds`, which opens the segment's files on demand and closes those of the least recently used
segments beyond ``max_open_files``. A segment keeps one file here, its ``.log``: the active segment's index entries
live in memory until it seals (``georep/storage/segment.py``), and a sealed segment's ``.oindex`` is read through a
descriptor opened for that one lookup. So a miss on the append path opens one file and closes one, not three.

Why closing is safe:

- **Nobody is using what is closed.** Every direct use of a segment's descriptors happens with its log's lock
  held (I/O outside the lock runs on a ``dup``). A victim is closed only when that lock can be taken without
  waiting; a segment whose log is busy (or being opened, which holds the lock) is skipped. So a write or read
  never finds its descriptor closed, or reused for another file.
- **Nothing written is lost.** A segment with writes not yet fsynced is fsynced before its files close (flush
  before close); an fsync that fails keeps the files open, so the partition's own next flush reports the
  error on a descriptor that saw it. Eviction prefers clean segments (a partition's flush syncs its ``.log``),
  so that this fsync rarely runs on the caller's thread, which is the event loop's for an append.

One cache per process (descriptors are a process's resource): the node sizes it from ``--max-open-files``.
When every candidate is busy the cache runs over its bound for a moment rather than wait (at most the
segments of the logs locked at that instant).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from itertools import islice
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_FILES = 1000
FILES_PER_SEGMENT = 1  # the .log (the index files are written at seal, read on demand)
# How far from the least recently used end eviction looks for a clean segment first. A partition's flush leaves
# its segment clean, so under a produce over more partitions than the bound the oldest segments are clean.
CLEAN_SCAN = 64


class CachedFiles(Protocol):
    """What the cache needs of a segment."""

    owner: threading.Lock  # the lock of the log that holds it

    @property
    def dirty(self) -> bool:
        """Written since its files were last fsynced (read without ``owner``: a hint, release_files decides)."""

    def open_files(self) -> tuple[int, ...]:
        """Open the segment's files (the cache keeps the descriptors)."""

    def release_files(self, fds: tuple[int, ...]) -> bool:
        """fsync what is unsynced, then close ``fds``; False (nothing closed) when the fsync failed."""


class InvalidMaxOpenFiles(ValueError):
    """A ``--max-open-files`` too small to keep one segment open."""


class HandleCache:
    """Open segment files, least recently used first, within ``max_open_files`` (see the module doc)."""

    def __init__(self, max_open_files: int = DEFAULT_MAX_OPEN_FILES) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[CachedFiles, tuple[int, ...]] = OrderedDict()
        self._files = 0  # descriptors in _open
        self.max_open_files = DEFAULT_MAX_OPEN_FILES
        self.resize(max_open_files)
        self.opened_total = 0
        self.closed_total = 0

    def resize(self, max_open_files: int) -> None:
        if max_open_files < FILES_PER_SEGMENT:
            raise InvalidMaxOpenFiles(
                f"max open files {max_open_files} is below {FILES_PER_SEGMENT}, the files of one segment: "
                "raise --max-open-files"
            )
        with self._lock:
            self.max_open_files = max_open_files
            self._make_room(0)

    @property
    def open_files(self) -> int:
        with self._lock:
            return self._files

    @property
    def full(self) -> bool:
        """Opening one more segment would close another (read without the lock: a hint)."""
        return self._files + FILES_PER_SEGMENT > self.max_open_files

    def fds(self, segment: CachedFiles) -> tuple[int, ...]:
        """The segment's descriptors, opened now if they were closed (its log's lock is held by the caller)."""
        with self._lock:
            fds = self._open.get(segment)
            if fds is not None:
                self._open.move_to_end(segment)
                return fds
            self._make_room(FILES_PER_SEGMENT)
            fds = segment.open_files()
            self._open[segment] = fds
            self._files += len(fds)
            self.opened_total += 1
            return fds

    def admit(self, segment: CachedFiles, fds: tuple[int, ...]) -> None:
        """Keep descriptors a segment opened itself (a new segment)."""
        with self._lock:
            self._make_room(len(fds))
            self._open[segment] = fds
            self._files += len(fds)
            self.opened_total += 1

    def is_open(self, segment: CachedFiles) -> bool:
        with self._lock:
            return segment in self._open

    def discard(self, segment: CachedFiles) -> tuple[int, ...] | None:
        """Forget the segment; its descriptors, if open, are the caller's to close."""
        with self._lock:
            fds = self._open.pop(segment, None)
            if fds is not None:
                self._files -= len(fds)
            return fds

    def _make_room(self, need: int) -> None:
        """Close least recently used segments until ``need`` more files fit (cache lock held): clean ones first,
        among the ``CLEAN_SCAN`` least recently used (closing them costs no fsync), then any in LRU order.

        At most ``CLEAN_SCAN`` entries are looked at before the first close: under appends to more partitions than
        the bound, every append misses, and a copy of the whole cache per miss was a cost of its own."""
        while self._files + need > self.max_open_files:
            if not (self._close_first(clean_only=True) or self._close_first(clean_only=False)):
                return  # every candidate looked at is in use: run over the bound for a moment rather than wait

    def _close_first(self, *, clean_only: bool) -> bool:
        """Close the least recently used segment (clean, with ``clean_only``) among the first ``CLEAN_SCAN`` that
        can be closed now; under a produce over more partitions than the bound that is the first one looked at."""
        for victim in islice(self._open, CLEAN_SCAN):
            if (not clean_only or not victim.dirty) and self._close(victim):
                return True  # _close changed the dict: stop iterating it
        return False

    def _close(self, victim: CachedFiles) -> bool:
        """Close ``victim``'s files if its log is free and its unsynced writes fsync (cache lock held)."""
        fds = self._open.get(victim)
        if fds is None or not victim.owner.acquire(blocking=False):
            return False  # closed already, or its log is in use (maybe by this thread): never close under a user
        try:
            if not victim.release_files(fds):
                return False
            del self._open[victim]
            self._files -= len(fds)
            self.closed_total += 1
            return True
        finally:
            victim.owner.release()


HANDLES = HandleCache()
"""The process's cache: every segment log uses it."""


def set_max_open_files(max_open_files: int) -> None:
    """Bound the segment files this process keeps open (the node's ``--max-open-files``)."""
    HANDLES.resize(max_open_files)


def close_quietly(fds: tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            log.warning("closing a segment file: %s", exc)
