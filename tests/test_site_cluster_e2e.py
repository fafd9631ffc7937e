"""A three-node site (RF=3, min-insync=2) of real ``georep node`` processes: its partition leader is killed with
``kill -9`` while a producer writes at ``acks=all``, again and again, and nothing acknowledged is lost.

The producer here speaks the node's gRPC protocol directly (the client library's own routing is tested apart),
so the test sees each answer: ``NOT_LEADER`` naming the leader, ``UNAVAILABLE`` from a dead node, and the
idempotent producer's retries, which the new leader must answer from what the quorum held.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from georep.client.consumer import Consumer
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.storage.replica_store import ReplicaStore
from tests.support.channels import open_channel
from tests.support.cluster_site import TOPIC, ClusterSite, Writer, read_partition


@pytest.mark.slow
def test_killing_partition_leaders_one_after_another_loses_no_acked_write(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "8192"])
    try:
        site.start()
        with open_channel(site.address(2)) as channel:  # any node creates the topic, through Raft
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
        site.wait_leader(TOPIC)
        writer = Writer(site)
        seq = 0
        victims = []
        for _round in range(3):
            for _ in range(25):
                writer.send(seq)
                seq += 1
            victim = site.wait_leader(TOPIC)
            victims.append(victim)
            site.nodes[victim].kill9()
            for _ in range(10):  # written while the victim is down: a two-member quorum of the survivors
                writer.send(seq)
                seq += 1
            site.nodes[victim].start(60)
        for _ in range(10):
            writer.send(seq)
            seq += 1
        leader = site.wait_leader(TOPIC)
        records = read_partition(site.address(leader), TOPIC, 0)
        acked = {(writer.origin, s, v) for s, v in writer.acked}
        stored = set(records)
        assert len(records) == len(stored), "a coordinate is stored twice (I2)"
        lost = sorted(acked - stored)
        assert not lost, f"{len(lost)} acknowledged records are lost, e.g. {lost[:3]}"
        seqs = [s for o, s, _ in records if o == writer.origin]
        assert seqs == list(range(len(seqs))), "the origin's seqs are not 0, 1, 2, ... in log order (I1, I3)"
        assert len(seqs) == len(acked), "records that no producer sent, or a batch stored twice"
        assert len(set(victims)) >= 2, f"the leader never moved to another node: {victims}"
    finally:
        site.close()
    check_copies(tmp_path / "a", [1, 2, 3])


def check_copies(root: Path, nodes: list[int]) -> None:
    """Every node's copy of a segment is a byte-for-byte prefix of the longest copy (one writer per segment), and
    every segment is held by at least two nodes (min-insync)."""
    copies: dict[str, list[bytes]] = {}
    for n in nodes:
        store = ReplicaStore(root / str(n), now_ms=0)
        try:
            for key in store.partitions():
                for sid in store.segment_ids(key):
                    data, offset = b"", store.copy(key, sid).log_start_offset  # type: ignore[union-attr]
                    while True:
                        r = store.read(key, sid, offset, 1 << 20)
                        if not r.data:
                            break
                        data, offset = data + r.data, r.next_offset
                    copies.setdefault(f"{key[0]}-{key[1]}/{sid}", []).append(data)
        finally:
            store.close()
    assert copies, "no segment copies found"
    for name, held in sorted(copies.items()):
        longest = max(held, key=len)
        assert all(longest.startswith(c) for c in held), f"copies of {name} differ: not prefixes of one stream"
        assert len([c for c in held if c]) >= 2 or not longest, f"segment {name} has data on fewer than 2 nodes"


@pytest.mark.slow
def test_producers_follow_partition_leaders_across_kills_and_lose_nothing(tmp_path: Path) -> None:
    """Two client ``Producer``s at ``acks=all`` write to three partitions, each bootstrapped from one node, while
    the leader of partition 0 is killed twice (restarted in between): each batch goes to its partition's leader,
    follows NOT_LEADER and dead leaders, and every acknowledged record is stored exactly once."""
    topic = "events"
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "16384"])
    acked: set[tuple[int, str, int, bytes]] = set()  # (partition, origin, origin seq, value)

    async def produce(name: str, bootstrap: str, stop: asyncio.Event) -> int:
        sent = 0
        async with Producer(bootstrap, acks="all", linger_ms=2, batch_size=2048, delivery_timeout_ms=60_000) as p:
            while not stop.is_set():
                futures = [p.send(topic, f"{name}-{sent + i}".encode(), key=f"k{sent + i}".encode()) for i in range(20)]
                for meta in await asyncio.gather(*futures):
                    acked.add((meta.partition, str(meta.origin), meta.origin_seq, f"{name}-{sent}".encode()))
                    sent += 1
        return sent

    async def drive() -> tuple[int, int]:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(produce("p1", site.address(1), stop)),
            asyncio.create_task(produce("p2", site.address(3), stop)),
        ]
        loop = asyncio.get_running_loop()
        for _ in range(2):
            await asyncio.sleep(1.5)
            victim = await loop.run_in_executor(None, site.wait_leader, topic, 0)
            site.nodes[victim].kill9()
            await asyncio.sleep(2.5)
            await loop.run_in_executor(None, site.nodes[victim].start, 60)
        await asyncio.sleep(1.0)
        stop.set()
        counts = await asyncio.gather(*tasks)
        return counts[0], counts[1]

    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=topic, partitions=3), timeout=30)
        for partition in range(3):
            site.wait_leader(topic, partition)
        sent = asyncio.run(drive())
        assert min(sent) > 100, f"too little was written to prove anything: {sent}"
        stored: set[tuple[int, str, int, bytes]] = set()
        for partition in range(3):
            records = read_partition(site.address(site.wait_leader(topic, partition)), topic, partition)
            assert len(set(records)) == len(records), f"partition {partition} holds a coordinate twice (I2)"
            stored |= {(partition, o, s, v) for o, s, v in records}
        lost = sorted(acked - stored)
        assert not lost, f"{len(lost)} acknowledged records are lost, e.g. {lost[:3]}"
        values = [v for _p, _o, _s, v in stored]
        assert len(values) == len(set(values)), "a record was stored twice (a retry that was not deduplicated)"
        # A consumer bootstrapped from one node reads every partition from its leader, each record once.
        consumed = asyncio.run(consume_all(site.address(2), topic, 3, len(stored)))
        assert sorted(consumed) == sorted(stored), "the consumer did not read exactly what the partitions hold"
    finally:
        site.close()


async def consume_all(bootstrap: str, topic: str, partitions: int, expect: int) -> list[tuple[int, str, int, bytes]]:
    out: list[tuple[int, str, int, bytes]] = []
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, p) for p in range(partitions)])
        deadline = time.monotonic() + 60
        while len(out) < expect and time.monotonic() < deadline:
            for r in await consumer.poll(timeout_ms=500):
                out.append((r.partition, str(r.origin), r.origin_seq, bytes(r.value or b"")))
        out += [
            (r.partition, str(r.origin), r.origin_seq, bytes(r.value or b""))
            for r in await consumer.poll(timeout_ms=300)
        ]  # nothing more may come
    return out
