"""The periodic flush follows writes: written partitions are fsynced when due, idle ones cost nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from georep.server.broker import Broker, Partition
from georep.storage.metadata_file import load_or_create_identity
from offsets.coordinates import Origin
from tests.support.node_api import batch
from tests.support.sites import origin_batch
from topology.ids import SiteId


class CountingPartitions(dict[tuple[str, int], Partition]):
    """The broker's partition table, counting every walk over it."""

    walks = 0

    def values(self):  # type: ignore[no-untyped-def,override]
        CountingPartitions.walks += 1
        return super().values()

    def items(self):  # type: ignore[no-untyped-def,override]
        CountingPartitions.walks += 1
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingPartitions.walks += 1
        return super().__iter__()


def test_only_written_partitions_are_flushed_and_an_idle_tick_walks_no_partition(tmp_path: Path) -> None:
    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
        try:
            broker.create_topic("t", 200, {"flush_interval_ms": 50})
            broker.partitions = CountingPartitions(broker.partitions)
            written = [broker.partition("t", 7), broker.partition("t", 9)]
            broker.append("t", 7, batch(3))
            await broker.append_replica([("t", 9, origin_batch(Origin(SiteId("b"), 1), 0, n=2))])
            assert all(p.log.flushed_offset < p.log.log_end_offset for p in written)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(p.log.flushed_offset < p.log.log_end_offset for p in written):
                broker.flush_due(int(time.monotonic() * 1000))
                await asyncio.sleep(0.01)
            assert [p.log.flushed_offset for p in written] == [3, 2]  # the periodic flush made both durable
            CountingPartitions.walks = 0
            for _ in range(20):  # nothing written since: a tick has nothing to look at
                broker.flush_due(int(time.monotonic() * 1000) + 10_000)
            assert CountingPartitions.walks == 0
        finally:
            broker.close()

    asyncio.run(scenario())
