"""The fault proxy on its own event loop in a daemon thread: for tests and benchmarks that are not asyncio."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import TracebackType

from georep.faultproxy.proxy import FaultProxy

START_TIMEOUT_S = 10.0


class ThreadedFaultProxy:
    """``with ThreadedFaultProxy() as fp: fp.api_address`` serves the API until the block ends."""

    def __init__(self, listen: str = "127.0.0.1:0", seed: int | None = None) -> None:
        host, _, port = listen.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port or 0)
        self.proxy = FaultProxy(seed)
        self.api_address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)

    def start(self) -> ThreadedFaultProxy:
        self._thread.start()
        started: Future[str] = asyncio.run_coroutine_threadsafe(self.proxy.start(self.host, self.port), self._loop)
        self.api_address = started.result(START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> ThreadedFaultProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
