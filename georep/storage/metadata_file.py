"""The file-backed metadata of a one-node site: ``topics.json`` (topics, ACLs, SASL users) with its journal
``topics.journal``, and ``site.json`` (the site's identity), behind the ``MetadataStore`` port of
``georep/metadata/store.py``.

Both JSON files are replaced atomically (write, fsync, rename, fsync the directory), with a checksum member
(``georep/storage/checked_json.py``): a changed digit still parses, and these files are not derived from
anything, so damage is refused with what to do rather than believed. Files of format version 1 (before the
checksum) are read as they are; the next write replaces them.

A create or a merge of topics appends the entries it changed to the journal (``georep/storage/table_journal.py``)
instead of rewriting the table: 100,000 topics created a thousand at a time had rewritten 5 billion bytes of table.
ACL and user changes, and a journal grown past the table, write the table whole (a compaction).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from georep.metadata.store import AclRecord, DataDirMismatch, SiteIdentity, TopicExists, UnknownTopic, acl_newer
from georep.metadata.topic_entry import Merged, TopicEntry, create, merge
from georep.metadata.topic_entry_codec import entry_from_dict, entry_to_dict, spec_of
from georep.metadata.topics import TopicSpec
from georep.storage.api import StorageError
from georep.storage.checked_json import DamagedStateFile, dumps_checked, loads_checked
from georep.storage.durable_file import replace_file
from georep.storage.table_journal import JournalDamaged, TableJournal
from topology.ids import InvalidSiteId, site_id

log = logging.getLogger(__name__)


class MetadataFileDamaged(StorageError):
    """``topics.json`` or ``site.json`` does not hold what its checksum vouches for: the node refuses to start."""


def write_json_atomic(path: Path, data: object, *, checked: bool = False) -> None:
    """Write, fsync, rename over, fsync the directory: all or nothing. ``checked``: with a checksum member
    (``georep/storage/checked_json.py``), so that damage is refused rather than believed."""
    tmp = path.with_name(path.name + ".tmp")
    # 0600 whatever the umask (open keeps the mode of the file it truncates): topics.json holds users' SCRAM keys
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
    with open(tmp, "w") as f:
        if checked:
            assert isinstance(data, dict)
            f.write(dumps_checked(data).decode("ascii"))
        else:
            json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FileMetadataStore:
    """``topics.json``: each topic name's :class:`TopicEntry` (tombstones included), the ACLs and SASL users.

    ``site`` and ``clock_ms`` stamp the creates made here (georep/metadata/topic_entry.py)."""

    def __init__(
        self,
        path: Path,
        site: str = "",
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self._path = path
        self._site = site
        self._clock_ms = clock_ms
        self._entries: dict[str, TopicEntry] = {}
        self._topics: dict[str, TopicSpec] = {}  # the live entries' specs: the same objects until they change
        self._acls: dict[str, AclRecord] = {}
        self._topics_version = 0  # one more per change of the topic table (MetadataStore.topics_version)
        self._journal = TableJournal(path)
        self._snapshot_bytes = 0  # the size of the table as last written whole: the journal compacts past it
        if not path.exists():
            return
        try:
            data = path.read_bytes()
            raw = loads_checked(data, unchecked_formats=(1,), format_key="version")
            self._snapshot_bytes = len(data)
            for name, t in raw["topics"].items():
                self._entries[name] = entry_from_dict(name, t)
            for entry in raw.get("acls", ()):  # absent in tables written before ACLs
                record = AclRecord.from_dict(entry)
                self._acls[record.entry] = record
            for change in self._journal.open(int(raw.get("journal", 0))):
                for name, t in change["topics"].items():
                    self._entries[name] = entry_from_dict(name, t)
        except (DamagedStateFile, JournalDamaged, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataFileDamaged(
                f"{path} or its journal is damaged ({exc}): they hold this site's topic definitions, ACLs and SASL "
                "users. Restore them from a backup (topics.json with its topics.*.journal files); or move them away "
                "and start the node: it takes the topics, ACLs and users of its "
                "linked sites back through topic and ACL sync, and serves the partitions on disk again as their "
                "topics come back (a site with no links must create its topics again with the same partitions)"
            ) from None
        self._topics = {name: spec_of(e) for name, e in self._entries.items() if not e.deleted}

    def topics(self) -> dict[str, TopicSpec]:
        return dict(self._topics)

    def topics_version(self) -> int:
        return self._topics_version

    def entries(self) -> dict[str, TopicEntry]:
        """Every name's entry, tombstones included. A new dict after every change, the same one until."""
        return self._entries

    def get(self, name: str) -> TopicSpec:
        try:
            return self._topics[name]
        except KeyError:
            entry = self._entries.get(name)
            raise UnknownTopic(name, entry.stamp.site if entry is not None and entry.deleted else "") from None

    def create_topic(self, spec: TopicSpec) -> None:
        self.create_topics([spec])

    def create_topics(self, specs: list[TopicSpec], received: Mapping[str, TopicEntry] | None = None) -> None:
        """Add every one of ``specs`` with one write of the table, or none of them. Raises ``TopicExists`` (for
        the first name taken, or given twice). A name held as a tombstone is created as its next incarnation.

        ``received``: the entries a topic sync creates topics from. A spec that is such an entry's definition is
        stored as that entry, not as a create of this site's: its settings stay the other site's changes, so the
        next change there is not taken for one made here at the same time (a false conflict)."""
        entries = dict(self._entries)
        now = self._clock_ms()
        for spec in specs:
            held = entries.get(spec.name)
            if spec.name in self._topics or (held is not None and not held.deleted):
                raise TopicExists(spec.name)
            given = (received or {}).get(spec.name)
            if given is not None and not given.deleted and spec_of(given) == spec and merge(held, given).entry == given:
                entries[spec.name] = given
            else:
                entries[spec.name] = create(spec.name, spec.partitions, spec.config, held, now, self._site)
        names = [spec.name for spec in specs]
        self._write(entries, self._acls, names)
        self._set_entries(entries, names)

    def merge_entries(self, received: Sequence[TopicEntry]) -> list[Merged]:
        """Join each of ``received`` into the entry held for its name (``topic_entry.merge``), with one write of
        the table if any changed; what each merge gave, in order. Durable when it returns."""
        entries = dict(self._entries)
        out = []
        for entry in received:
            merged = merge(entries.get(entry.name), entry)
            entries[entry.name] = merged.entry
            out.append(merged)
        changed = [m.entry.name for m in out if m.changed]
        if changed:
            self._write(entries, self._acls, changed)
            self._set_entries(entries, changed)
        return out

    def _set_entries(self, entries: dict[str, TopicEntry], names: list[str]) -> None:
        topics = dict(self._topics)
        for name in names:
            entry = entries[name]
            if entry.deleted:
                topics.pop(name, None)
            else:
                topics[name] = spec_of(entry)
        self._entries, self._topics = entries, topics
        self._topics_version += 1

    def acls(self) -> dict[str, AclRecord]:
        return self._acls

    def put_acl(self, record: AclRecord) -> bool:
        if not acl_newer(record, self._acls.get(record.entry)):
            return False
        acls = {**self._acls, record.entry: record}
        self._write(self._entries, acls, None)
        self._acls = acls
        return True

    def _write(self, entries: dict[str, TopicEntry], acls: dict[str, AclRecord], changed: list[str] | None) -> None:
        """Make ``entries`` and ``acls`` durable: the entries ``changed`` appended to the journal, or (``changed``
        None: the ACLs changed; or the journal outgrew the table) the table written whole."""
        if changed is not None and not self._journal.wants_compaction(self._snapshot_bytes):
            self._journal.append({"topics": {name: entry_to_dict(entries[name]) for name in changed}})
            return
        # Each entry keeps today's "partitions" and "config" beside its own fields (a tombstone's are 0 and {}).
        generation = self._journal.begin()
        table = {name: entry_to_dict(e) for name, e in entries.items()}
        out: dict[str, Any] = {"version": 2, "topics": table, "journal": generation}  # 2: with a checksum
        if acls:
            out["acls"] = [acls[k].to_dict() for k in sorted(acls)]
        data = dumps_checked(out)
        replace_file(self._path, data)
        self._snapshot_bytes = len(data)
        self._journal.retire_older(generation)


def load_or_create_identity(data_dir: Path, site: str, now_s: int) -> SiteIdentity:
    """The site's epoch is fixed when its data dir is created (docs/design.md, Identity)."""
    path = data_dir / "site.json"
    if path.exists():
        try:
            raw = loads_checked(path.read_bytes(), unchecked_formats=(1,), format_key="version")
            site_id(raw["site"])
            int(raw["epoch"])
        except (DamagedStateFile, ValueError, KeyError, TypeError, InvalidSiteId) as exc:
            raise MetadataFileDamaged(
                f"{path} is damaged ({exc}): it holds this site's epoch. Restore it from a backup; or move it away "
                "and start the node: the site starts under a new epoch, which never reuses a coordinate, and the "
                "records of the old epoch stay and keep replicating"
            ) from None
        if raw["site"] != site:
            raise DataDirMismatch(
                f"data dir {data_dir} belongs to site {raw['site']!r}, not {site!r}: "
                "pass the right --site or another --data-dir"
            )
        return SiteIdentity(site_id(raw["site"]), int(raw["epoch"]))
    identity = SiteIdentity(site_id(site), now_s)
    if any((data_dir / "logs").glob("*")):
        log.warning(
            "data dir %s holds partition logs but no site.json: site %s starts under a new epoch %d (no "
            "coordinate of an earlier epoch is reused; its records stay and keep replicating)",
            data_dir,
            site,
            now_s,
        )
    write_json_atomic(path, {"version": 2, "site": identity.site, "epoch": identity.epoch}, checked=True)
    return identity
