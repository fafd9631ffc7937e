"""The bytes a node's replica store holds, as ``ClusterStatus`` shows them: the last size measured, refreshed in
the store's threads in the background.

Measuring takes the store's lock, which the segment threads hold for every open, append and fsync. During a
failover at 5,000 partitions they queue thousands of opens, and a status that waited for the size (up to a second,
then "unknown") answered a second late at every poll, on the nodes that were busiest; an operator watching the
failover saw the size vanish. The status now answers at once with the last size measured (at most one refresh in
flight, at most one per ``REFRESH_S``); only the first call, with nothing measured yet, waits (as long as before).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor

FIRST_WAIT_S = 1.0  # the first call waits this long for a size, then leaves it unknown
REFRESH_S = 1.0  # a new measure at most this often


class StoreBytes:
    """``measure()`` (blocking) in ``executor``, remembered; see the module docstring."""

    def __init__(self, measure: Callable[[], int], executor: Executor) -> None:
        self._measure = measure
        self._executor = executor
        self._last: int | None = None
        self._pending: asyncio.Future[int] | None = None
        self._started = float("-inf")  # loop time of the last refresh started

    async def read(self) -> int | None:
        """The last size measured (None: none yet); starts a refresh if one is due."""
        loop = asyncio.get_running_loop()
        if (self._pending is None or self._pending.done()) and loop.time() - self._started >= REFRESH_S:
            self._started = loop.time()
            self._pending = loop.run_in_executor(self._executor, self._measure)
            self._pending.add_done_callback(self._keep)
        if self._last is None and self._pending is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._pending), FIRST_WAIT_S)
        return self._last

    def _keep(self, done: asyncio.Future[int]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._last = done.result()
