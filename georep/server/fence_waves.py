"""A new leader's fences to each peer, in bounded waves. Shell.

After a node's kill, each survivor starts a recovery for every partition it took over, and each recovery fences
every member at once: thousands of ``FenceSegments`` calls to the other survivor, whose event loop is as busy. The
gRPC server keeps at most about a thousand calls waiting for its loop and cancels the rest: the fences came back
``CANCELLED`` (3,000 to 15,000 per run at 5,000 and 10,000 partitions), each failing its recovery for a retry
half a second later, which fenced everything again.

So a node keeps at most :data:`FENCES_PER_PEER` fences in flight to each peer; the others wait here, on the caller's
side, where waiting costs nothing. A fence the peer still sheds (``CANCELLED``, ``RESOURCE_EXHAUSTED``: the call was
refused, not answered) is sent again, up to :data:`FENCE_TRIES` times, before its recovery hears the member
unreachable. Sending a fence again is safe: a member records an epoch only if it is newer than its own, and answers
its ends either way. Nothing here decides anything about the recovery: a fence that is never answered is still
``unreachable``, and ``cluster/recovery.py`` still needs ``E - AQ + 1`` answers before it picks an end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

FENCES_PER_PEER = 64  # far below gRPC's server-side pending-call limit (1,000)
FENCE_TRIES = 3
SHED_BACKOFF_S = 0.2  # before a shed fence is sent again (doubled per try)
SHED_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED})

T = TypeVar("T")


class _Slots:
    """At most ``size`` holders at once, the others served in arrival order. Not ``asyncio.Semaphore``: its
    ``acquire`` looks at every waiter (``locked``), and thousands of fences waiting for one peer made that 9% of a
    survivor in py-spy."""

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn  # release() handed this waiter its slot
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.free += 1


class FenceWaves:
    """Per peer address, at most ``per_peer`` fences in flight; ``send`` waits for a slot, and sends a shed fence
    again."""

    def __init__(self, per_peer: int = FENCES_PER_PEER, tries: int = FENCE_TRIES) -> None:
        if per_peer < 1 or tries < 1:
            raise ValueError(f"per_peer={per_peer}, tries={tries}: each must be at least 1")
        self.per_peer = per_peer
        self.tries = tries
        self._slots: dict[str, _Slots] = {}

    @contextlib.asynccontextmanager
    async def _slot(self, address: str) -> AsyncIterator[None]:
        slots = self._slots.get(address)
        if slots is None:
            slots = self._slots[address] = _Slots(self.per_peer)
        await slots.acquire()
        try:
            yield
        finally:
            slots.release()

    async def send(self, address: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` (one fence to ``address``) in a slot of that peer's; again while the peer sheds it."""
        async with self._slot(address):
            for attempt in range(self.tries):
                try:
                    return await call()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in SHED_CODES or attempt == self.tries - 1:
                        raise
                await asyncio.sleep(SHED_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable: the last try returns or raises")
