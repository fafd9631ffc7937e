"""The ``recovery-point`` file of a partition directory.

UTF-8 JSON, replaced atomically (see :mod:`georep.storage.durable_file`), with its own checksum
(:mod:`georep.storage.checked_json`)::

    {"crc32c": 3735928559,
     "format": 2,
     "recovery_point": 1234,
     "vector_offset": 1200,
     "vector": {"us-east@1700000000": 17, "eu-west@1700000123": 5}}

Format 2 added the checksum: a flipped digit in the vector parses as JSON and would claim seqs the log does not
hold. A format-1 file (no checksum) is still read; the next write replaces it.

``recovery_point``
    Every batch below this local offset was fsynced and validated. At startup,
    sealed segments that end at or below it are trusted without a rescan.
``vector_offset``, ``vector``
    ``{origin: next origin seq}`` over every batch ever appended below
    ``vector_offset``, including batches that retention has deleted since.
    ``vector_offset`` is the base offset of the active segment when the file
    was written, and retention deletes only sealed segments, so every deleted
    batch lies below it: this is how ``SegmentLog.vector()`` survives the
    deletion of all of an origin's segments. Batches at or above
    ``vector_offset`` are still in the log and are read back from the origin
    indexes.

Text rather than binary because it is tiny, written only on roll and close,
and an operator may want to read it.

A node's logs keep their points in one file for all partitions instead
(:mod:`georep.storage.recovery_checkpoint`); a log opened on its own (tests, a multi-node site's segment copies)
uses this file. :class:`RecoveryPoints` is where a log reads and writes its point.

It is derived: the segments are the truth. An unreadable file only means that every segment is walked at the
next start; :mod:`georep.storage.log_start` keeps the one thing the segments cannot give back (the vector of
what retention deleted).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from georep.storage.checked_json import DamagedStateFile, dumps_checked, read_checked
from georep.storage.durable_file import replace_file
from offsets.coordinates import InvalidOrigin, LocalOffset, Origin, OriginSeq
from topology.ids import InvalidSiteId

FILE_NAME = "recovery-point"
FORMAT = 2
_UNCHECKED_FORMAT = 1  # written before the checksum

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryPoint:
    recovery_point: LocalOffset
    vector_offset: LocalOffset
    vector: dict[Origin, OriginSeq] = field(default_factory=dict)


def read_recovery_point(directory: Path) -> RecoveryPoint | None:
    """The directory's recovery point; ``None`` if missing or unreadable (logged)."""
    path = directory / FILE_NAME
    try:
        doc = read_checked(path, unchecked_formats=(_UNCHECKED_FORMAT,))
        if doc is None:
            return None
        if doc["format"] not in (FORMAT, _UNCHECKED_FORMAT):
            raise ValueError(f"format {doc['format']!r}, this build reads {FORMAT}")
        point = LocalOffset(_non_negative(doc["recovery_point"]))
        vector_offset = LocalOffset(_non_negative(doc["vector_offset"]))
        vector = {Origin.parse(k): OriginSeq(_non_negative(v)) for k, v in doc["vector"].items()}
    except (DamagedStateFile, ValueError, KeyError, TypeError, AttributeError, InvalidOrigin, InvalidSiteId) as exc:
        log.warning("%s is unreadable (%s): every segment will be validated at startup", path, exc)
        return None
    return RecoveryPoint(point, vector_offset, vector)


def write_recovery_point(directory: Path, point: RecoveryPoint) -> None:
    doc = {
        "format": FORMAT,
        "recovery_point": point.recovery_point,
        "vector_offset": point.vector_offset,
        "vector": {str(origin): seq for origin, seq in sorted(point.vector.items())},
    }
    replace_file(directory / FILE_NAME, dumps_checked(doc))


def _non_negative(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


class RecoveryPoints(Protocol):
    """Where a partition log keeps its recovery point: its own file (:data:`PARTITION_FILES`) or a node's
    checkpoint of every partition (``georep/storage/recovery_checkpoint.py``).

    ``may_be_wrong``: its points are not written durably at each write (a checkpoint written now and then, whose
    entry may be for another directory of the same name), so a point that claims more than the log holds is
    dropped and the log validated from its segments; otherwise that is damage below a true recovery point, and
    the log is refused."""

    may_be_wrong: bool

    def read(self, directory: Path, names: Collection[str]) -> RecoveryPoint | None:
        """``directory``'s point (``names``: its listing), or ``None``: none, or none to trust."""

    def write(self, directory: Path, point: RecoveryPoint) -> None:
        """``point`` is true for ``directory`` now (durable on return, or when its keeper says so)."""

    def distrust(self, directory: Path, why: str) -> None:
        """The point :meth:`read` gave claims more than the log holds (``why``): not to be used again."""


class PartitionFile:
    """The ``recovery-point`` file in each partition directory, written durably at each write."""

    may_be_wrong = False

    def read(self, directory: Path, names: Collection[str]) -> RecoveryPoint | None:
        return read_recovery_point(directory) if FILE_NAME in names else None

    def write(self, directory: Path, point: RecoveryPoint) -> None:
        write_recovery_point(directory, point)

    def distrust(self, directory: Path, why: str) -> None:
        raise AssertionError("a partition's own recovery-point file is never distrusted")


PARTITION_FILES = PartitionFile()
