"""Committed consumer positions: the record format and the latest-wins table.

A commit says: group ``g`` has consumed ``topic/partition`` up to vector
``v``. It is stored as one record of the internal topic ``__georep_offsets``,
which replicates between sites like any other topic, so every site ends up
holding every commit. Each site folds the commits it holds into a
:class:`CommitTable`, where, for one ``(group, topic, partition)``, the commit
with the largest ``(hlc, committed_by)`` wins (and, should a site ever issue
one stamp twice, the larger record value), whatever order the commits arrived
in. A consumer passes the stamp of its previous commit along with the next
one, so its own commits are stamped in increasing order at any site and a
late arrival of an older one never moves its position backwards.

The record's key is ``group NUL topic NUL partition`` (UTF-8); its value is a
compact JSON object, so ``georep consume __georep_offsets --json`` is
readable::

    {"g": group, "t": topic, "p": partition, "v": "a@1:10,b@3:7",
     "h": hlc stamp, "by": "a@1700000000", "ho": hint local offset or -1,
     "m": member id, "gen": generation, "at": wall ms, "md": metadata, "i": incarnation}

``i`` is the incarnation of the topic the position is in (the deletes of its name it had outlived,
georep/metadata/topic_entry.py), absent when 0 (every record from before incarnations). A commit of a later
incarnation wins over any of an earlier one whatever their stamps, and a reader takes only a commit of the
topic's live incarnation: a topic created again after a delete has no committed position, even where a late
commit of the deleted incarnation arrives after the re-create.

``ho`` is the committing consumer's local offset at the committing site
(``by``): a consumer resuming at that same site and epoch can start its fetch
there instead of searching the origin index.

**Deletes** (Kafka's DeleteGroups and OffsetDelete, ``georep group delete``) are
commit records too, with ``"del": 1`` and an empty vector: a tombstone that wins
by ``(hlc, by)`` like any commit, so it replicates with the commits and a stale
commit from another site, stamped before it, cannot bring the position back.
The table keeps the tombstone as the winner and hides it from every read; a
later commit (a larger stamp) replaces it, as a commit after a delete does in
Kafka.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from offsets.coordinates import Origin
from offsets.hlc import HlcStamp
from offsets.vector import VectorOffset

OFFSETS_TOPIC = "__georep_offsets"
OFFSETS_PARTITIONS = 8
GROUP_NAME_MAX_CHARS = 249
METADATA_MAX_CHARS = 4096


class InvalidCommit(ValueError):
    """A commit or a commit record that cannot be used; the message says why."""


def validate_group(group: str) -> str:
    if not group:
        raise InvalidCommit("group id is empty: give the consumer a group id, for example 'billing'")
    if len(group) > GROUP_NAME_MAX_CHARS:
        raise InvalidCommit(f"group id is {len(group)} characters long; the limit is {GROUP_NAME_MAX_CHARS}")
    if "\x00" in group or not group.isprintable():
        raise InvalidCommit(f"group id {group!r} holds control characters: use printable characters only")
    return group


def offsets_partition(group: str, partitions: int = OFFSETS_PARTITIONS) -> int:
    """The internal partition holding ``group``'s commits: all of a group's
    commits share one partition, so a commit of several partitions is one batch."""
    return zlib.crc32(group.encode()) % partitions


@dataclass(frozen=True, slots=True)
class Commit:
    group: str
    topic: str
    partition: int
    vector: VectorOffset
    hlc: HlcStamp
    committed_by: Origin
    hint_offset: int = -1
    member_id: str = ""
    generation: int = -1
    committed_at_ms: int = 0
    metadata: str = ""
    incarnation: int = 0
    deleted: bool = False  # a tombstone: the group's position here is gone

    @property
    def order(self) -> tuple[int, str]:
        """Latest wins: by HLC stamp, then by committing site, so every site picks the same one."""
        return self.hlc, str(self.committed_by)

    def key(self) -> bytes:
        return f"{self.group}\x00{self.topic}\x00{self.partition}".encode()

    def value(self) -> bytes:
        doc = {
            "g": self.group,
            "t": self.topic,
            "p": self.partition,
            "v": self.vector.to_text(),
            "h": self.hlc,
            "by": str(self.committed_by),
            "ho": self.hint_offset,
            "m": self.member_id,
            "gen": self.generation,
            "at": self.committed_at_ms,
            "md": self.metadata,
        }
        if self.incarnation:
            doc["i"] = self.incarnation
        if self.deleted:
            doc["del"] = 1
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def decode(cls, value: bytes) -> Commit:
        try:
            doc = json.loads(value)
            return cls(
                group=str(doc["g"]),
                topic=str(doc["t"]),
                partition=int(doc["p"]),
                vector=VectorOffset.parse(str(doc["v"])),
                hlc=HlcStamp(int(doc["h"])),
                committed_by=Origin.parse(str(doc["by"])),
                hint_offset=int(doc.get("ho", -1)),
                member_id=str(doc.get("m", "")),
                generation=int(doc.get("gen", -1)),
                committed_at_ms=int(doc.get("at", 0)),
                metadata=str(doc.get("md", "")),
                incarnation=int(doc.get("i", 0)),
                deleted=bool(doc.get("del", 0)),
            )
        # OverflowError: int() of a JSON 1e400 or Infinity; RecursionError: deeply nested JSON.
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise InvalidCommit(f"not a commit record: {type(exc).__name__}: {exc}") from None


GroupPartition = tuple[str, str, int]  # (group, topic, partition)


@dataclass
class CommitTable:
    """The winning commit per ``(group, topic, partition)``."""

    latest: dict[GroupPartition, Commit] = field(default_factory=dict)

    def apply(self, commit: Commit) -> bool:
        """Fold one commit in; True if it is now the winner."""
        key = (commit.group, commit.topic, commit.partition)
        current = self.latest.get(key)
        if current is not None:
            # A later incarnation of the topic wins whatever the stamps (module docstring).
            current_order, order = (current.incarnation, *current.order), (commit.incarnation, *commit.order)
            if current_order > order:
                return False
            # Equal orders: a site whose clock state was lost in a restart while its wall clock stood
            # still or stepped back can issue one stamp twice. Without this tie-break, the winner would
            # be whichever arrived first, and sites would disagree forever. (Mostly, though, it is the same
            # commit again, as when a site folds one it recorded: equal, so no need to encode both.)
            if current_order == order and (current == commit or current.value() >= commit.value()):
                return False
        self.latest[key] = commit
        return True

    def get(self, group: str, topic: str, partition: int) -> Commit | None:
        """The winning commit, or None if there is none or a delete won."""
        c = self.latest.get((group, topic, partition))
        return None if c is None or c.deleted else c

    def groups(self) -> list[str]:
        return sorted({g for (g, _, _), c in self.latest.items() if not c.deleted})

    def of_group(self, group: str) -> Iterator[Commit]:
        for key in sorted(k for k in self.latest if k[0] == group):
            if not self.latest[key].deleted:
                yield self.latest[key]
