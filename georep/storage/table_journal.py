"""An append-only journal beside a JSON table, so that changing a few rows of a large table writes a few rows.

A one-node site's topic table (``topics.json``) was rewritten whole, and fsynced, for every create and every merge:
n topics created in batches of k wrote n²/2k rows. With 100,000 topics created on first use (issue 25) that is
gigabytes. The journal is the table's write-ahead log, as Kafka's metadata log sits beside its snapshots:

- ``topics.json`` is the snapshot. Its ``"journal"`` member names the generation G of the journal that continues
  it, the file ``topics.G.journal``.
- A journal holds lines ``<crc32c, 8 hex digits> <JSON object>\n``. The first line is the header,
  ``{"generation": G}``; each next line is one change: the rows it sets.
- Loading reads the snapshot, then applies each change of its journal, in order.
- A change is durable when its line is written and fdatasynced; only then is it acknowledged.
- Compaction writes an empty journal G+1, then the whole table as the snapshot of G+1 (each atomically: temp file,
  fsync, rename), then removes the older journals. A crash before the snapshot's rename leaves the snapshot of G,
  whose journal G is still there; after it, the snapshot of G+1 and its (empty) journal. So a snapshot's journal
  always exists, and a missing one is damage. The table compacts when its journal outgrows it, so each row is
  rewritten a bounded number of times (amortised O(1) per change).

Damage:
- The last line torn (no newline, or a checksum that fails on the last line only) is a write that never finished,
  so it was never acknowledged. It is cut off, with a warning.
- Anything else that does not match its checksum, or a missing journal, is damage to acknowledged data. It is
  refused (:class:`JournalDamaged`), as the snapshot's own damage is: the file is not derived from anything else on
  this node.
- A write that fails (a full disk) leaves the journal where it was: the half-written line is cut off, and the next
  change compacts instead of appending after a line that may be partial.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from georep.storage.durable_file import replace_file

log = logging.getLogger(__name__)

MIN_COMPACT_BYTES = 1 << 20  # a journal this small never compacts, whatever the snapshot's size


class JournalDamaged(ValueError):
    """A line before the journal's last does not hold what its checksum vouches for."""


def encode_line(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")
    return b"%08x %s\n" % (crc32c.crc32c(body), body)


def _decode_line(line: bytes) -> dict[str, Any] | None:
    """The object on ``line`` (without its newline), or None when the line is not what its checksum says."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != crc32c.crc32c(body):
            return None
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class Replayed:
    changes: list[dict[str, Any]]  # each change's object, in order
    end: int  # the byte length of the header and the good changes: what follows is a torn tail


def read_journal(path: Path, generation: int) -> Replayed:
    """The changes of ``path``, the journal of ``generation``. Raises :class:`JournalDamaged`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise JournalDamaged(f"{path} is missing: the table names it as its journal") from None
    lines = data.split(b"\n")  # the last element is what follows the last newline: b"" or a torn line
    header = _decode_line(lines[0]) if len(lines) > 1 else None
    if header is None or header.get("generation") != generation:
        raise JournalDamaged(f"the header of {path} is not generation {generation}'s")
    changes: list[dict[str, Any]] = []
    end = len(lines[0]) + 1
    complete = lines[1:-1]
    for i, line in enumerate(complete):
        doc = _decode_line(line)
        if doc is None:
            if i < len(complete) - 1:
                raise JournalDamaged(f"line {i + 2} of {path} does not match its checksum, and lines follow it")
            break  # the last line: a write that never finished
        changes.append(doc)
        end += len(line) + 1
    return Replayed(changes, end)


class TableJournal:
    """The journals of the table ``<stem>.json``: :meth:`append` a change durably; :meth:`begin` and
    :meth:`retire_older` around a compaction."""

    def __init__(self, table: Path) -> None:
        self.table = table
        self.generation = 0  # of the journal appended to; 0: none, and the next change compacts
        self.size = 0

    def path(self, generation: int) -> Path:
        return self.table.with_name(f"{self.table.stem}.{generation}.journal")

    def open(self, snapshot_generation: int) -> list[dict[str, Any]]:
        """The changes that continue the snapshot of ``snapshot_generation`` (0: a table written before journals,
        with none), in order; a torn tail is cut off."""
        if not snapshot_generation:
            return []
        path = self.path(snapshot_generation)
        replayed = read_journal(path, snapshot_generation)
        size = path.stat().st_size
        if replayed.end < size:
            log.warning("%s: cutting off a torn last change (%d bytes, never acknowledged)", path, size - replayed.end)
            os.truncate(path, replayed.end)
        self.generation, self.size = snapshot_generation, replayed.end
        return replayed.changes

    def wants_compaction(self, snapshot_bytes: int) -> bool:
        return self.generation == 0 or self.size > max(MIN_COMPACT_BYTES, snapshot_bytes)

    def append(self, change: dict[str, Any]) -> None:
        """Write ``change`` and fdatasync it. On failure the journal is cut back to where it was and the next
        change compacts."""
        line = encode_line(change)
        fd = os.open(self.path(self.generation), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            try:
                view, done = memoryview(line), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                os.fdatasync(fd)
            except OSError:
                self.generation = 0
                with contextlib.suppress(OSError):  # else the next load cuts the torn tail
                    os.ftruncate(fd, self.size)
                raise
        finally:
            os.close(fd)
        self.size += len(line)

    def begin(self) -> int:
        """A new empty journal, of a generation above every journal on disk; the caller then writes the
        snapshot that names it, then calls :meth:`retire_older`."""
        on_disk = [self._generation_of(p) for p in self.table.parent.glob(f"{self.table.stem}.*.journal")]
        generation = max([self.generation, *(g for g in on_disk if g is not None)]) + 1
        self.generation = 0  # until the snapshot names the new one
        replace_file(self.path(generation), encode_line({"generation": generation}))
        return generation

    def retire_older(self, generation: int) -> None:
        """The snapshot of ``generation`` is durable: append to its journal, and remove the others."""
        self.generation, self.size = generation, len(encode_line({"generation": generation}))
        for path in self.table.parent.glob(f"{self.table.stem}.*.journal"):
            if self._generation_of(path) != generation:
                with contextlib.suppress(OSError):  # a leftover is removed at the next compaction
                    path.unlink()

    def _generation_of(self, path: Path) -> int | None:
        middle = path.name[len(self.table.stem) + 1 : -len(".journal")]
        return int(middle) if middle.isdigit() else None
