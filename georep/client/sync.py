"""Blocking wrappers: the asyncio clients on a background event-loop thread.

``SyncProducer.send`` returns a ``concurrent.futures.Future``. Records handed
to ``send`` from any thread are queued and moved onto the loop in bulk, so a
tight loop of ``send`` calls does not pay one thread hop per record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections import deque
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from georep.client.admin import Admin
from georep.client.consumer import Consumer, ConsumerRecord, TopicPartition
from georep.client.producer import Producer, RecordMetadata
from offsets.vector import VectorOffset

T = TypeVar("T")


class _LoopThread:
    """One event loop running in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncAdmin:
    def __init__(self, bootstrap: str | list[str], **options: Any) -> None:
        self._thread = _LoopThread("georep-admin")
        try:
            self._admin: Admin = self._thread.run(self._make(bootstrap, options))
        except BaseException:
            self._thread.stop()
            raise

    @staticmethod
    async def _make(bootstrap: str | list[str], options: dict[str, Any]) -> Admin:
        return await Admin(bootstrap, **options).start()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._admin, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._thread.run(method(*args, **kwargs))

        return call

    def close(self) -> None:
        try:
            self._thread.run(self._admin.close())
        finally:
            self._thread.stop()

    def __enter__(self) -> SyncAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncProducer:
    """``with SyncProducer("127.0.0.1:7101") as p: p.send("t", b"v").result()``."""

    def __init__(self, bootstrap: str | list[str], **options: Any) -> None:
        self._thread = _LoopThread("georep-producer")
        self._pending: deque[tuple[concurrent.futures.Future[RecordMetadata], tuple[Any, ...]]] = deque()
        self._scheduled = False
        self._lock = threading.Lock()
        try:
            self._producer: Producer = self._thread.run(self._make(bootstrap, options))
        except BaseException:
            self._thread.stop()
            raise

    @staticmethod
    async def _make(bootstrap: str | list[str], options: dict[str, Any]) -> Producer:
        return await Producer(bootstrap, **options).start()

    def send(
        self,
        topic: str,
        value: bytes | str | None,
        key: bytes | str | None = None,
        partition: int | None = None,
        headers: Iterable[tuple[str, bytes | None]] | None = None,
        timestamp_ms: int | None = None,
    ) -> concurrent.futures.Future[RecordMetadata]:
        future: concurrent.futures.Future[RecordMetadata] = concurrent.futures.Future()
        args = (topic, value, key, partition, list(headers) if headers else None, timestamp_ms)
        with self._lock:
            self._pending.append((future, args))
            schedule = not self._scheduled
            self._scheduled = True
        if schedule:
            self._thread.loop.call_soon_threadsafe(self._drain)
        return future

    def _drain(self) -> None:
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
            self._scheduled = False
        for future, args in items:
            try:
                inner = self._producer.send(*args)
            except Exception as exc:  # noqa: BLE001 - handed to the caller's future
                future.set_exception(exc)
                continue
            inner.add_done_callback(functools.partial(_copy, target=future))

    def flush(self, timeout_s: float | None = None) -> None:
        self._thread.run(self._flush(), timeout_s)

    async def _flush(self) -> None:
        self._drain()
        await self._producer.flush()

    def close(self, timeout_s: float | None = None) -> None:
        try:
            self._thread.run(self._close(timeout_s))
        finally:
            self._thread.stop()

    async def _close(self, timeout_s: float | None) -> None:
        self._drain()
        await self._producer.close(timeout_s)

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy(source: asyncio.Future[T], target: concurrent.futures.Future[T]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


class SyncConsumer:
    """``with SyncConsumer("127.0.0.1:7101", auto_offset_reset="earliest") as c: c.subscribe(["t"]); c.poll()``."""

    def __init__(self, bootstrap: str | list[str], **options: Any) -> None:
        self._thread = _LoopThread("georep-consumer")
        try:
            self._consumer: Consumer = self._thread.run(self._make(bootstrap, options))
        except BaseException:
            self._thread.stop()
            raise

    @staticmethod
    async def _make(bootstrap: str | list[str], options: dict[str, Any]) -> Consumer:
        return await Consumer(bootstrap, **options).start()

    def _call(self, name: str, *args: Any) -> Any:
        method = getattr(self._consumer, name)

        async def call() -> Any:
            return method(*args)

        return self._thread.run(call())

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        self._call("assign", list(partitions))

    def subscribe(self, topics: Iterable[str] = (), *, pattern: str | None = None) -> None:
        self._call("subscribe", list(topics), None, pattern)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._call("seek", tp, offset)

    def seek_to_beginning(self, tps: Iterable[TopicPartition] | None = None) -> None:
        self._call("seek_to_beginning", None if tps is None else list(tps))

    def seek_to_end(self, tps: Iterable[TopicPartition] | None = None) -> None:
        self._call("seek_to_end", None if tps is None else list(tps))

    def seek_to_vector(self, tp: TopicPartition, vector: VectorOffset) -> None:
        self._call("seek_to_vector", tp, vector)

    def position(self, tp: TopicPartition) -> int | None:
        result: int | None = self._call("position", tp)
        return result

    def vector(self, tp: TopicPartition) -> VectorOffset:
        result: VectorOffset = self._call("vector", tp)
        return result

    def poll(self, timeout_ms: float = 1000, max_records: int = 500) -> list[ConsumerRecord]:
        return self._thread.run(self._consumer.poll(timeout_ms, max_records))

    def __iter__(self) -> Iterator[ConsumerRecord]:
        while True:
            yield from self.poll()

    def close(self) -> None:
        try:
            self._thread.run(self._consumer.close())
        finally:
            self._thread.stop()

    def __enter__(self) -> SyncConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
