"""Group commit across partitions (issue 22): acks waiting on many partitions at once share one syncfs, and an
ack is still released only once its batch is durable.

Before, each partition had its own fdatasync: a produce spread over 10,000 partitions makes batches of about
one record, and the node ran one fsync per record, so the disk's fsync rate was the produce rate.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import georep.storage.segment_log as segment_log
from georep.broker.acks import LEADER
from georep.broker.errors import FsyncFailed
from georep.server.broker import FSYNC_THREADS, Broker
from georep.storage.metadata_file import load_or_create_identity
from tests.support.node_api import batch

PARTITIONS = 200

pytestmark = pytest.mark.skipif(not segment_log.GROUP_FLUSH_SUPPORTED, reason="syncfs does not report errors here")


def produce_everywhere(broker: Broker) -> list[asyncio.Future[None]]:
    """One acks=leader batch to every partition, in one go (as a stream's requests arrive): the ack waiters."""
    waiters = []
    for i in range(PARTITIONS):
        p, produced = broker.append("t", i, batch(1), LEADER)
        waiter = broker.ack_waiter(p, produced, LEADER)
        assert waiter is not None  # fsync per batch: every ack waits for one
        waiters.append(waiter)
    return waiters


def test_acks_on_many_partitions_share_syncs_and_each_waits_for_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs: list[int] = []
    real: Callable[[int], None] = os.fdatasync

    def counted(fd: int) -> None:
        fsyncs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
        try:
            broker.create_topic("t", PARTITIONS, {})
            fsyncs.clear()
            await asyncio.gather(*produce_everywhere(broker))
            logs = [broker.partition("t", i).log for i in range(PARTITIONS)]
            assert [log.flushed_offset for log in logs] == [1] * PARTITIONS  # every acked batch is flushed
            grouped = broker.flusher.grouped_flushes
            assert len(fsyncs) <= 3 * FSYNC_THREADS, f"{len(fsyncs)} fsyncs for {PARTITIONS} partitions at once"
            assert grouped >= PARTITIONS - FSYNC_THREADS and broker.flusher.groups < grouped
        finally:
            broker.close()

    asyncio.run(scenario())


def test_a_failed_syncfs_fails_every_ack_of_its_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(_fd: int) -> int:
        import ctypes

        ctypes.set_errno(errno.EIO)
        return -1

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
        try:
            broker.create_topic("t", PARTITIONS, {})
            monkeypatch.setattr(segment_log, "_SYNCFS", failing)
            results = await asyncio.gather(*produce_everywhere(broker), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            assert len(failed) >= PARTITIONS - FSYNC_THREADS  # the grouped ones: none was acked
            assert all(isinstance(r, FsyncFailed) for r in failed), failed[0]
            logs = [broker.partition("t", i).log for i in range(PARTITIONS)]
            assert sum(log.flushed_offset == 0 for log in logs) == len(failed)  # none claims what syncfs lost
        finally:
            monkeypatch.undo()
            broker.close()

    asyncio.run(scenario())
