"""The ``log-start`` file of a partition directory: the vector of everything below the log start.

UTF-8 JSON with its own checksum (:mod:`georep.storage.checked_json`), replaced atomically::

    {"crc32c": 3735928559, "format": 1, "log_start": 4711, "vector": {"us-east@1700000000": 17}}

``vector`` is ``{origin: next origin seq}`` over every batch below ``log_start``: the batches retention (or a
chain trim) deleted. It is the one fact about a partition that its segment files cannot give back. The
``recovery-point`` file holds it too (folded into its vector), so this file is the second copy, read only when
the recovery point is unreadable; with both gone and a log that no longer starts at offset 0, the node refuses
the partition rather than forget what it deleted (for its own origin, it would issue those seqs again).

It is written before retention deletes segments (so a crash in between leaves a file whose ``log_start`` is at
or past the first remaining segment, and the vector of the segments still there is read from them again, which
changes nothing: a vector is a per-origin maximum), and when a log is created at an offset above 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from georep.storage.checked_json import DamagedStateFile, dumps_checked, read_checked
from georep.storage.durable_file import replace_file
from offsets.coordinates import InvalidOrigin, LocalOffset, Origin, OriginSeq
from topology.ids import InvalidSiteId

FILE_NAME = "log-start"
FORMAT = 1

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LogStart:
    log_start: LocalOffset
    vector: dict[Origin, OriginSeq]


def read_log_start(directory: Path) -> LogStart | None:
    """The directory's log start; ``None`` if missing or unreadable (logged)."""
    path = directory / FILE_NAME
    try:
        doc = read_checked(path)
        if doc is None:
            return None
        if doc["format"] != FORMAT:
            raise ValueError(f"format {doc['format']!r}, this build reads {FORMAT}")
        start = doc["log_start"]
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"log_start {start!r}")
        vector = {Origin.parse(k): OriginSeq(int(v)) for k, v in doc["vector"].items()}
    except (DamagedStateFile, ValueError, KeyError, TypeError, AttributeError, InvalidOrigin, InvalidSiteId) as exc:
        log.warning("%s is unreadable (%s)", path, exc)
        return None
    return LogStart(LocalOffset(start), vector)


def write_log_start(directory: Path, start: LogStart) -> None:
    doc = {
        "format": FORMAT,
        "log_start": int(start.log_start),
        "vector": {str(origin): int(seq) for origin, seq in sorted(start.vector.items())},
    }
    replace_file(directory / FILE_NAME, dumps_checked(doc))
