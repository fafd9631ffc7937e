"""The broker's replica apply path, in process with a real segment log."""

from __future__ import annotations

import asyncio
from pathlib import Path

from georep.server.broker import Broker
from georep.storage.metadata_file import load_or_create_identity
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
