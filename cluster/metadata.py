"""The site's metadata: which topics exist, and the site's identity.

``MetadataStore`` is the port. ``FileMetadataStore`` keeps the table of one
node in a JSON file replaced atomically, so a crash leaves the old or the new
table, never half of one. The Raft-backed store for multi-node sites sits
behind the same protocol.

The table also holds the site's ACL records (:class:`AclRecord`: an entry's text, present or removed, and its
stamp), and the users' SCRAM credentials as records of the same kind (a key and a ``data`` field), kept and
replicated as last-writer-wins registers (``georep/security/acl_sync.py`` says why that
converges); this module stores them without reading the entries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cluster.topics import TopicSpec
from georep.storage.api import StorageError
from georep.storage.checked_json import DamagedStateFile, dumps_checked, loads_checked
from topology.ids import InvalidSiteId, SiteId, site_id


class TopicExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"topic {name!r} already exists: describe it with 'georep topic describe {name}'")


class UnknownTopic(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"topic {name!r} does not exist: create it with 'georep topic create {name} --partitions N'")


class DataDirMismatch(Exception):
    """The data dir belongs to another site."""


@dataclass(frozen=True, slots=True, order=True)
class AclRecord:
    """One ACL entry's state at this site: present or removed (a tombstone), stamped by the site that changed it."""

    entry: str  # "principal operation resource" (georep.security.acl.AclEntry.key), or a credential's key
    present: bool
    stamp_ms: int
    site: str
    # What the record holds beyond its key: "" for an ACL entry; a SCRAM credential's stored form for a user's
    # credential (georep/security/credentials.py), which travels and wins exactly as an ACL record does.
    data: str = ""

    @property
    def version(self) -> tuple[int, str, bool, str]:
        """Total order of the records of one entry: the higher one wins (ties: by site, then present, then data)."""
        return (self.stamp_ms, self.site, self.present, self.data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"entry": self.entry, "present": self.present, "stamp_ms": self.stamp_ms,
                               "site": self.site}
        if self.data:  # only then, so ACL-only tables and snapshots read as before
            out["data"] = self.data
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> AclRecord:
        try:
            entry, present, stamp, site = raw["entry"], raw["present"], raw["stamp_ms"], raw["site"]
            data = raw.get("data", "")
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"invalid ACL record {raw!r}: it needs entry, present, stamp_ms and site") from None
        if not (isinstance(entry, str) and isinstance(present, bool) and isinstance(stamp, int)
                and not isinstance(stamp, bool) and isinstance(site, str) and isinstance(data, str)):  # fmt: skip
            raise ValueError(f"invalid ACL record {raw!r}")
        return cls(entry, present, stamp, site, data)


def acl_newer(record: AclRecord, held: AclRecord | None) -> bool:
    """Whether ``record`` replaces ``held``, the record held for the same entry (if any)."""
    return held is None or record.version > held.version


class MetadataStore(Protocol):
    def topics(self) -> dict[str, TopicSpec]: ...

    def get(self, name: str) -> TopicSpec:
        """Raises ``UnknownTopic``."""
        ...

    def create_topic(self, spec: TopicSpec) -> None:
        """Raises ``TopicExists``. Durable when it returns."""
        ...

    def acls(self) -> dict[str, AclRecord]:
        """Entry text -> its record, tombstones included. A new dict after every change, the same one until."""
        ...

    def put_acl(self, record: AclRecord) -> bool:
        """Keep ``record`` if it is newer than the one held (:func:`acl_newer`); whether it was. Durable when it
        returns."""
        ...


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
    def __init__(self, path: Path) -> None:
        self._path = path
        self._topics: dict[str, TopicSpec] = {}
        self._acls: dict[str, AclRecord] = {}
        if not path.exists():
            return
        try:
            raw = loads_checked(path.read_bytes(), unchecked_formats=(1,), format_key="version")
            for name, t in raw["topics"].items():
                self._topics[name] = TopicSpec(name, int(t["partitions"]), {k: int(v) for k, v in t["config"].items()})
            for entry in raw.get("acls", ()):  # absent in tables written before ACLs
                record = AclRecord.from_dict(entry)
                self._acls[record.entry] = record
        except (DamagedStateFile, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataFileDamaged(
                f"{path} is damaged ({exc}): it holds this site's topic definitions, ACLs and SASL users. Restore "
                "it from a backup; or move it away and start the node: it takes the topics, ACLs and users of its "
                "linked sites back through topic and ACL sync, and serves the partitions on disk again as their "
                "topics come back (a site with no links must create its topics again with the same partitions)"
            ) from None

    def topics(self) -> dict[str, TopicSpec]:
        return dict(self._topics)

    def get(self, name: str) -> TopicSpec:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(name) from None

    def create_topic(self, spec: TopicSpec) -> None:
        if spec.name in self._topics:
            raise TopicExists(spec.name)
        topics = {**self._topics, spec.name: spec}
        self._write(topics, self._acls)
        self._topics = topics

    def acls(self) -> dict[str, AclRecord]:
        return self._acls

    def put_acl(self, record: AclRecord) -> bool:
        if not acl_newer(record, self._acls.get(record.entry)):
            return False
        acls = {**self._acls, record.entry: record}
        self._write(self._topics, acls)
        self._acls = acls
        return True

    def _write(self, topics: dict[str, TopicSpec], acls: dict[str, AclRecord]) -> None:
        table = {t.name: {"partitions": t.partitions, "config": t.config} for t in topics.values()}
        out: dict[str, Any] = {"version": 2, "topics": table}  # 2: with a checksum
        if acls:
            out["acls"] = [acls[k].to_dict() for k in sorted(acls)]
        write_json_atomic(self._path, out, checked=True)


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    site: SiteId
    epoch: int


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
    write_json_atomic(path, {"version": 2, "site": identity.site, "epoch": identity.epoch}, checked=True)
    return identity
