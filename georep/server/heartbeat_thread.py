"""The node's heartbeats, from a thread of their own. Shell.

A survivor of a node's kill recovers thousands of partitions at once, and its event loop runs their callbacks for
seconds on end. A heartbeat that waited for that loop (to start, then between its two metadata calls) committed
seconds late, and the controller took the busy survivor for dead and moved its partitions too: more work for the
last nodes, and the bench's partitions leaderless for ten seconds more. This thread waits for nothing but the
metadata: it proposes a heartbeat every period, whatever the loop is doing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class HeartbeatThread:
    """Calls ``beat`` every ``period_s`` (at once when one took longer) until :meth:`stop`."""

    def __init__(self, beat: Callable[[], None], period_s: float, name: str) -> None:
        self._beat = beat
        self._period_s = period_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._beat()
            except Exception:  # a bug in one heartbeat must not end them: log it and beat again
                log.exception("%s: heartbeat failed", self._thread.name)
            self._stopping.wait(max(0.0, started + self._period_s - time.monotonic()))

    def stop(self) -> None:
        """Stop beating; returns once the beat in flight (a proposal, bounded by its timeout) is over."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
