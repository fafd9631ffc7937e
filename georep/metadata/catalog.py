"""A node's topic catalog: its topic table, listed a page at a time, and what changed since a token. Pure.

``ListTopics`` answers from it, in two orders:

* **by name**, a page at a time (AIP-158): the page token is the last name of the page before, so a page
  never repeats or skips a topic that existed when the listing began, whatever is created meanwhile;
* **in the order the node learnt its topics**, after a *catalog token* (topic sync,
  ``georep/server/replicator.py``): a linked site lists only what changed since its last sync, and nothing at
  all when nothing did, rather than every topic every second.

A catalog token is ``instance:generation:position``: ``position`` topics of the node's order of arrival, in
the catalog ``instance`` (one per process, so a restart or another node of the site never takes a token for
its own) at ``generation``. Topic tables only grow today (no delete, no alter), and a table that grew is a
new tail of the order. A table that changed in any other way (a topic gone or redefined) starts a new
generation: every earlier token then lists the catalog again from its first topic (``restarted``), so a
re-created or changed topic reaches every site too.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from georep.metadata.topics import TopicSpec


@dataclass(frozen=True, slots=True)
class Changes:
    """The topics learnt after a token (at most a page of them), and where they leave the caller."""

    topics: list[TopicSpec]
    token: str  # the catalog token after ``topics``: the next sync asks changes since it
    restarted: bool  # the token was "" or not this catalog's: ``topics`` start from the first topic
    more: bool  # more changes follow ``token``


class TopicCatalog:
    """The topic table of one node, in name order and in order of arrival; see the module docstring."""

    def __init__(self, instance: str) -> None:
        if ":" in instance:
            raise ValueError(f"a catalog instance id has no ':': {instance!r}")
        self.instance = instance
        self._table: dict[str, TopicSpec] = {}
        self._names: list[str] = []  # sorted
        self._arrivals: list[str] = []  # in the order learnt, this generation
        self._generation = 0

    def __len__(self) -> int:
        return len(self._table)

    @property
    def token(self) -> str:
        """The token of the catalog as it is now: changes since it are none."""
        return self._token(len(self._arrivals))

    def refresh(self, table: Mapping[str, TopicSpec]) -> bool:
        """Take the node's topic table as it is now; whether it changed. Costs one dict comparison when it did
        not (the stores hand out the same ``TopicSpec`` objects, which compare by identity first)."""
        if table == self._table:
            return False
        grown = all(table.get(name) == spec for name, spec in self._table.items())
        added = sorted(name for name in table if name not in self._table)
        self._table = dict(table)
        if grown:
            self._arrivals.extend(added)
            for name in added:
                bisect.insort(self._names, name)
        else:
            self._generation += 1
            self._names = sorted(table)
            self._arrivals = list(self._names)
        return True

    def page_by_name(self, after: str, size: int) -> tuple[list[TopicSpec], str]:
        """Up to ``size`` topics (every one for 0) whose names sort after ``after``; and the last name of the
        page if more follow, else ""."""
        start = bisect.bisect_right(self._names, after) if after else 0
        end = len(self._names) if size <= 0 else min(start + size, len(self._names))
        page = [self._table[name] for name in self._names[start:end]]
        return page, (self._names[end - 1] if end < len(self._names) and end > start else "")

    def changes_since(self, token: str, size: int) -> Changes:
        """Up to ``size`` topics (every one for 0) learnt after ``token`` ("" or a token of another catalog or
        generation: from the first topic, ``restarted``)."""
        position = self._position(token)
        restarted = position is None
        start = 0 if position is None else position
        end = len(self._arrivals) if size <= 0 else min(start + size, len(self._arrivals))
        topics = [self._table[name] for name in self._arrivals[start:end]]
        return Changes(topics, self._token(end), restarted, end < len(self._arrivals))

    def _token(self, position: int) -> str:
        return f"{self.instance}:{self._generation}:{position}"

    def _position(self, token: str) -> int | None:
        instance, _, rest = token.partition(":")
        generation, _, position = rest.partition(":")
        if instance != self.instance or generation != str(self._generation) or not position.isdigit():
            return None
        at = int(position)
        return at if at <= len(self._arrivals) else None
