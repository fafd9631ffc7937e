"""Topic metadata over a link: which of an upstream's topics to create here, and which conflict. Pure.

Topic definitions travel over the same links as records (ARCHITECTURE.md,
"Topic metadata travels too"). dst lists src's topics now and then and asks
:func:`plan_topic_sync`:

* a topic the link carries and dst lacks is **created** here, with src's
  partition count and configuration (only the known configuration keys);
* a topic both sides have with different partition counts is a
  **conflict**: it is not replicated over this link, and it is reported
  (``SiteStatus.conflicts``, ``georep_topic_conflicts``). Nothing is merged:
  partition counts must match at every site, since a record's partition is
  part of where it lives everywhere;
* a conflict whose counts now agree is **cleared**.

A one-node site keeps each topic as a replicated entry (georep/metadata/topic_entry.py) and merges src's into
its own (``merges``): partition counts then converge to the largest, so unequal counts are no conflict, and
a tombstone (a deleted topic) creates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from georep.metadata.topic_entry import TopicEntry
from georep.metadata.topics import TOPIC_CONFIG_KEYS
from topology.model import Link


@dataclass(frozen=True, slots=True)
class RemoteTopic:
    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)
    entry: TopicEntry | None = None  # what src listed of it (a node from before entries: its definition)


@dataclass(frozen=True, slots=True)
class TopicSyncPlan:
    create: list[RemoteTopic]  # config filtered to the known keys
    conflicts: dict[str, str]  # topic -> what to tell the operator
    cleared: list[str]


def plan_topic_sync(
    link: Link, remote: Sequence[RemoteTopic], local: Mapping[str, int], *, merges: bool = False
) -> TopicSyncPlan:
    """What dst (``link.dst``, holding ``local``: topic -> partitions) does with src's ``remote`` topics;
    ``merges``: dst merges entries (module docstring)."""
    create: list[RemoteTopic] = []
    conflicts: dict[str, str] = {}
    cleared: list[str] = []
    for t in sorted(remote, key=lambda t: t.name):
        if not link.carries(t.name):
            continue
        have = local.get(t.name)
        if t.entry is not None and t.entry.deleted:
            continue
        if have is None:
            config = {k: v for k, v in t.config.items() if k in TOPIC_CONFIG_KEYS}
            create.append(RemoteTopic(t.name, t.partitions, config, t.entry))
        elif have != t.partitions and not merges:
            conflicts[t.name] = (
                f"topic {t.name!r} has {have} partitions at site {link.dst} but {t.partitions} at site {link.src}: it "
                f"is not replicated over the link {link.src} -> {link.dst}. Partition counts must match at every "
                "site; recreate the topic under a new name with one partition count"
            )
        else:
            cleared.append(t.name)
    return TopicSyncPlan(create, conflicts, cleared)
