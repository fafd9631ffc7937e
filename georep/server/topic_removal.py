"""A deleted topic's partitions leave a one-node site's node: delete's data path after the tombstone (docs/design.md,
"Topic changes across sites", "Storage").

:class:`TopicRemoval` is ``TopicChanges.on_deleted``: told, once, of the tombstone of an incarnation this site held
live, after ``topics.json`` holds it (step 1). On the event loop it stops serving the partitions (step 2: the
broker forgets them, so producers and fetchers get ``UNKNOWN_TOPIC_OR_PARTITION`` / ``NOT_FOUND`` naming the
delete; their waiting acks fail, their retention and flushes find them gone; the topic's metrics series go). Then,
on the broker's replica writer (after any chunk of them still being applied), it closes their logs (releasing
their descriptors from the handle cache) and moves their directories into ``deleted/`` (step 3), and removes them
in the background (step 4). Before closing them it counts the records they hold that this site took after the
delete was made (``georep/server/late_records.py``), logs them naming the deleting site and tells
``count_late`` (``georep_topic_delete_records_total``). The steps a crash interrupts are finished at the next start
(``georep/storage/deleted_dirs.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from georep.broker.errors import NotLeader
from georep.metadata.topic_entry import TopicEntry
from georep.server.broker import Broker
from georep.server.late_records import log_records_taken_after
from georep.storage.api import PartitionLog, StorageError
from georep.storage.deleted_dirs import DELETED_DIR, move_to_deleted, remove_moved
from georep.storage.partition_dirs import partition_dir_name

log = logging.getLogger(__name__)


class TopicRemoval:
    """See the module docstring."""

    def __init__(
        self,
        broker: Broker,
        forget_series: Callable[[str], None] = lambda topic: None,
        count_late: Callable[[str, int], None] = lambda site, records: None,
    ) -> None:
        self.broker = broker
        self.forget_series = forget_series
        self.count_late = count_late  # (deleting site, records removed that were taken here after the delete)
        self.deleted_dir = broker.data_dir / DELETED_DIR
        self.pending: list[Future[None]] = []  # the removals under way (a test waits on them)

    def __call__(self, entry: TopicEntry) -> None:
        broker = self.broker
        if broker.in_site:  # the site's Raft state dropped the partitions: each member removes its copies
            return
        keys = sorted(key for key in broker.partitions if key[0] == entry.name)
        logs: list[tuple[str, PartitionLog]] = []
        for key in keys:
            logs.append((partition_dir_name(entry.name, key[1], entry.incarnation), broker.partitions[key].log))
            broker.detach(key, NotLeader(entry.name, key[1], f"topic {entry.name!r} was deleted"))
        self.forget_series(entry.name)
        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(broker.replica_writer.submit(self._move, entry, logs))
        log.warning(
            "topic %r (incarnation %d) deleted at site %s: its %d partition(s) here are no longer served and are "
            "being removed",
            entry.name,
            entry.incarnation,
            entry.stamp.site,
            len(keys),
        )

    def _move(self, entry: TopicEntry, logs: list[tuple[str, PartitionLog]]) -> None:
        """Off the event loop: count what was taken after the delete, close the logs, move their directories out,
        then remove them."""
        self._count_late(entry, [plog for _, plog in logs])
        for _, plog in logs:
            try:
                plog.close()
            except OSError as exc:  # its files go whatever its last fsync said
                log.warning(
                    "closing a partition of deleted topic %r failed (%s): removed all the same", entry.name, exc
                )
        names = [name for name, _ in logs]
        moved: list[Path] = []
        try:
            moved = move_to_deleted(self.broker.logs_dir, self.deleted_dir, names, entry.incarnation)
        except OSError as exc:
            log.error(
                "cannot move the partitions of deleted topic %r out of %s (%s): the next start removes them",
                entry.name,
                self.broker.logs_dir,
                exc,
            )
        if self.broker.checkpoint is not None:
            self.broker.checkpoint.forget(names)
        remove_moved(moved)

    def _count_late(self, entry: TopicEntry, logs: list[PartitionLog]) -> None:
        """The race of the delete with produces here (docs/design.md, "A delete racing a produce at another
        site"): the records removed that this site took after the tombstone's stamp, counted and logged."""
        late = 0
        for plog in logs:
            try:
                late += log_records_taken_after(plog, entry.stamp.ms)
            except (OSError, StorageError) as exc:  # the count is for the operator; the removal goes on
                log.warning("counting the late records of deleted topic %r failed (%s)", entry.name, exc)
        if late:
            log.warning(
                "topic %r (incarnation %d) was deleted at site %s at %d ms; %d record(s) this site took after that "
                "were removed with it (georep_topic_delete_records_total)",
                entry.name,
                entry.incarnation,
                entry.stamp.site,
                entry.stamp.ms,
                late,
            )
            self.count_late(entry.stamp.site, late)
