"""A node added to a running three-node site under load takes new segments at the next roll of each partition,
and no byte of the old segments moves (as a new BookKeeper bookie or MapR node does; Kafka would have to copy
whole partitions).

The three run from a topology that lists only them, so their Raft group is the three; the fourth starts, once they
are writing, from a topology that lists four, and joins the running group (docs/cluster.md, "Expansion"). An old
node restarted afterwards, still with its list of three, counts four Raft members."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.storage.replica_store import ReplicaStore
from tests.support.channels import open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import ClusterSite, consume_all, read_partition, site_toml

TOPIC = "grow"
PARTITIONS = 2


def segment_ids(root: Path, node: int) -> dict[tuple[str, int], list[int]]:
    store = ReplicaStore(root / "a" / str(node), now_ms=0)
    try:
        return {key: [int(s) for s in store.segment_ids(key)] for key in store.partitions() if key[0] == TOPIC}
    finally:
        store.close()


def raft_total(address: str) -> int:
    return int(json.loads(ok(georep("cluster", "status", "--json", "--bootstrap", address)))["raft"]["total_nodes"])


@pytest.mark.slow
def test_a_fourth_node_joins_the_running_site_and_takes_new_segments_at_the_next_roll_with_nothing_moved(
    tmp_path: Path,
) -> None:
    site = ClusterSite(tmp_path, 4, extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "32768"])
    three = tmp_path / "topology-of-three.toml"  # what the running nodes were started with
    three.write_text(site_toml("a", site.grpc_ports[:3], site.raft_ports[:3]))
    for n in (1, 2, 3):
        args = site.nodes[n].extra_args
        args[args.index("--topology") + 1] = str(three)
    try:
        for n in (1, 2, 3):
            site.nodes[n].launch()
        for n in (1, 2, 3):
            site.nodes[n].wait_ready(60)
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS), timeout=30)
        for p in range(PARTITIONS):
            site.wait_leader(TOPIC, p)
        assert raft_total(site.address(1)) == 3
        acked, before, joined_at = asyncio.run(_join_under_load(site))
        assert acked > 0 and len(before) == len(joined_at) == PARTITIONS
        _node4_took_segments_and_serves_follower_reads(site)
        # The membership is the Raft group's, kept in each node's journal and dump: an old node restarted with its
        # topology of three still counts four members, and so does every other
        site.nodes[1].restart(60)
        assert raft_total(site.address(1)) == 4
        assert raft_total(site.address(2)) == 4
    finally:
        for node in site.nodes.values():  # all at once: each may take seconds to stop its streams
            if node.alive():
                assert node.proc is not None
                node.proc.terminate()
        site.close()
    held = segment_ids(tmp_path, 4)
    assert sorted(held) == sorted(before), f"node 4 holds segments of {sorted(held)}, not of every partition"
    for key, ids in held.items():
        # Nothing was copied to node 4: every segment it holds was opened after it started; and it took one at
        # the partition's next roll after it was live (the segment after the one open then, or that one).
        assert min(ids) > before[key], f"{key}: node 4 holds {ids}, older than {before[key]} open at its start"
        assert min(ids) <= joined_at[key] + 1, (
            f"{key}: node 4's first segment {min(ids)} came later than the roll "
            f"after {joined_at[key]}, the segment open when it was live"
        )


def _cluster_status(site: ClusterSite, node: int) -> Any:
    return json.loads(
        ok(georep("cluster", "status", "--json", "--partitions", "--all", "--bootstrap", site.address(node)))
    )


def _open_segments(site: ClusterSite) -> dict[tuple[str, int], int]:
    return {
        (p["topic"], p["partition"]): p["open_segment"]["segment_id"]
        for p in _cluster_status(site, 1)["partitions"]
        if p["topic"] == TOPIC and p["open_segment"] is not None
    }


async def _join_under_load(site: ClusterSite) -> tuple[int, dict[tuple[str, int], int], dict[tuple[str, int], int]]:
    """Node 4 starts while a producer writes: the records acked, and each partition's open segment before node 4
    started and once it was live in the site's metadata."""
    stop = asyncio.Event()

    async def produce() -> int:
        acked = 0
        async with Producer(site.address(1), acks="all", linger_ms=2, batch_size=2048) as producer:
            while not stop.is_set():
                futures = [producer.send(TOPIC, b"x" * 200, key=b"%d" % i) for i in range(50)]
                await asyncio.gather(*futures)
                acked += len(futures)
        return acked

    task = asyncio.create_task(produce())
    await asyncio.sleep(1.5)
    before = _open_segments(site)
    await asyncio.get_running_loop().run_in_executor(None, site.nodes[4].start, 60)
    joined_at = _open_segments(site)  # node 4 serves, registered and heartbeating: live in the site's metadata
    joined = time.monotonic()
    while time.monotonic() - joined < 30:  # under load, every partition rolls within a few seconds
        new = {n["node"]: n["segments"] for n in _cluster_status(site, 1)["nodes"]}
        if new.get(4, 0) >= PARTITIONS:
            break
        await asyncio.sleep(0.3)
    stop.set()
    return await task, before, joined_at


def _node4_took_segments_and_serves_follower_reads(site: ClusterSite) -> None:
    status = _cluster_status(site, 4)
    assert status["raft"]["total_nodes"] == 4, status["raft"]
    assert {n["node"]: n["address"] for n in status["nodes"]}[4] == site.address(4)
    node4 = next(n for n in status["nodes"] if n["node"] == 4)
    assert node4["live"] and node4["segments"] >= PARTITIONS, f"node 4 took no new segments: {node4}"
    assert status["under_replicated"] == [], status["under_replicated"]
    # Nothing was copied to the new node (the caller checks it holds only segments opened after it joined). The old
    # nodes may count a few bytes of their own: a roll under load seals at the LAC, and repair fills the member that
    # held less of the sealed segment than that (a segment it already belonged to; nothing to do with the join).
    assert node4["bytes_moved"] == 0, f"bytes were copied to the node that joined: {node4}"
    # Follower reads at the new node: it holds only the segments opened since it joined, so it reads the older
    # ones from their members (or sends the consumer to the leader), and serves exactly what the leader does.
    served_by_follower = 0
    for p in range(PARTITIONS):
        expected = read_partition(site.address(site.wait_leader(TOPIC, p)), TOPIC, p)
        got, from_follower = asyncio.run(consume_all(site.address(1), site.address(4), len(expected), TOPIC, p))
        assert got == expected, f"{TOPIC}-{p} read at node 4 differs from its leader's"
        served_by_follower += from_follower
    assert served_by_follower > 0, "node 4 served no follower read"
