"""A partition leader frozen with SIGSTOP for longer than its session, then let go on, while an idempotent producer
writes at ``acks=all``: the site names a new leader meanwhile, and the woken one refuses the writes it still gets
(its copy is fenced by the new leader's epoch). The client must treat that refusal as Kafka's producer treats a
stale leader epoch, ask who leads now and send again, so no send fails and nothing is lost or stored twice."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, read_partition

TOPIC = "frozen"
PARTITIONS = 2
SESSION_MS = 500
PAUSES_S = (1.5, 2.0, 1.5)  # each longer than the session: the site names another leader while the victim sleeps


@pytest.mark.slow
def test_an_idempotent_producer_writes_through_frozen_leaders_without_a_failed_send(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", str(SESSION_MS)])
    sent: list[bytes] = []
    acked: set[tuple[int, str, int, bytes]] = set()  # (partition, origin, origin seq, value)
    failed: list[str] = []

    async def produce(stop: asyncio.Event) -> None:
        bootstrap = [site.address(n) for n in site.nodes]
        async with Producer(bootstrap, acks="all", linger_ms=2, batch_size=2048, delivery_timeout_ms=120_000) as p:
            while not stop.is_set():
                values = [f"r{len(sent) + i}".encode() for i in range(20)]
                sent.extend(values)
                futures = [p.send(TOPIC, v, key=v) for v in values]
                for value, outcome in zip(values, await asyncio.gather(*futures, return_exceptions=True), strict=True):
                    if isinstance(outcome, BaseException):
                        failed.append(f"{value.decode()}: {type(outcome).__name__}: {outcome}")
                    else:
                        acked.add((outcome.partition, str(outcome.origin), outcome.origin_seq, value))

    async def drive() -> list[int]:
        stop = asyncio.Event()
        task = asyncio.create_task(produce(stop))
        loop = asyncio.get_running_loop()
        victims = []
        for pause_s in PAUSES_S:
            await asyncio.sleep(1.0)
            victim = await loop.run_in_executor(None, site.wait_leader, TOPIC, 0)
            victims.append(victim)
            os.kill(site.nodes[victim].pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(pause_s)
            finally:
                os.kill(site.nodes[victim].pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        stop.set()
        await task
        return victims

    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS), timeout=30)
        for partition in range(PARTITIONS):
            site.wait_leader(TOPIC, partition)
        victims = asyncio.run(drive())
        assert not failed, f"{len(failed)} of {len(sent)} sends failed to the application, e.g. {failed[:3]}"
        stored = read_back(site, acked)
    finally:
        for node in site.nodes.values():  # never leave a stopped process behind
            if node.alive():
                os.kill(node.pid, signal.SIGCONT)
        site.close()
    values = sorted(v for _p, _o, _s, v in stored)
    assert len(values) == len(set(values)), "a record was stored twice (a resend that was not deduplicated)"
    lost = sorted(acked - set(stored))
    assert not lost, f"{len(lost)} acknowledged records are lost, e.g. {lost[:3]}"
    assert set(values) == set(sent), "the site holds other records than the ones sent"
    assert len(sent) > 200, f"too little was written to prove anything: {len(sent)}"
    assert victims, "no leader was frozen"


def majority_leader(site: ClusterSite, partition: int) -> str | None:
    """The address that most nodes' metadata names as the partition's leader. A leader that wakes up from a pause
    still serves what it held until its metadata replica catches up, so the node that claims the partition is not
    asked (tests/support/cluster_site.py's ``leader``): a read there could end at the deposed leader's old end."""
    named: Counter[str] = Counter()
    for _, d in site.descriptions(TOPIC):
        named.update(leader.address for leader in d.leaders if leader.partition == partition and leader.address)
    top = named.most_common(1)
    return top[0][0] if top and top[0][1] * 2 > len(site.nodes) else None


def read_back(site: ClusterSite, acked: set[tuple[int, str, int, bytes]]) -> list[tuple[int, str, int, bytes]]:
    """Every partition read at its leader, again until it holds every acknowledged record or 30 s have passed."""
    deadline = time.monotonic() + 30
    while True:
        stored: list[tuple[int, str, int, bytes]] = []
        for partition in range(PARTITIONS):
            address = majority_leader(site, partition) or site.address(site.wait_leader(TOPIC, partition))
            stored += [(partition, o, s, v) for o, s, v in read_partition(address, TOPIC, partition)]
        if acked <= set(stored) or time.monotonic() > deadline:
            return stored
        time.sleep(0.2)
