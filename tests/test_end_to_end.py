"""Real processes end to end: 100k records through the CLI and the client, and kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from georep.cli.demo import produce_through_crash
from georep.client import Admin, Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import check_batch, decode_records
from georep.server.process import NodeProcess
from tests.support.channels import open_channel

pytestmark = pytest.mark.slow


def cli(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def read_partition(address: str, topic: str, partition: int) -> list[tuple[int, bytes | None, int]]:
    """(offset, value, origin_seq) of every record, read with raw gRPC and checked batch by batch."""
    with open_channel(address) as channel:
        stub = pbg.NodeStub(channel)
        end = (
            stub.ListOffsets(pb.ListOffsetsRequest(topic=topic, partition=partition, position=pb.START_LATEST))
            .offsets[0]
            .offset
        )
        out: list[tuple[int, bytes | None, int]] = []
        if end == 0:
            return out
        stream = stub.Fetch(pb.FetchRequest(topic=topic, partition=partition, offset=0, max_wait_ms=100))
        for resp in stream:
            data = resp.batches
            pos = 0
            while pos < len(data):
                header = check_batch(data, pos)  # a partial or corrupt batch fails here
                out.extend(
                    (r.offset, r.value, r.origin_seq) for r in decode_records(data[pos : pos + header.size_bytes])
                )
                pos += header.size_bytes
            if resp.next_offset >= end:
                stream.cancel()
                break
    return out


def test_100k_records_through_cli_and_client_come_back_complete_and_in_order(node: NodeProcess) -> None:
    boot = ["--bootstrap", node.address]
    assert cli("topic", "create", "load", "--partitions", "4", *boot).returncode == 0

    cli_values = [f"cli-{i}" for i in range(50_000)]
    lines = "".join(f"key-{i % 13}:{v}\n" for i, v in enumerate(cli_values)).encode()
    proc = cli("produce", "load", "--key-separator", ":", *boot, stdin=lines)
    assert proc.returncode == 0, proc.stderr.decode()

    async def produce() -> None:
        async with Producer(node.address, linger_ms=5) as producer:
            for i in range(50_000):
                producer.send("load", b"client-%d" % i, key=b"key-%d" % (i % 13))
                if i % 5_000 == 0:
                    await producer.wait_for_buffer()
            await producer.flush()

    asyncio.run(produce())

    proc = cli("consume", "load", "--from-beginning", "--json", "--timeout", "5", *boot)
    assert proc.returncode == 0, proc.stderr.decode()
    records = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(records) == 100_000
    assert {r["value"] for r in records} == set(cli_values) | {f"client-{i}" for i in range(50_000)}

    by_partition: dict[int, list[dict[str, object]]] = defaultdict(list)
    for r in records:
        by_partition[int(r["partition"])].append(r)  # type: ignore[call-overload]
    for partition, rs in by_partition.items():
        assert [r["offset"] for r in rs] == list(range(len(rs))), f"partition {partition} has gaps or disorder"
        assert [r["origin_seq"] for r in rs] == list(range(len(rs)))
    # Records with one key land in one partition, in the order they were sent.
    for source in ("cli", "client"):
        per_key: dict[str, list[int]] = defaultdict(list)
        partitions: dict[str, set[int]] = defaultdict(set)
        for r in records:
            value = str(r["value"])
            if value.startswith(source + "-"):
                per_key[str(r["key"])].append(int(value.split("-")[1]))
                partitions[str(r["key"])].add(int(r["partition"]))  # type: ignore[call-overload]
        assert all(len(p) == 1 for p in partitions.values())
        assert all(seq == sorted(seq) for seq in per_key.values())


def test_kill9_during_sustained_produce_keeps_every_acked_record_exactly_once(node: NodeProcess) -> None:
    async def scenario() -> None:
        async with Admin(node.address) as admin:
            await admin.create_topic("crash", 1)  # default flush_interval_ms=0: fsync per batch
        report = await produce_through_crash(node, "crash", 20_000, kill_after_acked=5_000)
        assert report.kill_after_acked >= 5_000
        assert report.ok, report

    asyncio.run(scenario())
    # Independent count, straight from the node with raw gRPC and CRC checks.
    records = read_partition(node.address, "crash", 0)
    values = Counter(v for _, v, _ in records)
    assert set(values) == {b"crash-%d" % i for i in range(20_000)}
    assert max(values.values()) == 1
    assert [seq for _, _, seq in records] == list(range(len(records)))


def test_kill9_without_retries_loses_no_acked_record(node: NodeProcess) -> None:
    """A producer that gives up at the kill: what it saw acked must all be there."""

    async def scenario() -> set[bytes]:
        async with Admin(node.address) as admin:
            await admin.create_topic("crash", 1)
        acked: set[bytes] = set()
        producer = Producer(node.address, linger_ms=1, batch_size=8_192, delivery_timeout_ms=1_000)
        await producer.start()
        futures = {}
        for i in range(200_000):
            value = b"v-%d" % i
            fut = producer.send("crash", value)
            fut.add_done_callback(lambda f, v=value: acked.add(v) if not f.exception() else None)
            futures[value] = fut
            if i % 1_000 == 0:
                await asyncio.sleep(0.002)
            if len(acked) >= 3_000:
                node.kill9()
                break
        await asyncio.gather(*futures.values(), return_exceptions=True)
        await producer.close()
        return acked

    acked = asyncio.run(scenario())
    node.start()
    values = Counter(v for _, v, _ in read_partition(node.address, "crash", 0))
    assert acked <= set(values)
    assert max(values.values()) == 1
