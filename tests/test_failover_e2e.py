"""The node that leads the most partitions of a three-node site dies (``kill -9``): every partition it led gets a
new leader in one metadata command (``FailOver``, cluster/failover.py), every partition is served again, and no
record acknowledged at ``acks=all`` before or after the kill is lost."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, read_partition, status, wait_for

TOPIC = "wide"
PARTITIONS = 48
Acked = set[tuple[int, str, int, bytes]]  # (partition, origin, origin seq, value)


async def produce_everywhere(bootstrap: str, tag: str, acked: Acked) -> None:
    """One record per partition at ``acks=all``, each acknowledged (or the test fails on its delivery timeout)."""
    async with Producer(bootstrap, acks="all", linger_ms=5, delivery_timeout_ms=90_000) as producer:
        values = [f"{tag}-{p}".encode() for p in range(PARTITIONS)]
        metas = await asyncio.gather(*(producer.send(TOPIC, v, partition=p) for p, v in enumerate(values)))
        for meta, value in zip(metas, values, strict=True):
            acked.add((meta.partition, str(meta.origin), meta.origin_seq, value))


def whole(site: ClusterSite) -> bool:
    """Every partition led by a live node and written on an open segment of three nodes: a kill then leaves two
    members of each, the ack quorum, so every partition can be recovered."""
    answer = status(site)
    return (
        len(answer.partitions) == PARTITIONS
        and all(p.leader_live and len(p.open_ensemble) == 3 for p in answer.partitions)
        and answer.under_replicated_count == 0
    )


def led_by_live_nodes(site: ClusterSite, dead: int | None = None) -> bool:
    """Every partition led by a live node, and none by ``dead`` (which counts as live until its session runs out)."""
    answer = status(site)
    moved = all(n.leader_of == 0 for n in answer.nodes if n.node_id == dead)
    return answer.partition_count == PARTITIONS and answer.leaderless_partitions == 0 and moved


@pytest.mark.slow
def test_killing_the_node_that_leads_most_partitions_moves_them_at_once_and_loses_nothing(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
    acked: Acked = set()
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS), timeout=30)
        wait_for("every partition led", lambda: led_by_live_nodes(site))
        asyncio.run(produce_everywhere(site.address(1), "before", acked))
        wait_for("every partition on three nodes", lambda: whole(site))

        answer = status(site)
        raft_leader = next((n for n in site.nodes if site.raft_ports[n - 1] == _port(answer.raft.leader_address)), 0)
        led = {n.node_id: n.leader_of for n in answer.nodes}
        victim = max((n for n in site.nodes if n != raft_leader), key=lambda n: (led.get(n, 0), n))
        assert led[victim] > 0, f"node {victim} leads nothing: {led}"
        site.nodes[victim].kill9()
        survivors = [n for n in site.nodes if n != victim]

        wait_for("every partition led by a live node again", lambda: led_by_live_nodes(site, victim))
        asyncio.run(produce_everywhere(site.address(survivors[0]), "after", acked))  # every partition serves

        logs = "".join((tmp_path / "a" / str(n) / "node.log").read_text() for n in survivors)
        assert re.search(rf"node {victim}'s \d+ partitions moved to new leaders", logs), "not moved in one command"
        stored: Acked = set()
        for partition in range(PARTITIONS):
            leader = site.wait_leader(TOPIC, partition, not_node=victim)
            records = read_partition(site.address(leader), TOPIC, partition)
            assert len(set(records)) == len(records), f"partition {partition} holds a coordinate twice (I2)"
            stored |= {(partition, o, s, v) for o, s, v in records}
        lost = sorted(acked - stored)
        assert not lost, f"{len(lost)} acknowledged records are lost, e.g. {lost[:3]}"
        assert len(acked) == 2 * PARTITIONS
    finally:
        site.close()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1]) if ":" in address else 0
