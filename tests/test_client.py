"""The client against real ``georep node`` processes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from georep.client import (
    Admin,
    Consumer,
    ConsumerRecord,
    NodeUnavailable,
    OffsetOutOfRange,
    Producer,
    RecordTooLarge,
    SyncConsumer,
    SyncProducer,
    TopicExists,
    UnknownTopic,
    VectorOffset,
    key_partition,
)
from georep.server.process import NodeProcess

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 45))


async def create(address: str, topic: str, partitions: int, config: dict[str, str] | None = None) -> None:
    async with Admin(address) as admin:
        await admin.create_topic(topic, partitions, config)


async def read_all(address: str, topic: str, partitions: int, expected: int, timeout_s: float = 15) -> list:
    """Every record of ``topic`` from the beginning, once ``expected`` have arrived (or the timeout)."""
    out: list[ConsumerRecord] = []
    async with Consumer(address, auto_offset_reset="earliest", max_wait_ms=100) as consumer:
        consumer.assign([(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(await consumer.poll(timeout_ms=200))
        out.extend(await consumer.poll(timeout_ms=200))  # anything beyond expected would be a bug
    return out


@pytest.mark.parametrize("codec", ["none", "zstd", "lz4", "gzip", "snappy"])
def test_round_trip_keys_headers_nulls(node: NodeProcess, codec: str) -> None:
    async def main() -> None:
        await create(node.address, "rt", 2)
        sent = [
            dict(value=b"plain"),
            dict(value=None, key=b"k-null-value"),
            dict(value=b"", key=b""),
            dict(value=b"v" * 5000, key=b"big", headers=[("h1", b"x"), ("h2", None), ("h3", b"")]),
            dict(value="text", key="text-key", timestamp_ms=1_700_000_000_000),
        ]
        async with Producer(node.address, compression=codec, linger_ms=20) as producer:
            futures = [producer.send("rt", **kw) for kw in sent]
            metas = await asyncio.gather(*futures)
        for meta in metas:
            assert meta.topic == "rt" and meta.origin.site == "a" and meta.offset >= 0
        got = await read_all(node.address, "rt", 2, len(sent))
        assert len(got) == len(sent)
        by_value = {(r.key, r.value): r for r in got}
        for kw, meta in zip(sent, metas, strict=True):
            key = kw.get("key")
            key = key.encode() if isinstance(key, str) else key
            value = kw["value"].encode() if isinstance(kw["value"], str) else kw["value"]
            record = by_value[(key, value)]
            assert tuple(record.headers) == tuple(kw.get("headers") or ())
            assert (record.partition, record.offset, record.origin, record.origin_seq) == (
                meta.partition,
                meta.offset,
                meta.origin,
                meta.origin_seq,
            )
            assert record.timestamp_ms == meta.timestamp_ms
        assert by_value[(b"text-key", b"text")].timestamp_ms == 1_700_000_000_000

    run(main())


def test_key_hash_partition_is_stable(node: NodeProcess) -> None:
    async def main() -> None:
        await create(node.address, "keys", 5)
        keys = [f"user-{i}".encode() for i in range(50)]
        placements = []
        for _ in range(2):  # two producers, two random producer ids, same placement
            async with Producer(node.address) as producer:
                metas = await asyncio.gather(*(producer.send("keys", b"v", key=k) for k in keys))
            placements.append([m.partition for m in metas])
        assert placements[0] == placements[1] == [key_partition(k, 5) for k in keys]
        assert len(set(placements[0])) == 5

    run(main())


def test_per_partition_order_and_offsets(node: NodeProcess) -> None:
    async def main() -> None:
        await create(node.address, "order", 3)
        n = 3000
        async with Producer(node.address, batch_size=4096, linger_ms=1) as producer:
            futures = [producer.send("order", b"%06d" % i, key=b"%d" % (i % 7)) for i in range(n)]
            await producer.flush()
            metas = [f.result() for f in futures]
        got = await read_all(node.address, "order", 3, n)
        assert len(got) == n
        for p in range(3):
            records = [r for r in got if r.partition == p]
            assert [r.offset for r in records] == list(range(len(records)))
            assert [r.origin_seq for r in records] == list(range(len(records)))
            values = [int(r.value) for r in records]
            assert values == sorted(values)
        assert sorted((m.partition, m.offset) for m in metas) == sorted((r.partition, r.offset) for r in got)

    run(main())


def test_seek_beginning_end_offset_vector(node: NodeProcess) -> None:
    async def main() -> None:
        await create(node.address, "seek", 1)
        tp = ("seek", 0)
        async with Producer(node.address, batch_size=200) as producer:  # several small batches
            await asyncio.gather(*(producer.send("seek", b"%d" % i, partition=0) for i in range(20)))
        async with Consumer(node.address, max_wait_ms=100) as consumer:
            consumer.assign([tp])
            consumer.seek_to_beginning()
            first = await consumer.poll(timeout_ms=5000, max_records=5)
            assert [r.value for r in first] == [b"0", b"1", b"2", b"3", b"4"]
            assert consumer.position(tp) == 5
            vector = consumer.vector(tp)
            assert vector.get(first[0].origin) == 5

            consumer.seek(tp, 13)  # inside a batch: the earlier records of that batch are dropped
            got = await consumer.poll(timeout_ms=5000, max_records=3)
            assert [r.offset for r in got] == [13, 14, 15]

            consumer.seek_to_vector(tp, VectorOffset({first[0].origin: 7}))
            got = []
            while len(got) < 13:
                got.extend(await consumer.poll(timeout_ms=5000))
            assert [r.value for r in got] == [b"%d" % i for i in range(7, 20)]
            assert consumer.vector(tp).get(first[0].origin) == 20

            consumer.seek_to_end()
            assert await consumer.poll(timeout_ms=300) == []
            async with Producer(node.address) as producer:
                await producer.send("seek", b"new", partition=0)
            got = await consumer.poll(timeout_ms=5000)
            assert [(r.offset, r.value) for r in got] == [(20, b"new")]

    run(main())


def test_offset_out_of_range(node: NodeProcess) -> None:
    async def main() -> None:
        await create(node.address, "oor", 1)
        async with Producer(node.address) as producer:
            await producer.send("oor", b"only", partition=0)
        async with Consumer(node.address, auto_offset_reset="none") as consumer:
            consumer.assign([("oor", 0)])
            consumer.seek(("oor", 0), 99)
            with pytest.raises(OffsetOutOfRange):
                await consumer.poll(timeout_ms=5000)
        async with Consumer(node.address, auto_offset_reset="earliest") as consumer:
            consumer.assign([("oor", 0)])
            consumer.seek(("oor", 0), 99)
            got = await consumer.poll(timeout_ms=5000)
            assert [r.value for r in got] == [b"only"]

    run(main())


def test_errors_unknown_topic_exists_and_dead_node(node: NodeProcess) -> None:
    async def main() -> None:
        async with Producer(node.address) as producer:
            with pytest.raises(UnknownTopic, match="nope"):
                await producer.send("nope", b"x")
        await create(node.address, "dup", 1)
        with pytest.raises(TopicExists):
            await create(node.address, "dup", 1)
        async with Admin(node.address) as admin:
            with pytest.raises(UnknownTopic):
                await admin.describe_topic("nope")
        with pytest.raises(NodeUnavailable, match=r"127\.0\.0\.1:1 \(connection refused\)"):
            await Admin("127.0.0.1:1").start()

    run(main())


def test_oversized_batch_fails_alone_and_later_records_still_go(node: NodeProcess) -> None:
    async def main() -> None:
        await create(node.address, "small", 1, {"max_batch_bytes": "2000"})
        # batch_size below the big record: it gets a batch of its own
        async with Producer(node.address, linger_ms=50, batch_size=1000) as producer:
            before = producer.send("small", b"before", partition=0)
            await before
            big = producer.send("small", b"x" * 5000, partition=0)
            after = [producer.send("small", b"after-%d" % i, partition=0) for i in range(3)]
            with pytest.raises(RecordTooLarge, match="max_batch_bytes=2000 of topic 'small'; nothing was sent"):
                await big  # refused by the client at once, never sent, never a timeout
            await asyncio.gather(*after)
        # a batch_size above the topic's limit: batches are cut at the limit, and every record goes
        async with Producer(node.address, linger_ms=50, batch_size=1 << 20) as producer:
            await asyncio.gather(*[producer.send("small", b"y" * 100, partition=0) for _ in range(100)])
        got = await read_all(node.address, "small", 1, 104)
        assert [r.value for r in got[:4]] == [b"before", b"after-0", b"after-1", b"after-2"]
        assert len(got) == 104

    run(main())


def test_sync_wrappers(node: NodeProcess) -> None:
    run(create(node.address, "sync", 2))
    with SyncProducer(node.address) as producer:
        futures = [producer.send("sync", b"%d" % i, key=b"%d" % i) for i in range(100)]
        producer.flush()
        metas = [f.result(timeout=10) for f in futures]
    assert {m.partition for m in metas} == {0, 1}
    with SyncConsumer(node.address, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["sync"])
        got: list[ConsumerRecord] = []
        deadline = time.monotonic() + 10
        while len(got) < 100 and time.monotonic() < deadline:
            got.extend(consumer.poll(timeout_ms=500))
        assert sorted(int(r.value) for r in got) == list(range(100))
        for p in (0, 1):
            assert consumer.position(("sync", p)) == sum(1 for m in metas if m.partition == p)


def test_producer_survives_kill9_and_restart_without_loss_or_duplicates(node: NodeProcess) -> None:
    n = 4000

    async def main() -> None:
        await create(node.address, "durable", 2)
        async with Producer(
            node.address, linger_ms=2, batch_size=2048, retry_backoff_ms=50, delivery_timeout_ms=60_000
        ) as producer:
            futures = []
            killer: threading.Thread | None = None
            for i in range(n):
                futures.append(producer.send("durable", b"%06d" % i, key=b"%d" % (i % 13)))
                if i % 100 == 99:
                    await asyncio.sleep(0.005)
                if i == n // 3:
                    # Kill -9 mid-stream; restart on the same port in a thread while the loop keeps sending.
                    node.kill9()
                    killer = threading.Thread(target=lambda: (time.sleep(0.5), node.start()))
                    killer.start()
            await producer.flush()
            assert killer is not None
            killer.join()
            assert producer.reconnects >= 1
            results = await asyncio.gather(*futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        got = await read_all(node.address, "durable", 2, n, timeout_s=20)
        values = [r.value for r in got]
        assert len(values) == len(set(values)) == n, "lost or duplicated records"
        stored = {(r.partition, r.offset): r.value for r in got}
        for i, meta in enumerate(results):
            assert stored[(meta.partition, meta.offset)] == b"%06d" % i
        for p in (0, 1):
            part = [int(r.value) for r in got if r.partition == p]
            assert part == sorted(part)

    run(main())


def test_seek_to_beginning_right_after_subscribe_reads_from_the_start(node) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> list[bytes | None]:
        async with Admin(node.address) as admin:
            await admin.create_topic("sub", 2)
        async with Producer(node.address) as producer:
            for i in range(10):
                producer.send("sub", b"v%d" % i)
            await producer.flush()
        got: list[bytes | None] = []
        async with Consumer(node.address) as consumer:  # default reset: latest
            consumer.subscribe(["sub"])
            consumer.seek_to_beginning()  # before the subscription has resolved its partitions
            for _ in range(20):
                got.extend(r.value for r in await consumer.poll(timeout_ms=200))
                if len(got) == 10:
                    break
        return got

    assert sorted(asyncio.run(scenario())) == sorted(b"v%d" % i for i in range(10))


@pytest.mark.slow
def test_concurrent_producers_flush_after_sends_without_yielding(start_node) -> None:  # type: ignore[no-untyped-def]
    # bench/produce.py's Producer.send row: thousands of send() calls with no
    # await in between and buffer_memory out of the way, then flush(). Several
    # producers at once, at small and large batches; every flush must end in
    # bounded time with every record acknowledged once, in order.
    node = start_node(extra_args=["--flush-interval-ms", "100"])
    records = 8000

    async def one(topic: str, batch_size: int) -> None:
        async with Producer(node.address, batch_size=batch_size, linger_ms=5, buffer_memory=1 << 40) as producer:
            await producer.send(topic, b"first")
            send = producer.send
            futures = [send(topic, b"v" * 1024) for _ in range(records)]
            async with asyncio.timeout(20):
                await producer.flush()
            offsets = [m.offset for m in await asyncio.gather(*futures)]
            assert offsets == list(range(1, records + 1))

    async def main() -> None:
        for round_ in range(3):
            topics = [f"stress-{round_}-{i}" for i in range(4)]
            for topic in topics:
                await create(node.address, topic, 1)
            await asyncio.gather(*(one(t, [65536, 1 << 20][i % 2]) for i, t in enumerate(topics)))

    run(main())
