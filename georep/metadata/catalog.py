"""A node's topic catalog: its topic table, listed a page at a time, and what changed since a token. Pure.

``ListTopics`` answers from it, in two orders:

* **by name**, a page at a time (AIP-158): the page token is the last name of the page before, so a page
  never repeats or skips a topic that existed when the listing began, whatever is created meanwhile;
* **in the order the node learnt its topics**, after a *catalog token* (topic sync,
  ``georep/server/replicator.py``): a linked site lists only what changed since its last sync, and nothing at
  all when nothing did, rather than every topic every second.

A catalog token is ``instance:generation:position``: a position in the node's log of changes, in the catalog
``instance`` (one per process, so a restart or another node of the site never takes a token for its own) at
``generation``. Each topic name sits at the position of its entry's last change
(``georep/metadata/topic_entry.py``: a create, an alter, a growth or a delete): a sync lists the names whose last
change is after its token, so an alter or a delete costs one entry, not a relisting of every topic. Older
positions of a changed name are skipped; once they outnumber the names, the log is compacted into a new
generation, and every earlier token then lists the catalog again from its first topic (``restarted``), as it does
when a name disappears from the table (a data dir moved away).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from georep.metadata.topic_entry import TopicEntry

# The log of changes is compacted once it holds this many more positions than names (and twice as many).
COMPACT_SLACK = 1024


@dataclass(frozen=True, slots=True)
class Changes:
    """The entries changed after a token (at most a page of them), and where they leave the caller."""

    topics: list[TopicEntry]  # tombstones included
    token: str  # the catalog token after ``topics``: the next sync asks changes since it
    restarted: bool  # the token was "" or not this catalog's: ``topics`` start from the first topic
    more: bool  # more changes follow ``token``


class TopicCatalog:
    """The topic table of one node, in name order and in order of change; see the module docstring."""

    def __init__(self, instance: str) -> None:
        if ":" in instance:
            raise ValueError(f"a catalog instance id has no ':': {instance!r}")
        self.instance = instance
        self._table: dict[str, TopicEntry] = {}
        self._names: list[str] = []  # the live names, sorted
        self._log: list[str] = []  # one name per change, this generation
        self._at: dict[str, int] = {}  # name -> the position of its last change in _log
        self._generation = 0

    def __len__(self) -> int:
        return len(self._names)

    @property
    def token(self) -> str:
        """The token of the catalog as it is now: changes since it are none."""
        return self._token(len(self._log))

    def refresh(self, table: Mapping[str, TopicEntry]) -> bool:
        """Take the node's entries as they are now; whether they changed. Costs one dict comparison when they did
        not (the stores hand out the same entry objects, which compare by identity first)."""
        if table == self._table:
            return False
        if any(name not in table for name in self._table):  # a name gone: no position says so, start over
            self._table = dict(table)
            self._generation += 1
            self._log = sorted(table)
            self._at = {name: i for i, name in enumerate(self._log)}
        else:
            changed = sorted(name for name, entry in table.items() if self._table.get(name) != entry)
            self._table = dict(table)
            for name in changed:
                self._at[name] = len(self._log)
                self._log.append(name)
            if len(self._log) > 2 * len(self._at) + COMPACT_SLACK:
                self._generation += 1
                self._log = sorted(self._at, key=self._at.__getitem__)
                self._at = {name: i for i, name in enumerate(self._log)}
        self._names = sorted(name for name, entry in table.items() if not entry.deleted)
        return True

    def page_by_name(self, after: str, size: int, prefix: str = "") -> tuple[list[TopicEntry], str]:
        """Up to ``size`` live topics (every one for 0) whose names sort after ``after`` and start with ``prefix``;
        and the last name of the page if more follow, else "". A pattern's listing passes its literal prefix
        (``TopicFilter.prefix``): it reads the names that may match, not every name."""
        names = self._names
        start = max(bisect.bisect_right(names, after) if after else 0, bisect.bisect_left(names, prefix))
        stop = bisect.bisect_right(names, prefix + "\U0010ffff") if prefix else len(names)
        end = stop if size <= 0 else min(start + size, stop)
        page = [self._table[name] for name in names[start:end]]
        return page, (names[end - 1] if end < stop and end > start else "")

    def changes_since(self, token: str, size: int, keep: Callable[[str], bool] | None = None) -> Changes:
        """Up to ``size`` entries (every one for 0) changed after ``token`` ("" or a token of another catalog or
        generation: from the first topic, ``restarted``); with ``keep``, only the names it keeps, and a page counts
        only them (a pattern consumer's first listing of 100,000 topics is one answer, not ten)."""
        position = self._position(token)
        restarted = position is None
        at = 0 if position is None else position
        entries: list[TopicEntry] = []
        while at < len(self._log) and (size <= 0 or len(entries) < size):
            name = self._log[at]
            # else an older change of a name that changed again later, or a name the caller does not want
            if self._at[name] == at and (keep is None or keep(name)):
                entries.append(self._table[name])
            at += 1
        while at < len(self._log) and self._at[self._log[at]] != at:  # older changes only: nothing more to list
            at += 1
        return Changes(entries, self._token(at), restarted, at < len(self._log))

    def _token(self, position: int) -> str:
        return f"{self.instance}:{self._generation}:{position}"

    def _position(self, token: str) -> int | None:
        instance, _, rest = token.partition(":")
        generation, _, position = rest.partition(":")
        if instance != self.instance or generation != str(self._generation) or not position.isdigit():
            return None
        at = int(position)
        return at if at <= len(self._log) else None
