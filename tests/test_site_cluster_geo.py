"""A three-node site ``a`` and a one-node site ``b`` replicate both ways (links a->b and b->a) while producers
write at both and ``a``'s partition leader is killed with ``kill -9``: both sites end with the same records, each
once, in per-origin order (I1-I4), and ``acks=geo:2`` at either site is released only once both hold the batch.

Every node of ``a`` pulls from ``b`` the partitions it leads; ``b`` pulls all of ``a`` over one stream from one
node of ``a``, which passes on the pulls of the partitions other nodes lead."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, beside, read_partition
from tests.support.ports import free_ports

TOPIC = "geo"
PARTITIONS = 2


@pytest.mark.slow
def test_a_multi_node_site_replicates_both_ways_through_a_leader_kill(tmp_path: Path) -> None:
    b_port = free_ports(1)[0]
    more = (
        f'[sites.b]\nnodes = ["127.0.0.1:{b_port}"]\n[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\n'
    )
    extra = ["--session-timeout-ms", "1500", "--segment-bytes-max", "16384"]
    site_a = ClusterSite(tmp_path, 3, extra_args=extra, more_toml=more)
    b = beside(site_a, "b", tmp_path / "b", b_port)
    acked: dict[str, set[tuple[int, str, int]]] = {"a": set(), "b": set()}

    async def produce(site: str, bootstrap: str, acks: str, stop: asyncio.Event) -> None:
        n = 0
        async with Producer(
            bootstrap, acks=acks, linger_ms=2, batch_size=1024, delivery_timeout_ms=60_000, request_timeout_ms=20_000
        ) as producer:
            while not stop.is_set():
                futures = [producer.send(TOPIC, f"{site}-{n + i}".encode(), key=f"{n + i}".encode()) for i in range(10)]
                for meta in await asyncio.gather(*futures):
                    acked[site].add((meta.partition, str(meta.origin), meta.origin_seq))
                n += 10

    async def drive() -> None:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(produce("a", site_a.address(1), "geo:2", stop)),
            asyncio.create_task(produce("b", b.address, "geo:2", stop)),
        ]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(2.0)
        victim = await loop.run_in_executor(None, site_a.wait_leader, TOPIC, 0)
        site_a.nodes[victim].kill9()
        await asyncio.sleep(3.0)
        await loop.run_in_executor(None, site_a.nodes[victim].start, 60)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*tasks)

    try:
        site_a.start()
        b.start()
        with open_channel(b.address) as channel:  # created at b: the links carry it to a
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS), timeout=30)
        for partition in range(PARTITIONS):
            site_a.wait_leader(TOPIC, partition, timeout_s=60)
        asyncio.run(drive())
        assert min(len(v) for v in acked.values()) > 50, {k: len(v) for k, v in acked.items()}
        deadline = time.monotonic() + 60
        while True:  # I4: writes stopped, links up: both sites converge
            held = {}
            for partition in range(PARTITIONS):
                leader = site_a.address(site_a.wait_leader(TOPIC, partition))
                held[("a", partition)] = read_partition(leader, TOPIC, partition)
                held[("b", partition)] = read_partition(b.address, TOPIC, partition)
            if all(sorted(held[("a", p)]) == sorted(held[("b", p)]) for p in range(PARTITIONS)):
                break
            assert time.monotonic() < deadline, "sites a and b did not converge within 60 s"
            time.sleep(0.5)
        for (site, _partition), records in held.items():
            coordinates = [(o, s) for o, s, _v in records]
            assert len(coordinates) == len(set(coordinates)), f"site {site} holds a coordinate twice (I2)"
            for origin in {o for o, _s in coordinates}:
                seqs = [s for o, s in coordinates if o == origin]
                assert seqs == list(range(len(seqs))), f"{origin} at site {site}: not a gap-free prefix in order"
        stored = {(p, o, s) for (_site, p), records in held.items() for o, s, _v in records}
        for site, acks in acked.items():
            lost = sorted(acks - stored)
            assert not lost, f"{len(lost)} records acked at geo:2 by site {site} are missing, e.g. {lost[:3]}"
    finally:
        b.stop()
        site_a.close()
