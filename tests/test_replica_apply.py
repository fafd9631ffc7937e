"""The broker's replica apply path, in process with a real segment log."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path

from georep.server.broker import Broker
from georep.storage.metadata_file import load_or_create_identity
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from tests.support.sites import origin_batch
from topology.ids import SiteId


def test_an_apply_whose_puller_is_cancelled_is_still_fsynced_and_served(tmp_path: Path) -> None:
    """A puller that reopens its stream cancels the apply it awaits; the writer thread appends anyway.

    Those batches must still be fsynced: a site serves only durable batches onward,
    so unflushed ones would never reach the sites downstream of it.
    """

    async def scenario() -> tuple[int, int]:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1))
        broker.create_topic("t", 1, {})  # flush_interval_ms=0: fsync per batch
        p = broker.partition("t", 0)
        task = asyncio.create_task(broker.append_replica([("t", 0, origin_batch(Origin(SiteId("a"), 1), 0, n=3))]))
        await asyncio.sleep(0)  # the apply is now in the writer thread
        task.cancel()
        for _ in range(500):
            if p.log.flushed_offset == 3:
                break
            await asyncio.sleep(0.01)
        result = (p.log.log_end_offset, p.log.flushed_offset)
        broker.close()
        return result

    assert asyncio.run(scenario()) == (3, 3)


A = Origin(SiteId("a"), 1)


def test_a_messages_partitions_are_fsynced_with_one_syncfs_and_held_only_once_it_returned(tmp_path: Path) -> None:
    """The replica writer applies a pulled message's chunks and syncs them in the same hop (issue 22): one syncfs
    for the message, not one fdatasync per partition. This site reports as held (and serves onward) only what
    that syncfs made durable: while it runs, nothing of the message is held."""
    gate = threading.Event()
    syncing = threading.Event()

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1))
        broker.create_topic("t", 3, {})  # flush_interval_ms=0: fsync per batch
        sync = broker.flusher.sync_together

        def held_back(logs: list[SegmentLog]) -> object:
            syncing.set()
            assert gate.wait(30)
            return sync(logs)

        broker.flusher.sync_together = held_back  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(broker.append_replica([("t", i, origin_batch(A, 0, n=2)) for i in range(3)]))
            assert await asyncio.to_thread(syncing.wait, 30)
            logs = [broker.partition("t", i).log for i in range(3)]
            assert [(log.log_end_offset, log.flushed_offset) for log in logs] == [(2, 0)] * 3  # applied, not synced
            await asyncio.sleep(0.05)  # whatever the loop would do meanwhile
            assert [broker.held.sites_holding("t", i, A, 0) for i in range(3)] == [[], [], []]
            gate.set()
            applied = await task
            assert [p.key for p in applied.synced] == [("t", 0), ("t", 1), ("t", 2)]
            assert [broker.held.sites_holding("t", i, A, 1) for i in range(3)] == [["b"], ["b"], ["b"]]
            assert (broker.flusher.groups, broker.flusher.grouped_flushes) == (1, 3)  # one syncfs for all three
        finally:
            gate.set()
            broker.close()

    asyncio.run(scenario())


def test_a_failed_syncfs_of_the_replica_writer_reports_nothing_held(tmp_path: Path) -> None:
    """A syncfs that fails in the writer's hop makes nothing durable: nothing of it is held or served onward
    until a flush of its own succeeds (held back here, so that only the hop's word could count)."""

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1))
        broker.create_topic("t", 2, {})

        def failing(logs: list[SegmentLog]) -> object:
            raise OSError(errno.EIO, "syncfs failed: Input/output error")

        pending: list[asyncio.Future[int]] = []

        def never(log: object) -> asyncio.Future[int]:
            pending.append(asyncio.get_running_loop().create_future())
            return pending[-1]

        broker.flusher.sync_together = failing  # type: ignore[method-assign]
        broker.flusher.flush = never  # type: ignore[method-assign,assignment]
        try:
            applied = await broker.append_replica([("t", i, origin_batch(A, 0, n=2)) for i in range(2)])
            assert applied.synced == () and applied.error is None
            assert len(pending) == 2  # each partition's own flush was asked for
            logs = [broker.partition("t", i).log for i in range(2)]
            assert [(log.log_end_offset, log.flushed_offset) for log in logs] == [(2, 0)] * 2
            assert [broker.held.sites_holding("t", i, A, 0) for i in range(2)] == [[], []]
        finally:
            for fut in pending:
                fut.cancel()
            broker.close()

    asyncio.run(scenario())
