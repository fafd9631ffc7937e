"""ClusterStatus's store size (georep/server/store_bytes.py): answered at once while the store's threads are busy."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from georep.server.store_bytes import StoreBytes


def test_a_busy_store_still_shows_its_last_size_and_a_free_one_its_new_size() -> None:
    sizes = iter([4096, 8192])
    release = threading.Event()

    async def scenario() -> None:
        executor = ThreadPoolExecutor(1)
        try:
            gauge = StoreBytes(lambda: next(sizes), executor)
            assert await gauge.read() == 4096, "the first call waits for a size"
            executor.submit(release.wait)  # every store thread busy, as behind a failover's segment opens
            gauge._started = float("-inf")  # a refresh is due
            assert await gauge.read() == 4096, "a busy store's size became unknown"
            release.set()
            async with asyncio.timeout(10):
                while await gauge.read() != 8192:
                    await asyncio.sleep(0.05)
        finally:
            release.set()
            executor.shutdown(wait=False)

    asyncio.run(scenario())
