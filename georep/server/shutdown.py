"""A node's stop, bounded: a second SIGTERM or SIGINT, or a timeout, ends the process whatever is still running.

A clean stop (SIGTERM, Ctrl-C) goes step by step: the cluster member, the pullers, the Kafka listener, the calls
in flight, the segment threads, every log's fsync and recovery point, the Raft metadata. Any of them can hang:
a task that swallows its cancellation, an fsync on a disk that stopped answering, a peer that never closes.
Once a node has said "shutting down", then:

* each asynchronous step has :data:`STEP_TIMEOUT_S`: past it, the node logs which step did not finish and goes
  on with the next (:meth:`Shutdown.step`);
* a second SIGTERM or SIGINT forces the stop at once, and so does the whole stop lasting longer than its timeout
  (``georep node --shutdown-timeout-ms``). Forced, the node logs what had not finished and exits with
  :data:`EXIT_FORCED` without waiting for anything (``os._exit``): its logs are recovered at the next start, as
  after a crash, and the lock on its data dir goes with the process.

The second signal is caught by a plain ``signal.signal`` handler, not the event loop's: a step that blocks the
loop's thread (joining a stuck fsync thread) must not keep the signal from being handled. The timeout runs in a
timer thread, for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable
from types import FrameType

log = logging.getLogger("georep.node")

SHUTDOWN_TIMEOUT_MS_DEFAULT = 60_000
STEP_TIMEOUT_S = 10.0
EXIT_FORCED = 3
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Shutdown:
    """One node's stop: what it is doing now (``stage``), and what forces it."""

    def __init__(self, timeout_ms: int = SHUTDOWN_TIMEOUT_MS_DEFAULT) -> None:
        self.timeout_ms = timeout_ms
        self.stage = "starting to stop"
        self._timer: threading.Timer | None = None
        self._forcing = threading.Lock()

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        """The stop has begun (the first signal): from now on a second signal or the timeout forces it."""
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, self._on_signal)
        self._timer = threading.Timer(self.timeout_ms / 1000, self.force, (f"its timeout ({self.timeout_ms} ms)",))
        self._timer.daemon = True
        self._timer.start()

    async def step(self, what: str, awaitable: Awaitable[object], timeout_s: float = STEP_TIMEOUT_S) -> None:
        """``what`` (for instance "stopping the pullers"), for at most ``timeout_s``; then the next step."""
        self.stage = what
        try:
            async with asyncio.timeout(timeout_s):
                await awaitable
        except TimeoutError:
            log.warning("shutdown: %s did not finish within %.0f s; going on without it", what, timeout_s)

    def blocking(self, what: str) -> None:
        """A step that blocks the loop's thread comes next (a second signal or the timeout still force it)."""
        self.stage = what

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.force(f"a second {signal.Signals(signum).name}")

    def force(self, why: str) -> None:
        """End the process now: ``why``, and the step that had not finished, logged first."""
        if not self._forcing.acquire(blocking=False):
            return  # the timer and a signal at once: one of them ends the process
        log.error(
            "shutdown forced by %s: %s had not finished; exiting at once with code %d (the logs are "
            "recovered at the next start, as after a crash)",
            why,
            self.stage,
            EXIT_FORCED,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_FORCED)
