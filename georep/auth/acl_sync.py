"""ACL entries as replicated records: how an add or a remove at one site reaches every site, in any order. Pure.

A site's ACL table maps each entry's canonical text (:meth:`~georep.auth.acl.AclEntry.key`) to an
:class:`AclRecord`: present or removed (a tombstone), stamped ``(stamp_ms, site)`` by the site where the operator
changed it. A record replaces the one held for its entry only if its :func:`version` is higher
(:func:`newer`): a last-writer-wins register per entry.

**Why it converges.** ``version`` is a total order (ties in ``stamp_ms`` broken by the site, then by present
over removed), and keeping the higher of two versions is commutative, associative and idempotent: a max. So
any two sites that have received the same records, in whatever order, over whatever links, any number of
times, hold the same table: nothing to coordinate, and a link that was down merely delivers late. This is why
ACLs travel over every link whatever its topic filters (they are the site's policy, not a topic's data): every
site linked to the one where an ACL changed, directly or through others, ends up with the change.

**Why a remove wins over the add it removes.** The site that changes an entry stamps it with
``max(now_ms, held.stamp_ms + 1)`` (:func:`change`): strictly above the record it holds, whatever its clock says
about the other site's. An operator removes an entry they can list, so the tombstone beats the add it saw;
only a concurrent add elsewhere, unseen yet, can win over it (by its later stamp), which is the usual
last-writer-wins behaviour and the one thing to know: change an entry at one site at a time.

**The same table carries users' SCRAM credentials** (``georep/auth/credentials.py``): a record keyed
``credential <mechanism> <user>`` whose ``data`` is the credential. They merge by the same rule over the same
``ListAcls`` path, so a user added at one site authenticates at every site linked to it.

Tombstones are kept (a few bytes each); without them a site that has not seen the remove would send the add
back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from georep.auth.acl import AclEntry, parse_acl_entry
from georep.metadata.store import AclRecord, acl_newer

__all__ = ["AclCache", "AclRecord", "change", "effective", "is_acl", "merge", "newer", "parsed", "stamp_above"]


def parsed(record: AclRecord) -> AclEntry:
    return parse_acl_entry(record.entry)


def newer(record: AclRecord, held: AclRecord | None) -> bool:
    """Whether ``record`` replaces ``held`` (the one held for the same entry, if any): the higher version."""
    return acl_newer(record, held)


def stamp_above(held: AclRecord | None, now_ms: int) -> int:
    """The stamp of an operator's change of the record held: ``now_ms``, or above ``held``'s if the clock is not."""
    return now_ms if held is None else max(now_ms, held.stamp_ms + 1)


def change(entry: AclEntry, present: bool, held: AclRecord | None, now_ms: int, site: str) -> AclRecord:
    """The record an operator's add (``present``) or remove makes at ``site``: stamped above ``held``."""
    return AclRecord(entry.key(), present, stamp_above(held, now_ms), site)


def merge(held: Mapping[str, AclRecord], received: Iterable[AclRecord]) -> list[AclRecord]:
    """The received records that replace what is held (at most one per entry: the highest), by entry."""
    best: dict[str, AclRecord] = {}
    for record in received:
        current = best.get(record.entry, held.get(record.entry))
        if newer(record, current):
            best[record.entry] = record
    return [best[k] for k in sorted(best)]


def is_acl(key: str) -> bool:
    """Whether a table key is an ACL entry's; the table also holds users' SCRAM credentials
    (``georep/auth/credentials.py``), whose keys start with a word, not a principal ``kind:name``."""
    return ":" in key.split(" ", 1)[0]


def effective(table: Mapping[str, AclRecord]) -> list[AclEntry]:
    """The entries in force: the present ones, by their text."""
    return [parsed(table[k]) for k in sorted(table) if table[k].present and is_acl(k)]


class AclCache:
    """The entries in force of a store's table, parsed once per change of the table (the stores hand out a new
    dict on every change and the same one until): authorization reads them on every call."""

    def __init__(self, table: Callable[[], Mapping[str, AclRecord]]) -> None:
        self._table = table
        self._seen: Mapping[str, AclRecord] | None = None
        self._entries: list[AclEntry] = []

    def __call__(self) -> list[AclEntry]:
        table = self._table()
        if table is not self._seen:
            self._entries = effective(table)
            self._seen = table
        return self._entries
