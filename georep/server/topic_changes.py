"""A topic's alter, growth and the topic sync's merges, carried out on a one-node site's node.

Every change of a topic is a merge of a :class:`~georep.metadata.topic_entry.TopicEntry` into the entry held
(georep/metadata/topic_entry.py): an alter or an add-partitions here makes an entry above the one held, and a
topic sync hands in an upstream's. :meth:`TopicChanges.merge` then does what the merged entry says, in this order:

1. the logs of partitions the merge adds are made and opened (files first: a crash leaves empty partition
   directories beyond the table's count, which the next growth opens again as they are);
2. the table is written (``FileMetadataStore.merge_entries``: durable when it returns);
3. the new partitions are served, and the open ones take the new config: retention, segment size and age,
   max batch size and the timestamp bounds apply from the next append or retention run, with no restart.
   ``flush_interval_ms`` is stored at once but an open partition keeps the fsync policy it was opened with
   until the node restarts: the ack table releases acks by that policy, and changing it under waiting acks
   could hold them for good.

Concurrent changes of one key that a merge finds (:class:`~georep.metadata.topic_entry.ConfigConflict`) are
kept for ``georep status`` and counted (``georep_topic_config_conflicts_total``). A merge that deletes a live
topic calls :attr:`TopicChanges.on_deleted` (the data path's removal of its partitions).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from cluster.site_state import RefusalCode
from georep.broker.errors import NotYetSupported
from georep.metadata.kafka_config import check_quorum
from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry import ConfigConflict, Merged, TopicEntry, add_partitions, alter, delete, merge
from georep.metadata.topic_entry_codec import spec_of
from georep.metadata.topics import InvalidTopic, TopicSpec
from georep.raft.store import CommandRefused, RaftMetadataStore
from georep.server.broker import Broker
from georep.storage.api import LogConfig, PartitionLog

log = logging.getLogger(__name__)

CONFLICTS_KEPT = 100  # the latest conflicts status shows; the counter counts them all


@runtime_checkable
class EntryStore(Protocol):
    """A one-node site's metadata as :meth:`TopicChanges.merge` writes it (``FileMetadataStore``)."""

    def entries(self) -> dict[str, TopicEntry]: ...

    def merge_entries(self, received: Sequence[TopicEntry]) -> list[Merged]: ...


class TopicChangesUnsupported(NotYetSupported):
    """A topic change this node cannot make (a metadata store that keeps no entries)."""

    kafka_code = 42  # Kafka's INVALID_REQUEST, with the message


class TopicChanges:
    """The node's topic changes; see the module docstring."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.conflicts: deque[ConfigConflict] = deque(maxlen=CONFLICTS_KEPT)
        self.conflicts_total = 0
        # Delete's data path: told the tombstone of a topic this site held live, after the table holds it.
        self.on_deleted: Callable[[TopicEntry], None] = self._deleted_unhandled
        self._configs: dict[str, dict[str, int]] = {}  # a multi-node site's configs as ``follow`` last saw them

    def _store(self) -> EntryStore:
        store = self.broker.metadata
        if not isinstance(store, EntryStore):
            raise TopicChangesUnsupported("this node's metadata keeps no topic entries: it cannot change a topic")
        return store

    def held(self, name: str) -> TopicEntry | None:
        """The entry held for ``name``: live, a tombstone (``deleted``), or None (never heard of)."""
        return self.broker.metadata.entries().get(name)

    def incarnation_of(self, name: str) -> int | None:
        """The incarnation of ``name`` live here, or None (unknown, or deleted): what delete's data path checks a
        pulled chunk or a commit record against (docs/design.md, "Topic changes across sites")."""
        entry = self.broker.metadata.entries().get(name)
        return None if entry is None or entry.deleted else entry.incarnation

    async def alter(self, name: str, changes: Mapping[str, int | None]) -> TopicSpec:
        """Set (or, ``None``, reset to the default) each key of ``changes``. Raises what :meth:`altered` raises."""
        await self.change([self.altered(name, changes, self.broker.clock_ms(), self.broker.identity.site)])
        return self.broker.topic(name)

    def altered(self, name: str, changes: Mapping[str, int | None], now_ms: int = 0, site: str = "") -> TopicEntry:
        """The entry an alter of ``name`` makes (a validate-only alter asks this alone). Raises ``UnknownTopic``,
        and ``InvalidConfig`` or ``InvalidReplicationFactor`` where the topic's whole config after the change would
        ack with more members than its segments have (``check_quorum``: a replication factor lowered below
        min_insync_replicas is refused, never silently raised)."""
        self._live(name)
        entry = alter(self.held(name), name, changes, now_ms, site)
        check_quorum(entry.config(), self.broker.site)
        return entry

    async def add_partitions(self, name: str, total: int) -> TopicSpec:
        """Grow ``name`` to ``total`` partitions. Raises ``UnknownTopic``, ``InvalidTopic`` (not a growth)."""
        self._live(name)
        await self.change([add_partitions(self.held(name), name, total)])
        return self.broker.topic(name)

    async def delete(self, name: str) -> TopicEntry:
        """Delete the live incarnation of ``name`` here (the tombstone replicates like any change); the tombstone.
        Raises ``UnknownTopic``. On a multi-node site the tombstone is one Raft command (:meth:`change`): the state
        drops the topic's partitions, and each node's member stops leading them and removes its copies
        (``ClusterMember._remove_deleted``)."""
        self._live(name)
        entry = delete(self.held(name), name, self.broker.clock_ms(), self.broker.identity.site)
        await self.change([entry])
        return entry

    async def change(self, received: Sequence[TopicEntry]) -> list[Merged]:
        """:meth:`merge` on a one-node site; on a multi-node site, one Raft command (in a worker thread), whose
        growth the site's controller places and whose config each partition's leader takes (:meth:`follow`)."""
        store = self.broker.metadata
        if not isinstance(store, RaftMetadataStore):
            return self.merge(received)
        try:
            results = await asyncio.get_running_loop().run_in_executor(None, store.merge_entries, received)
        except CommandRefused as exc:
            if exc.refused.code is RefusalCode.UNKNOWN_TOPIC:
                raise UnknownTopic(received[0].name) from None
            raise InvalidTopic(str(exc)) from None
        for merged in results:
            self._record(merged)
        return results

    def follow(self, topics: Mapping[str, TopicSpec]) -> None:
        """A multi-node site's topic table after a change: the partitions this node serves take their topic's
        config where it changed."""
        for name, spec in topics.items():
            if self._configs.get(name, spec.config) != spec.config:
                self._reconfigure(spec)
            self._configs[name] = spec.config

    def _live(self, name: str) -> None:
        entry = self.held(name)
        if entry is None or entry.deleted:
            raise UnknownTopic(name)

    def merge(self, received: Sequence[TopicEntry]) -> list[Merged]:
        """Join ``received`` into the table and carry out what changed (module docstring). Only for names this
        site holds (live or deleted): a name it lacks is created first, as a topic sync does."""
        store = self._store()
        held = store.entries()
        before = {e.name: held.get(e.name) for e in received}
        lacking = [e.name for e in received if before[e.name] is None and not e.deleted]
        if lacking or len(before) != len(received):
            raise ValueError(f"a merge takes one entry per name held here (create first): {lacking}")
        opened: dict[str, list[PartitionLog]] = {}
        try:
            for entry in received:  # the files of new partitions, before the table says they exist
                old, new = before[entry.name], merge(before[entry.name], entry).entry
                grows = old is not None and not old.deleted and not new.deleted and new.incarnation == old.incarnation
                if grows and old is not None and new.partitions > old.partitions:
                    opened[entry.name] = self._open_new(spec_of(new), old.partitions)
            results = store.merge_entries(received)
        except BaseException:
            for logs in opened.values():
                for plog in logs:
                    plog.close()
            raise
        for merged in results:
            self._carried_out(before[merged.entry.name], merged, opened.pop(merged.entry.name, []))
        return results

    def _record(self, merged: Merged) -> None:
        for conflict in merged.conflicts:
            self.conflicts.append(conflict)
            self.conflicts_total += 1
            log.warning("%s", conflict.describe())

    def _carried_out(self, old: TopicEntry | None, merged: Merged, logs: list[PartitionLog]) -> None:
        self._record(merged)
        new = merged.entry
        if not merged.changed or old is None:
            return
        if new.deleted or old.deleted or new.incarnation != old.incarnation:
            if not old.deleted:
                self.on_deleted(new if new.deleted else replace(old, deleted=True))
            if not new.deleted and not self.broker.in_site:  # a later incarnation: served, in directories of its own
                self._serve_new_incarnation(spec_of(new))
            return
        spec = spec_of(new)
        if logs:
            self.broker._serve_topic(spec, logs, self.broker.clock_ms(), first=old.partitions)
            self.broker.on_topic(spec.name, spec.partitions)
            log.info("topic %r grown from %d to %d partitions", spec.name, old.partitions, spec.partitions)
        if new.config() != old.config():
            self._reconfigure(spec)

    def _serve_new_incarnation(self, spec: TopicSpec) -> None:
        now = self.broker.clock_ms()
        self.broker._serve_topic(spec, self.broker._open_logs(spec, now), now)
        self.broker.on_topic(spec.name, spec.partitions)
        log.info("topic %r is now incarnation %d (%d partitions)", spec.name, spec.incarnation, spec.partitions)

    def _open_new(self, spec: TopicSpec, first: int) -> list[PartitionLog]:
        return self.broker._open_logs(spec, self.broker.clock_ms(), first=first)

    def _reconfigure(self, spec: TopicSpec) -> None:
        config = spec.effective(self.broker.defaults)
        for i in range(spec.partitions):
            p = self.broker.partitions.get((spec.name, i))
            if p is None:
                continue
            # The fsync policy stays the one the partition opened with (module docstring).
            p.config = {**config, "flush_interval_ms": p.config["flush_interval_ms"]}
            plog = p.log
            if hasattr(plog, "config") and isinstance(plog.config, LogConfig):
                plog.config = replace(
                    plog.config,
                    segment_bytes_max=config["segment_bytes_max"],
                    segment_ms=config["segment_ms"],
                    retention_ms=config["retention_ms"],
                    retention_bytes=config["retention_bytes"],
                )
            self.broker.retention.written(p.key)  # the next retention run visits it under the new limits
        log.info("topic %r config now %s", spec.name, spec.config)

    def _deleted_unhandled(self, entry: TopicEntry) -> None:
        log.error(
            "topic %r (incarnation %d) was deleted at site %s; this node holds the tombstone but does not yet remove "
            "the topic's partitions: they stay on disk until it does",
            entry.name,
            entry.incarnation,
            entry.stamp.site,
        )
