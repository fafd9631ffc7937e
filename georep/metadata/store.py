"""The site's metadata: which topics exist, and the site's identity.

``MetadataStore`` is the port. Its stores are shells: ``georep/storage/metadata_file.py`` keeps the table of a
one-node site in a JSON file replaced atomically, so a crash leaves the old or the new table, never half of one;
``georep/raft/store.py`` keeps a multi-node site's in its Raft group.

The table also holds the site's ACL records (:class:`AclRecord`: an entry's text, present or removed, and its
stamp), and the users' SCRAM credentials as records of the same kind (a key and a ``data`` field), kept and
replicated as last-writer-wins registers (``georep/auth/acl_sync.py`` says why that
converges); this module stores them without reading the entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from georep.metadata.topic_entry import TopicEntry
from georep.metadata.topics import TopicSpec
from topology.ids import SiteId


class TopicExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"topic {name!r} already exists: describe it with 'georep topic describe {name}'")


class UnknownTopic(Exception):
    def __init__(self, name: str, deleted_at: str = "") -> None:
        """``deleted_at``: the site whose delete this site holds the tombstone of (the message names it)."""
        gone = f"was deleted (at site {deleted_at})" if deleted_at else "does not exist"
        super().__init__(f"topic {name!r} {gone}: create it with 'georep topic create {name} --partitions N'")


class DataDirMismatch(Exception):
    """The data dir belongs to another site."""


@dataclass(frozen=True, slots=True, order=True)
class AclRecord:
    """One ACL entry's state at this site: present or removed (a tombstone), stamped by the site that changed it."""

    entry: str  # "principal operation resource" (georep.auth.acl.AclEntry.key), or a credential's key
    present: bool
    stamp_ms: int
    site: str
    # What the record holds beyond its key: "" for an ACL entry; a SCRAM credential's stored form for a user's
    # credential (georep/auth/credentials.py), which travels and wins exactly as an ACL record does.
    data: str = ""

    @property
    def version(self) -> tuple[int, str, bool, str]:
        """Total order of the records of one entry: the higher one wins (ties: by site, then present, then data)."""
        return (self.stamp_ms, self.site, self.present, self.data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "entry": self.entry,
            "present": self.present,
            "stamp_ms": self.stamp_ms,
            "site": self.site,
        }
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
        if not (
            isinstance(entry, str)
            and isinstance(present, bool)
            and isinstance(stamp, int)
            and not isinstance(stamp, bool)
            and isinstance(site, str)
            and isinstance(data, str)
        ):
            raise ValueError(f"invalid ACL record {raw!r}")
        return cls(entry, present, stamp, site, data)


def acl_newer(record: AclRecord, held: AclRecord | None) -> bool:
    """Whether ``record`` replaces ``held``, the record held for the same entry (if any)."""
    return held is None or record.version > held.version


class MetadataStore(Protocol):
    def topics(self) -> dict[str, TopicSpec]: ...

    def topics_version(self) -> int:
        """Changes whenever :meth:`topics` may answer otherwise (and may change more often): what lets the
        topic sync, ``ListTopics`` and the replicator's tick skip copying and comparing every topic while nothing
        changed. Read it before :meth:`topics`, so a change between the two shows as a new version next time."""
        ...

    def entries(self) -> dict[str, TopicEntry]:
        """Every topic name's replicated entry (georep/metadata/topic_entry.py), tombstones included. A new dict
        after every change, the same one until (its entries the same objects while they do not change)."""
        ...

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


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    site: SiteId
    epoch: int
