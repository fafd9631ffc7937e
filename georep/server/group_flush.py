"""Group commit across partitions: one ``syncfs`` for the partitions that wait for an fsync at the same time.

The ack table runs one fsync at a time per partition and lets every ack waiting meanwhile share it. Across
partitions each still had its own fdatasync: with records spread over 10,000 partitions a batch holds about one
record, so the node ran one fsync per record, four at a time, and the disk's fsync rate was the produce rate.

Light load keeps the old path: a partition's flush goes to the fsync pool on its own while fewer than
``parallel`` are running. Beyond that, requests wait in a queue, and one worker job takes the whole queue:
it marks each log's end (``SegmentLog.flush_mark``), runs a single ``syncfs`` of the data directory's file
system, then marks each flushed. A syncfs that fails fails every log in the group, each then retried by its
partition's next flush, with its own fdatasync when the load is light. Only ``SegmentLog``s on the data
directory's file system are grouped, and only where syncfs reports writeback errors
(``GROUP_FLUSH_SUPPORTED``, Linux 5.8 and later); anything else is flushed on its own as before.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

from georep.storage.api import PartitionLog
from georep.storage.segment_log import GROUP_FLUSH_SUPPORTED, SegmentLog, flush_together
from offsets.coordinates import LocalOffset

Waiter = tuple[SegmentLog, "asyncio.Future[LocalOffset]"]


class GroupFlush:
    """Flushes partition logs in ``executor``; see the module doc."""

    def __init__(self, executor: Executor, data_dir: Path, parallel: int, grouped: bool = GROUP_FLUSH_SUPPORTED):
        self.executor = executor
        self.parallel = parallel
        self._fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if grouped else -1
        self._device = os.fstat(self._fd).st_dev if grouped else -1
        self._alone = 0  # single flushes running
        self._queue: list[Waiter] = []
        self._group_running = False
        self.groups = 0  # syncfs rounds run, and the flushes they covered (for tests and the bench)
        self.grouped_flushes = 0

    def flush(self, log: PartitionLog) -> asyncio.Future[LocalOffset]:
        """fsync what ``log`` holds (a future of its flushed offset). Raises RuntimeError once shut down."""
        loop = asyncio.get_running_loop()
        if not self.groupable(log) or (self._alone < self.parallel and not self._group_running):
            self._alone += 1
            task: asyncio.Future[LocalOffset] = loop.run_in_executor(self.executor, log.flush)
            task.add_done_callback(self._alone_done)
            return task
        assert isinstance(log, SegmentLog)
        fut: asyncio.Future[LocalOffset] = loop.create_future()
        self._queue.append((log, fut))
        if not self._group_running:
            self._start_group(loop)
        return fut

    def groupable(self, log: PartitionLog) -> bool:
        """Whether one ``syncfs`` of the data directory's file system makes ``log`` durable (see the module doc)."""
        return self._fd >= 0 and isinstance(log, SegmentLog) and log.device == self._device

    def sync_together(self, logs: Sequence[SegmentLog]) -> list[LocalOffset]:
        """In a worker thread: flush ``logs`` (each :meth:`groupable`) with one ``syncfs`` now, as a group does;
        their flushed offsets. Raises ``OSError`` when the syncfs fails (then none is marked flushed). The replica
        writer thread flushes what it applied this way, in the same hop (``Broker.append_replica``)."""
        self.groups += 1
        self.grouped_flushes += len(logs)
        return flush_together(logs, self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _alone_done(self, _task: asyncio.Future[LocalOffset]) -> None:
        self._alone -= 1

    def _start_group(self, loop: asyncio.AbstractEventLoop) -> None:
        group, self._queue = self._queue, []
        self._group_running = True
        logs = [log for log, _fut in group]
        try:
            task = loop.run_in_executor(self.executor, flush_together, logs, self._fd)
        except RuntimeError as exc:  # the pool is shut down: the node is stopping
            self._group_running = False
            stopped = exc
            _settle(group, lambda fut, _i: fut.set_exception(stopped))
            return
        self.groups += 1
        self.grouped_flushes += len(group)
        task.add_done_callback(lambda done: self._group_done(loop, group, done))

    def _group_done(
        self, loop: asyncio.AbstractEventLoop, group: list[Waiter], done: asyncio.Future[list[LocalOffset]]
    ) -> None:
        self._group_running = False
        if done.cancelled():
            _settle(group, lambda fut, _i: fut.cancel())
            return
        error = done.exception()
        if error is None:
            offsets = done.result()
            _settle(group, lambda fut, i: fut.set_result(offsets[i]))
        else:
            _settle(group, lambda fut, _i: fut.set_exception(error))
        if self._queue:
            self._start_group(loop)


def _settle(group: list[Waiter], outcome: Callable[[asyncio.Future[LocalOffset], int], object]) -> None:
    for i, (_log, fut) in enumerate(group):
        if not fut.done():
            outcome(fut, i)
