"""The Raft journal of a multi-node site's metadata: every log entry, fsynced before anything counts on it.

pysyncobj 0.3.17's ``FileJournal`` writes each entry into an mmap and never fsyncs it, nor its ``.meta`` file (term
and vote included): it survives a crash of the process, not of the machine. :class:`DurableJournal` replaces it.
pysyncobj builds its journal with ``createJournal(conf.journalFile)``; after :func:`install`, a ``journalFile`` that
is a :class:`JournalHandle` gives back the journal it holds (any other value keeps pysyncobj's journals).

**When an entry is durable.** :meth:`DurableJournal.add` keeps an entry in memory and in a write buffer;
:meth:`DurableJournal.sync` writes the buffer and fdatasyncs the file: one fdatasync for every entry added since
the last one (group commit). The Raft port (``georep.raft.transport``) holds every outgoing message but a leader's
appends until a sync, so a follower answers the leader's append only once the entries are on its disk, and a leader
counts itself in a commit only from the tick after its sync. The term and vote are fsynced before
:meth:`setCurrentTerm` returns (Raft needs them durable before a vote leaves). A truncation (a follower's
conflicting suffix) is fdatasynced at once, so that a crash never brings back entries the leader replaced. A
compaction (pysyncobj dropping the entries its dump holds) first fsyncs the directory, where pysyncobj renamed the
dump, then rewrites the file beside it and renames it over. The commit index is written at most once a second: it is
a hint (the entries up to it are applied at a restart without waiting for a leader), not something Raft needs
durable.

**Files**, in the node's Raft directory:

* ``journal.log``: a 16-byte header (``b"GRJOURNL"``, the format version and a zero, u32 each), then one record per
  entry: :data:`RECORD_MAGIC` u32, the payload's length u32, the CRC-32C of length and payload u32, and the payload:
  ``synced_through`` u64 (how much of the file was fdatasynced when the record was written), the entry's index u64
  and term u64, and its command (the bytes pysyncobj gives). Little-endian.
* ``journal.meta``: JSON, ``{"format": "georep-raft-meta", "version": 1, "term": ..., "voted_for": ...,
  "commit_index": ...}``.

**Damage.** At start the records are read in order, their indexes consecutive. A record that does not check ends the
log: the file is cut there, with a warning, if nothing after it says it was synced (a torn write: the tail of a group
that a machine crash cut short; no member counted it, since nothing left before its fdatasync). If a whole record
after it says the file was synced past it, the record was durable and is damaged: the node refuses to start
(:class:`JournalDamaged` says what to do), since a log with a hole could lose entries its group committed.

**Upgrade.** A Raft directory written by an older georep holds pysyncobj's ``journal.bin`` and ``journal.bin.meta``.
They are read once, written as ``journal.meta`` then ``journal.log`` (whose presence marks the upgrade as done) and
removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

import crc32c
import pysyncobj.pickle as syncobj_pickle
import pysyncobj.syncobj as syncobj_module
from pysyncobj.journal import Journal

from georep.storage.durable_file import fsync_directory, replace_file

logger = logging.getLogger(__name__)

JOURNAL_FILE = "journal.log"
META_FILE = "journal.meta"
PYSYNCOBJ_JOURNAL_FILE = "journal.bin"  # what georep's Raft store wrote before this journal
FORMAT_VERSION = 1
HEADER = b"GRJOURNL" + struct.pack("<II", FORMAT_VERSION, 0)
RECORD_MAGIC = 0x314C4E4A  # b"JNL1" read as little-endian
META_FORMAT = "georep-raft-meta"
_RECORD = struct.Struct("<III")  # magic, payload length, CRC-32C of the length and the payload
_PAYLOAD = struct.Struct("<QQQ")  # synced_through, index, term; then the command
_LENGTH = struct.Struct("<I")
_MAGIC = struct.pack("<I", RECORD_MAGIC)
_FILE_MODE = 0o600  # the commands hold ACLs and SCRAM credentials

Entry = tuple[bytes, int, int]  # (command, index, term), as pysyncobj keeps them


class JournalDamaged(Exception):
    """The journal cannot be read as a log; the message names the file and says what to do."""


class JournalFailed(OSError):
    """A write or fsync of the journal failed: nothing this node sends may count on it any more."""


def _record(command: bytes, index: int, term: int, synced_through: int) -> bytes:
    payload = _PAYLOAD.pack(synced_through, index, term) + command
    length = _LENGTH.pack(len(payload))
    crc = crc32c.crc32c(payload, crc32c.crc32c(length))
    return _RECORD.pack(RECORD_MAGIC, len(payload), crc) + payload


def _parse(data: bytes, pos: int) -> tuple[int, int, int, bytes, int] | None:
    """(synced_through, index, term, command, end) of the record at ``pos``, or None if none checks there."""
    if pos + _RECORD.size > len(data):
        return None
    magic, length, crc = _RECORD.unpack_from(data, pos)
    end = pos + _RECORD.size + length
    if magic != RECORD_MAGIC or length < _PAYLOAD.size or end > len(data):
        return None
    payload = memoryview(data)[pos + _RECORD.size : end]
    if crc32c.crc32c(payload, crc32c.crc32c(_LENGTH.pack(length))) != crc:
        return None
    synced_through, index, term = _PAYLOAD.unpack_from(payload)
    return synced_through, index, term, bytes(payload[_PAYLOAD.size :]), end


def _synced_past(data: bytes, pos: int) -> int | None:
    """The offset of a whole record after ``pos`` that says the file was synced past ``pos``, if there is one."""
    at = data.find(_MAGIC, pos + 1)
    while at != -1:
        parsed = _parse(data, at)
        if parsed is not None and parsed[0] > pos:
            return at
        at = data.find(_MAGIC, at + 1)
    return None


def _damaged(path: Path, why: str) -> JournalDamaged:
    return JournalDamaged(
        f"the Raft journal {path} is damaged: {why}. If the other nodes of the site hold the metadata, stop this "
        f"node, move {path.parent} away and start it again: it will copy the metadata from the Raft leader"
    )


class DurableJournal(Journal):  # type: ignore[misc]  # pysyncobj has no type hints
    """pysyncobj's journal interface over ``journal.log`` and ``journal.meta`` in ``directory``; see the module
    docstring. Raises :class:`JournalDamaged` if the files cannot be read as a log."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._path = directory / JOURNAL_FILE
        self._meta_path = directory / META_FILE
        _upgrade_pysyncobj_journal(directory)
        self._meta = _read_meta(self._meta_path)
        self._meta_dirty = False
        self._entries: list[Entry] = []
        self._offsets: list[int] = []  # where each entry's record starts in the file (or in the buffer after it)
        self._buffer = bytearray()  # records added since the last sync, not written yet
        self._written = 0  # the file's length
        self._synced = 0  # how much of it was fdatasynced
        self._failed: JournalFailed | None = None
        self._lock = threading.Lock()  # the tick thread does everything; close() may come from another thread
        self._fd = self._open()

    # -- files ---------------------------------------------------------------------------------------------

    def _open(self) -> int:
        if not self._path.exists():
            replace_file(self._path, HEADER)
        fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.fchmod(fd, _FILE_MODE)
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            self._load(fd, data)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _load(self, fd: int, data: bytes) -> None:
        if not data:  # a crash between the creation and the header's fsync: nothing was ever in it
            os.pwrite(fd, HEADER, 0)
            os.fdatasync(fd)
            data = HEADER
        if data[: len(HEADER)] != HEADER:
            raise _damaged(self._path, f"its header is {data[: len(HEADER)]!r}, expected {HEADER!r}")
        pos = len(HEADER)
        while pos < len(data):
            parsed = _parse(data, pos)
            if parsed is None:
                synced_at = _synced_past(data, pos)
                if synced_at is not None:
                    raise _damaged(
                        self._path,
                        f"the record at byte {pos} does not check, and the record at byte "
                        f"{synced_at} says the file was synced past it",
                    )
                logger.warning(
                    "Raft journal %s: cut %d bytes at byte %d that do not check (a write that a crash "
                    "cut short, never acknowledged)",
                    self._path,
                    len(data) - pos,
                    pos,
                )
                os.ftruncate(fd, pos)
                os.fdatasync(fd)
                break
            _, index, term, command, end = parsed
            if self._entries and index != self._entries[-1][1] + 1:
                raise _damaged(
                    self._path, f"the record at byte {pos} holds entry {index} after entry {self._entries[-1][1]}"
                )
            self._entries.append((command, index, term))
            self._offsets.append(pos)
            pos = end
        self._written = self._synced = pos

    def _end(self) -> int:
        return self._written + len(self._buffer)

    def _fail(self, what: str, error: OSError) -> JournalFailed:
        failed = JournalFailed(error.errno, f"{what} the Raft journal {self._path} failed: {error.strerror or error}")
        if self._failed is None:
            logger.critical(
                "%s. This node stops taking part in its site's metadata (a write it answered for may "
                "not be on disk): check the disk, then restart the node",
                failed,
            )
            self._failed = failed
        return failed

    def sync(self) -> None:
        """Write and fdatasync every entry added since the last sync (nothing to do: no system call). Raises
        :class:`JournalFailed` if that fails, and from then on."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if not self._buffer:
                return
            try:
                view = memoryview(self._buffer)
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], self._written + done)
                view.release()
                self._written += done
                self._buffer.clear()
                os.fdatasync(self._fd)
            except OSError as e:
                raise self._fail("writing", e) from e
            self._synced = self._written

    def _rewrite(self, entries: list[Entry]) -> None:
        """Replace the file with ``entries`` (durable on return)."""
        records = bytearray(HEADER)
        offsets = []
        for command, index, term in entries:
            offsets.append(len(records))
            records += _record(command, index, term, 0)
        replace_file(self._path, bytes(records))
        fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
        os.fchmod(fd, _FILE_MODE)
        os.close(self._fd)
        self._fd = fd
        self._entries, self._offsets = entries, offsets
        self._buffer.clear()
        self._written = self._synced = len(records)

    # -- pysyncobj's Journal ----------------------------------------------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        with self._lock:
            self._offsets.append(self._end())
            self._buffer += _record(bytes(command), idx, term, self._synced)
            self._entries.append((command, idx, term))

    def clear(self) -> None:
        self.deleteEntriesFrom(0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        """Drop the entries from list position ``entryFrom`` on (a follower's suffix that conflicts with the
        leader's log): durable on return, if any of them was written."""
        with self._lock:
            if entryFrom >= len(self._entries):
                return
            cut = self._offsets[entryFrom]
            del self._entries[entryFrom:]
            del self._offsets[entryFrom:]
            if cut >= self._written:
                del self._buffer[cut - self._written :]
                return
            self._buffer.clear()
            try:
                os.ftruncate(self._fd, cut)
                os.fdatasync(self._fd)
            except OSError as e:
                raise self._fail("truncating", e) from e
            self._written = self._synced = cut

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Drop the entries before list position ``entryTo`` (pysyncobj's compaction, once its dump holds them)."""
        with self._lock:
            try:
                fsync_directory(self._directory)  # the dump's rename, before the entries it replaces go
                self._rewrite(self._entries[entryTo:])
            except OSError as e:
                raise self._fail("compacting", e) from e

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        with contextlib.suppress(OSError):
            self.sync()
        with contextlib.suppress(OSError):
            self.onOneSecondTimer()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        if self._meta["commit_index"] != raftCommitIndex:
            self._meta["commit_index"] = raftCommitIndex
            self._meta_dirty = True

    def getRaftCommitIndex(self) -> int:
        return int(self._meta["commit_index"])

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:
        self._meta["term"] = term
        self._meta["voted_for"] = votedForNodeId
        self._store_meta(sync_directory=True)

    def getCurrentTerm(self) -> int:
        return int(self._meta["term"])

    def getVotedForNodeId(self) -> Any:
        return self._meta["voted_for"]

    def onOneSecondTimer(self) -> None:
        if self._meta_dirty:
            self._store_meta(sync_directory=False)  # the commit index is a hint

    def _store_meta(self, sync_directory: bool) -> None:
        try:
            _write_meta(self._meta_path, self._meta, sync_directory)
        except OSError as e:
            raise self._fail("writing the term and vote of", e) from e
        self._meta_dirty = False

    # -- for tests and status ----------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def synced_bytes(self) -> int:
        return self._synced


def _read_meta(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = {"term": 0, "voted_for": None, "commit_index": 1}
    if not path.exists():
        return meta
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != META_FORMAT or doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a {META_FORMAT} file of version {FORMAT_VERSION}")
        term, voted_for, commit_index = doc["term"], doc["voted_for"], doc["commit_index"]
        if not (
            isinstance(term, int)
            and isinstance(commit_index, int)
            and (voted_for is None or isinstance(voted_for, str))
        ):
            raise ValueError(f"term {term!r}, voted_for {voted_for!r}, commit_index {commit_index!r}")
    except (OSError, ValueError, KeyError) as e:
        raise _damaged(path, str(e)) from None
    meta.update(term=term, voted_for=voted_for, commit_index=commit_index)
    return meta


def _write_meta(path: Path, meta: dict[str, Any], sync_directory: bool) -> None:
    doc = {"format": META_FORMAT, "version": FORMAT_VERSION, **meta}
    replace_file(path, json.dumps(doc, sort_keys=True).encode(), sync_directory=sync_directory)
    os.chmod(path, _FILE_MODE)


# -- pysyncobj's journal, from an older georep -----------------------------------------------------------------

_PYSYNCOBJ_FIRST_RECORD = 40  # name (24), version (8), format version (4), the last record's end (4)


def _read_pysyncobj_journal(path: Path) -> list[Entry]:
    data = path.read_bytes()
    if len(data) < _PYSYNCOBJ_FIRST_RECORD:
        return []
    (end,) = struct.unpack_from("<I", data, _PYSYNCOBJ_FIRST_RECORD - 4)
    entries: list[Entry] = []
    pos = _PYSYNCOBJ_FIRST_RECORD
    while pos < min(end, len(data)):
        (size,) = struct.unpack_from("<I", data, pos)
        if size < 16 or pos + 8 + size > len(data):
            raise _damaged(path, f"the record at byte {pos} runs past the file's end")
        index, term = struct.unpack_from("<QQ", data, pos + 4)
        entries.append((data[pos + 20 : pos + 4 + size], index, term))
        pos += size + 8
    return entries


def _upgrade_pysyncobj_journal(directory: Path) -> None:
    old = directory / PYSYNCOBJ_JOURNAL_FILE
    old_meta = directory / (PYSYNCOBJ_JOURNAL_FILE + ".meta")
    if not old.exists() and not old_meta.exists():
        return
    new = directory / JOURNAL_FILE
    if not new.exists():
        meta: Any = {}
        with contextlib.suppress(Exception):  # pysyncobj's own reading: an unreadable meta is an empty one
            meta = syncobj_pickle.loads(old_meta.read_bytes())
        if not isinstance(meta, dict):
            meta = {}
        voted_for = meta.get("votedForNodeId")
        _write_meta(
            directory / META_FILE,
            {
                "term": int(meta.get("currentTerm", 0)),
                "voted_for": None if voted_for is None else str(voted_for),
                "commit_index": int(meta.get("raftCommitIndex", 1)),
            },
            sync_directory=True,
        )
        entries = _read_pysyncobj_journal(old) if old.exists() else []
        records = HEADER + b"".join(_record(bytes(c), i, t, 0) for c, i, t in entries)
        replace_file(new, records)
        os.chmod(new, _FILE_MODE)
        logger.info("Raft journal: %d entries of %s rewritten as %s (fsynced from now on)", len(entries), old, new)
    for leftover in (old, old_meta, directory / (PYSYNCOBJ_JOURNAL_FILE + ".meta.tmp")):
        leftover.unlink(missing_ok=True)
    fsync_directory(directory)


# -- pysyncobj's journal factory ---------------------------------------------------------------------------------


class JournalHandle:
    """``SyncObjConf(journalFile=JournalHandle(journal))``: pysyncobj uses ``journal`` (after :func:`install`)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def __repr__(self) -> str:
        return f"JournalHandle({getattr(self.journal, 'path', self.journal)!r})"


_install_lock = threading.Lock()


def install() -> None:
    """Make pysyncobj's ``createJournal`` give back a :class:`JournalHandle`'s journal. Idempotent; any other
    ``journalFile`` keeps pysyncobj's own journals."""
    with _install_lock:
        original = syncobj_module.createJournal
        if getattr(original, "georep_handles", False):
            return

        def create_journal(journal_file: Any = None) -> Any:
            if isinstance(journal_file, JournalHandle):
                return journal_file.journal
            return original(journal_file)

        create_journal.georep_handles = True  # type: ignore[attr-defined]
        syncobj_module.createJournal = create_journal
