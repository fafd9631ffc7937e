"""Three nodes of one site lead a partition together (georep/server/cluster_member.py): real Raft (pysyncobj),
real gRPC between them, real disks; one process, so that a node can be stopped at any point.

A node here is what ``georep node`` will run for a multi-node site: a ``RaftMetadataStore``, a ``ReplicaStore``
served by ``SegmentService`` on its own port, and a ``ClusterMember`` driving them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster.site_state import CreateTopic
from georep.broker.errors import NotLeader
from georep.metadata.topics import TopicSpec
from georep.raft.store import RaftMetadataStore
from georep.record.batch import iter_headers, local_prefix
from georep.server.cluster_member import ClusterConfig, ClusterMember, PartitionLeader
from georep.server.segments import SegmentService
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import Origin
from tests.support.channels import add_port
from tests.support.ports import free_ports
from tests.support.raft import FAST
from tests.support.segments import make_batch
from topology.ids import NodeId, SegmentId, SiteId

CONFIG = ClusterConfig(
    replication_factor=3,
    ack_quorum=2,
    session_timeout_ms=2_000,
    tick_ms=100,
    segment_bytes=16 << 10,
    roll_wait_ms=1_000,
    retry_ms=100,
)
KEY = ("t", 0)
ORIGIN = Origin(SiteId("a"), 7)
WAIT_S = 30.0


class Node:
    """One node of the site, in this process."""

    def __init__(self, me: NodeId, raft: str, raft_all: list[str], data_dir: Path) -> None:
        self.me = me
        self.data_dir = data_dir
        self.metadata = RaftMetadataStore(raft, raft_all, data_dir, FAST)  # in the main thread (pysyncobj)
        self.store = ReplicaStore(data_dir, now_ms=0)
        self.executor = ThreadPoolExecutor(4)
        self.server: grpc.aio.Server | None = None
        self.member: ClusterMember | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((SegmentService(self.store, self.executor, now_ms).handler(),))
        port = add_port(self.server, "127.0.0.1:0")
        await self.server.start()
        self.member = ClusterMember(
            self.me, f"127.0.0.1:{port}", self.metadata, self.store, self.executor, now_ms, lambda: 1 << 40, CONFIG
        )
        await self.member.start()

    async def stop(self) -> None:
        """As a crash looks to the others: the node stops answering, heartbeating and voting."""
        if self.member is not None:
            await self.member.stop()
        if self.server is not None:
            await self.server.stop(None)
        self.metadata.close(snapshot=False)
        self.executor.shutdown(wait=True)
        self.store.close()


def now_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


async def wait_for(what: str, check: Callable[[], object], timeout_s: float = WAIT_S) -> object:
    async with asyncio.timeout(timeout_s):
        while not (found := check()):
            await asyncio.sleep(0.05)
    return found


def site_of(count: int, tmp_path: Path) -> dict[NodeId, Node]:
    """``count`` nodes of one site, each with its Raft address and data dir under ``tmp_path``; not started."""
    rafts = [f"127.0.0.1:{p}" for p in free_ports(count)]
    return {NodeId(i + 1): Node(NodeId(i + 1), rafts[i], rafts, tmp_path / f"node-{i + 1}") for i in range(count)}


async def start_site(nodes: dict[NodeId, Node]) -> None:
    """Start every node and wait until the site's Raft group has a leader."""
    for node in nodes.values():
        await node.start()
    await wait_for("a Raft leader", lambda: any(n.metadata.is_leader for n in nodes.values()))


def writing_leader(nodes: dict[NodeId, Node]) -> PartitionLeader | None:
    for node in nodes.values():
        lead = node.member.leaders.get(KEY) if node.member is not None else None
        if lead is not None and lead.writer is not None and not lead._rolling:
            return lead
    return None


async def produce(lead: PartitionLeader, seq: int, records: int = 4) -> int:
    """One batch of ``records`` records at the leader's end, acks=all; returns its end offset."""
    values = [f"{seq + i}".encode().ljust(400, b"x") for i in range(records)]
    b = make_batch(ORIGIN, seq, values)
    base = lead.end_offset()
    batch = local_prefix(base, b.header.batch_length, now_ms(), b.header.crc) + b.covered
    _, end = await lead.append(batch)
    await lead.confirmed(end)
    return end


@pytest.mark.slow
def test_a_site_of_four_nodes_elects_writes_rolls_and_survives_its_leader(tmp_path: Path) -> None:
    """Four nodes, RF=3, min-insync=2: a segment opens on three live nodes (as a BookKeeper ledger needs its
    ensemble), so with one node dead the site still places new segments."""
    nodes = site_of(4, tmp_path)

    async def run() -> None:
        try:
            await start_site(nodes)
            any_node = nodes[NodeId(1)]
            await any_node.member.propose(CreateTopic(TopicSpec("t", 1)))  # type: ignore[union-attr]
            lead = await wait_for("a leader writing t-0", lambda: writing_leader(nodes))
            assert isinstance(lead, PartitionLeader)
            acked: list[int] = []  # end offsets acknowledged at acks=all
            seq = 0
            while len(acked) < 30:  # 30 x ~1.7 KB: past segment_bytes, so the leader rolls at least once
                try:
                    acked.append(await produce(lead, seq))
                    seq += 4
                except NotLeader:  # a roll cut this batch: send it again to the (same) leader
                    lead = await wait_for("the leader writing again", lambda: writing_leader(nodes))  # type: ignore[assignment]
            state = any_node.metadata.state().partition(*KEY)
            assert state is not None and len(state.segments) >= 2, state  # rolled
            for seg in state.segments[:-1]:
                assert seg.sealed and seg.end_offset is not None and seg.end_vector is not None
            # the leader dies
            old = next(n for n in nodes.values() if n.member is not None and KEY in n.member.leaders)
            await old.stop()
            del nodes[old.me]
            new_lead = await wait_for("a new leader writing t-0", lambda: writing_leader(nodes))
            assert isinstance(new_lead, PartitionLeader) and new_lead.epoch > lead.epoch
            info = new_lead.member.metadata.state().partition(*KEY)  # its view holds its own open segment
            assert info is not None
            sealed = [s for s in info.segments if s.sealed]
            # every acked write is below the sealed end of the chain, and the next segment starts there
            assert max(acked) <= sealed[-1].end_offset  # type: ignore[operator]
            assert info.open_segment is not None and info.open_segment.base_offset == sealed[-1].end_offset
            # each survivor holds the chain's segments it is a member of, byte for byte the same
            for seg in sealed:
                copies = []
                for n in nodes.values():
                    if n.me in seg.ensemble and seg.segment_id in n.store.segment_ids(KEY):
                        data = n.store.read(
                            KEY, SegmentId(seg.segment_id), seg.base_offset, 1 << 24, seg.end_offset
                        ).data
                        copies.append(data)
                        assert iter_headers(data)[-1].next_offset == seg.end_offset
                assert copies and all(c == copies[0] for c in copies)
            # and the new leader takes writes in the new epoch, at acks=all with two nodes left
            await produce(new_lead, 10_000)
        finally:
            for node in nodes.values():
                await node.stop()

    asyncio.run(run())


@pytest.mark.slow
def test_the_controller_moves_a_dead_nodes_partitions_while_its_disk_threads_are_busy(tmp_path: Path) -> None:
    """At 5,000 partitions a controller's tick waited in its seal pass for the store's threads, queued behind
    thousands of segment opens: a dead node's partitions kept their dead leader for 30 s. The controller's duties
    (noticing the death, proposing the failover) go through the metadata's threads only."""
    nodes = site_of(3, tmp_path)
    release = threading.Event()

    async def run() -> None:
        try:
            await start_site(nodes)
            ctl = next(n for n in nodes.values() if n.metadata.is_leader)
            await ctl.member.propose(CreateTopic(TopicSpec("t", 6)))  # type: ignore[union-attr]
            await wait_for("every partition led", lambda: all(i.leader for i in ctl.metadata.state().partitions()))
            victim = next(i.leader for i in ctl.metadata.state().partitions() if i.leader != ctl.me)
            for _ in range(4):  # every disk thread of the controller's node busy, as behind a burst of opens
                ctl.executor.submit(release.wait)
            await ctl.member.propose(CreateTopic(TopicSpec("u", 1)))  # type: ignore[union-attr]  # a new version
            await nodes[victim].stop()
            del nodes[victim]

            def moved() -> bool:
                return all(i.leader not in (None, victim) for i in ctl.metadata.state().partitions())

            await wait_for(
                f"node {victim}'s partitions led by live nodes", moved, timeout_s=6 * CONFIG.session_timeout_ms / 1000
            )
        finally:
            release.set()
            for node in nodes.values():
                await node.stop()

    asyncio.run(run())


@pytest.mark.slow
def test_a_node_heartbeats_while_its_event_loop_is_busy(tmp_path: Path) -> None:
    """A survivor of a kill at 10,000 partitions runs recovery callbacks for seconds on end: a heartbeat that waited
    for its event loop committed late, and the controller took the busy node for dead and moved its partitions too.
    The heartbeats come from a thread of their own."""
    import time

    nodes = site_of(3, tmp_path)

    async def run() -> None:
        try:
            await start_site(nodes)
            busy = nodes[NodeId(1)]
            blocked_at = now_ms()

            def beat_since_blocked() -> bool:
                info = busy.metadata.state().node(busy.me)
                return info is not None and info.last_heartbeat_ms is not None and info.last_heartbeat_ms > blocked_at

            deadline = time.monotonic() + WAIT_S
            while not beat_since_blocked() and time.monotonic() < deadline:
                time.sleep(0.05)  # blocks the event loop on purpose: nothing async runs meanwhile
            assert beat_since_blocked(), "no heartbeat committed while the node's event loop was busy"
        finally:
            for node in nodes.values():
                await node.stop()

    asyncio.run(run())
