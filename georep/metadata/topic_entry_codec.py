"""A :class:`~georep.metadata.topic_entry.TopicEntry` as JSON (``topics.json``, a Raft command) and from an old
peer or an old table, which knows only a name, a partition count and a config. Pure.

A stored or listed topic without the entry's fields is incarnation 0, live, with no stamps: its settings carry
:data:`NO_STAMP` and an empty version vector, so any change made since (stamped by a clock) wins over them, and
two such settings of one key merge by value, the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from georep.metadata.topic_entry import Setting, Stamp, TopicEntry
from georep.metadata.topics import TopicSpec

NO_STAMP = Stamp(0, "")


def legacy_entry(name: str, partitions: int, config: Mapping[str, int]) -> TopicEntry:
    """The entry of a topic known only by its definition (a table or a peer from before entries)."""
    settings = tuple(sorted((k, Setting(v, NO_STAMP, ())) for k, v in config.items()))
    return TopicEntry(name, 0, False, partitions, settings, NO_STAMP)


def spec_of(entry: TopicEntry) -> TopicSpec:
    """The live topic an entry defines (never called on a tombstone)."""
    return TopicSpec(entry.name, entry.partitions, entry.config(), entry.incarnation)


def entry_to_dict(entry: TopicEntry) -> dict[str, Any]:
    """The entry's fields beside today's ``partitions`` and ``config``, so an older reader still finds those."""
    return {
        "partitions": entry.partitions,
        "config": entry.config(),
        "incarnation": entry.incarnation,
        "deleted": entry.deleted,
        "stamp": [entry.stamp.ms, entry.stamp.site],
        "settings": {
            key: {"value": s.value, "stamp": [s.stamp.ms, s.stamp.site], "seen": [list(v) for v in s.seen]}
            for key, s in entry.settings
        },
    }


def _stamp(raw: Any) -> Stamp:
    ms, site = raw
    if not isinstance(ms, int) or isinstance(ms, bool) or not isinstance(site, str):
        raise ValueError(f"invalid stamp {raw!r}")
    return Stamp(ms, site)


def _setting(raw: Any) -> Setting:
    value = raw["value"]
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"invalid setting value {value!r}")
    seen = tuple(sorted((str(site), int(n)) for site, n in raw["seen"]))
    return Setting(value, _stamp(raw["stamp"]), seen)


def entry_from_dict(name: str, raw: Mapping[str, Any]) -> TopicEntry:
    """Raises ``ValueError``, ``KeyError`` or ``TypeError`` on a damaged entry."""
    if "incarnation" not in raw:  # a table written before entries
        return legacy_entry(name, int(raw["partitions"]), {k: int(v) for k, v in raw["config"].items()})
    settings = tuple(sorted((str(k), _setting(v)) for k, v in raw["settings"].items()))
    deleted = raw["deleted"]
    if not isinstance(deleted, bool):
        raise ValueError(f"invalid deleted flag {deleted!r}")
    return TopicEntry(name, int(raw["incarnation"]), deleted, int(raw["partitions"]), settings, _stamp(raw["stamp"]))
