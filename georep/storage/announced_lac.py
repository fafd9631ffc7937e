"""The LACs partition leaders announced to this node for the open segments it holds copies of. Shell.

A leader puts its segment's last add confirmed on the requests of its
``AppendSegment`` streams (and sends it alone when it moves while nothing is
left to send), as BookKeeper's writer piggybacks its LAC on every add. The
member records the highest one per segment here, in memory, and its
follower reads serve the open segment up to it (``cluster/follower_reads.py``
says why that is safe). A node that restarts knows no LAC until the next
announcement, and serves only sealed segments until then: the safe side.

An announcement is kept per (partition, segment id): one of an earlier
segment never counts for the next. Readers waiting for more are woken on the
event loop they wait on.
"""

from __future__ import annotations

import asyncio
import threading

from topology.ids import SegmentId

PartitionKey = tuple[str, int]
KEPT_PER_PARTITION = 4  # segment ids: older ones are sealed, and a seal bounds reads of them


class AnnouncedLacs:
    """Thread-safe; :meth:`changed` wakes asyncio readers on their own loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lacs: dict[PartitionKey, dict[SegmentId, int]] = {}
        self._waiters: dict[PartitionKey, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def announce(self, key: PartitionKey, segment_id: SegmentId, lac: int) -> bool:
        """The leader of ``key`` confirmed everything below ``lac`` in ``segment_id``; True if that is news."""
        with self._lock:
            lacs = self._lacs.setdefault(key, {})
            if lac <= lacs.get(segment_id, -1):
                return False
            lacs[segment_id] = lac
            for old in sorted(lacs)[:-KEPT_PER_PARTITION]:
                del lacs[old]
            waiters = self._waiters.pop(key, [])
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)
        return True

    def forget(self, key: PartitionKey) -> None:
        """``key``'s copies were removed (its topic incarnation was deleted): a later incarnation's segments start
        with no LAC (an earlier one's would let a follower serve what its leader has not confirmed); its readers
        wake and find the copies gone."""
        with self._lock:
            self._lacs.pop(key, None)
            waiters = self._waiters.pop(key, [])
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def get(self, key: PartitionKey, segment_id: SegmentId) -> int | None:
        with self._lock:
            return self._lacs.get(key, {}).get(segment_id)

    def changed(self, key: PartitionKey) -> asyncio.Future[None]:
        """A future of the running loop that resolves at the next announcement for ``key``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            waiters = self._waiters.setdefault(key, [])
            waiters[:] = [(lp, f) for lp, f in waiters if not f.done()]
            waiters.append((loop, fut))
        return fut


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
