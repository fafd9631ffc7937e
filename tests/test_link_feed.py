"""The node feeds its links only the partitions whose durable state moved (issue 22, "Links").

``Replicator.tick`` used to read every partition's vector every 0.2 s. Now each partition's durable watcher names it
when it moves, and the tick reads only those: these tests check that a moved partition still reaches the links, and
that an idle one is not read, with a real ``Broker`` over a temporary directory (no sockets).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from georep.server.broker import Broker
from georep.server.replicator import Replicator
from georep.storage.metadata_file import load_or_create_identity
from offsets.coordinates import Origin
from tests.support.sites import origin_batch
from topology.ids import SiteId
from topology.model import default_topology

B = Origin(SiteId("b"), 1)


async def flushed(broker: Broker, key: tuple[str, int]) -> None:
    p = broker.partitions[key]
    async with asyncio.timeout(10):
        while p.log.flushed_offset < p.log.log_end_offset:
            await p.durable()


def test_a_partition_that_moved_reaches_the_links_and_an_idle_one_is_not_read(tmp_path: Path) -> None:
    async def main() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
        replicator = Replicator(broker, default_topology(), "a", 1_000)
        broker.create_topic("t", 3, {})
        for p in broker.partitions.values():  # as NodeService does for every partition it opens
            replicator.partition_opened(p)
        replicator.tick()
        assert replicator.links.local[("t", 1)] == {}
        reads: list[tuple[str, int]] = []
        for key, p in broker.partitions.items():
            vector = p.log.vector
            p.log.vector = lambda key=key, vector=vector: reads.append(key) or vector()  # type: ignore[method-assign]
        # An apply that bypasses the pull session (which feeds the links itself): only the flush's watcher says it.
        await broker.append_replica([("t", 1, origin_batch(B, 0))])
        await flushed(broker, ("t", 1))
        async with asyncio.timeout(10):  # the flush's watcher runs on the loop after the flush is seen
            while ("t", 1) not in replicator._moved:
                await asyncio.sleep(0.01)
        reads.clear()  # the apply reads the vector too: count the tick's reads only
        replicator.tick()
        assert replicator.links.local[("t", 1)] == {B: 2}
        assert reads == [("t", 1)]  # the idle partitions were not read
        replicator.tick()
        assert reads == [("t", 1)]
        broker.close()

    asyncio.run(main())
