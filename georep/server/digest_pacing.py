"""The pace of a node's digest scans (``ScanDigests``, ``ScanSegmentDigests``): a token bucket shared by all of them.

An audit reads every stored batch's bytes to check its CRC: at full speed that competes with produce and fetch
for the disk. ``--audit-digest-rate`` bounds the batches per second that all concurrent scans on one node digest
together (0: unbounded). :class:`TokenBucket` is the arithmetic (no clock of its own: ``now_s`` comes in), and
:class:`DigestPacer` its asyncio shell, which sleeps without blocking the event loop.

A take may exceed what the bucket holds (a message of ``max_digests`` larger than one second's rate): it is
granted and the bucket goes into debt, which later takers wait out in turn. So concurrent scans share the rate
in the order they asked, and no take waits forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# Batches per second. A digest costs ~15-20 us of CPU for a 16 KiB batch (bench/digests.py: ~50,000 batches per
# CPU-second), so 10,000 a second holds an audit to about a fifth of one core and ~160 MB/s of reads per node.
AUDIT_DIGEST_RATE_DEFAULT = 10_000


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; :meth:`reserve` says how long to wait."""

    def __init__(self, rate: float, burst: float, now_s: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs a rate and a burst above 0, not {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._at = now_s

    def reserve(self, n: int, now_s: float) -> float:
        """Take ``n`` tokens; the seconds from ``now_s`` until they are there (0: at once)."""
        if now_s > self._at:
            self.tokens = min(self.burst, self.tokens + (now_s - self._at) * self.rate)
            self._at = now_s
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class DigestPacer:
    """The node's bucket of digests per second; ``rate`` 0 lets every take through at once."""

    def __init__(
        self,
        rate: int,
        clock_s: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate < 0:
            raise ValueError(f"--audit-digest-rate {rate} must be 0 (unbounded) or more batches per second")
        self.rate = rate
        self._clock_s = clock_s
        self._sleep = sleep
        self._bucket = TokenBucket(rate, rate, clock_s()) if rate else None
        self.waited_s = 0.0  # the total the scans slept here (metrics, tests)

    async def take(self, n: int) -> None:
        """Wait until ``n`` digests may go (``n`` may exceed one second's rate; see the module doc)."""
        if self._bucket is None or n <= 0:
            return
        wait_s = self._bucket.reserve(n, self._clock_s())
        if wait_s > 0:
            self.waited_s += wait_s
            await self._sleep(wait_s)
