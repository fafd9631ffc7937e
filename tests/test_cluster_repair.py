"""Repair and decommission on a multi-node site (georep/server/site_repair.py, cluster/repair.py).

What an operator relies on: a node that was down comes back to a site whose every sealed segment is again on
``replication_factor`` nodes holding byte-identical copies (the ones written while it was down, on two nodes,
included); and a decommissioned node ends holding nothing the site needs, while writes go on. Below the
end-to-end runs (real ``georep node`` processes, ``kill -9``), the pieces they rest on: the pure moves of
leaderships off draining nodes and the drain's progress, and a node's copy of a sealed segment, which stores only
whole batches whose CRCs check, at its end, never past the seal, and answers only once fsynced.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster.placement import NodeLoad
from cluster.quorum import NotContiguous, SegmentSealed
from cluster.repair import LeadershipStuck, LeaderView, MoveLeadership, SegmentView, drain_status, plan_leader_moves
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.rpc import LEADER_METADATA
from georep.server.segments import SegmentService
from georep.server.site_repair import CopyFailed, SealedRange, copy_in
from georep.storage.api import LogConfig
from georep.storage.moved_bytes import MOVED_FILE, MovedBytesCorrupt
from georep.storage.replica_store import CorruptReplicaChunk, PastSealedEnd, ReplicaError, ReplicaStore
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, OriginSeq
from tests.support.channels import add_port, open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import TOPIC, WAIT_S, ClusterSite, produce, status, wait_for
from tests.support.segments import A, B, Writer, read_all
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))
KEY = ("orders", 0)
SEG = SegmentId(5)
BASE = 300
E3 = LeaderEpoch(3)


def node(n: NodeId, *, alive: bool = True, draining: bool = False, load: int = 0) -> NodeLoad:
    return NodeLoad(n, 100 << 30, load, alive, draining)


# -- leaderships off draining nodes (pure) ------------------------------------------------------------------------


def test_a_draining_leader_hands_its_partition_to_a_healthy_member_of_the_open_segment() -> None:
    nodes = [node(N1, draining=True), node(N2, alive=False), node(N3), node(N4)]
    moves = plan_leader_moves([LeaderView("t", 0, N1, 7, (N1, N2, N3))], nodes)
    assert moves == (MoveLeadership("t", 0, N1, N3, 7),), "only node 3 is a live, non-draining member"
    assert "draining" in moves[0].message()


def test_moves_spread_over_the_nodes_that_lead_least_and_leave_others_alone() -> None:
    nodes = [node(N1, draining=True), node(N2), node(N3), node(N4)]
    views = [LeaderView("t", p, N1, 1, (N1, N2, N3, N4)) for p in range(4)]
    views.append(LeaderView("u", 0, N2, 1, (N2, N3)))  # led by a healthy node: not moved
    views.append(LeaderView("u", 1, None, 0, None))  # no leader: the election's case
    moves = plan_leader_moves(views, nodes)
    assert all(isinstance(m, MoveLeadership) for m in moves)
    targets = [m.to for m in moves if isinstance(m, MoveLeadership)]
    assert [(m.topic, m.partition) for m in moves] == [("t", 0), ("t", 1), ("t", 2), ("t", 3)]
    assert sorted(targets) == [N2, N3, N3, N4] and targets[0] == N3, "fewest partitions led first (2 leads u/0)"


def test_a_leadership_with_nowhere_to_go_is_reported_and_a_partition_with_nothing_open_may_go_anywhere() -> None:
    nodes = [node(N1, draining=True), node(N2, draining=True), node(N3, alive=False), node(N4)]
    moves = plan_leader_moves([LeaderView("t", 0, N1, 2, (N1, N2, N3)), LeaderView("t", 1, N1, 2, None)], nodes)
    assert isinstance(moves[0], LeadershipStuck) and "bring one back" in moves[0].message()
    assert moves[1] == MoveLeadership("t", 1, N1, N4, 2)
    dead_leader = plan_leader_moves([LeaderView("t", 0, N3, 2, (N3, N4))], nodes)
    assert dead_leader == (), "a dead leader is replaced by the election, not moved"


def test_a_drain_is_done_once_no_segment_names_the_node_and_it_leads_nothing() -> None:
    segments = [
        SegmentView("t", 0, SegmentId(0), (N1, N2, N3), True, 10),
        SegmentView("t", 0, SegmentId(1), (N2, N3, N1), False, 5),
        SegmentView("t", 1, SegmentId(0), (N2, N3, N4), True, 10),
    ]
    leaders = [LeaderView("t", 0, N2, 1, (N2, N3, N1)), LeaderView("t", 1, N1, 1, None)]
    status = drain_status(N1, True, segments, leaders)
    assert (status.sealed_segments, status.open_segments, status.leader_of, status.drained) == (1, 1, 1, False)
    assert "1 sealed and 1 open" in status.message()
    assert drain_status(N4, True, segments, leaders).drained is False, "it still holds t/1 segment 0"
    done = drain_status(N4, True, segments[:2], leaders)
    assert done.drained and "drained" in done.message()
    assert not drain_status(N4, False, segments[:2], leaders).drained, "a node not draining is not drained"


# -- a node's copy of a sealed segment --------------------------------------------------------------------------


def source_batches(tmp_path: Path, count: int) -> tuple[list[bytes], int]:
    """A member's batches of segment 5 from offset 300, as stored (local prefixes set), and their end."""
    log = SegmentLog.create_at(tmp_path / "source-log", LogConfig(), BASE, {A: OriginSeq(9)}, 0)
    w = Writer(log, next_seq={A: 9})
    for i in range(count):
        w.append((A, B)[i % 2], 1 + i % 3, value_bytes=150)
    batches, end = read_all(log), log.log_end_offset
    log.close()
    return batches, end


def test_a_sealed_copy_holds_the_members_bytes_and_refuses_a_leader(tmp_path: Path) -> None:
    batches, end = source_batches(tmp_path, 6)
    store = ReplicaStore(tmp_path / "target", now_ms=0)
    assert store.open_sealed_copy(KEY, SEG, BASE, {A: OriginSeq(9)}, now_ms=0) == BASE
    assert store.append_sealed_copy(KEY, SEG, end, b"".join(batches[:2])) < end
    store.append_sealed_copy(KEY, SEG, end, b"".join(batches[2:]))
    assert store.flush(KEY, SEG) == end
    with pytest.raises(SegmentSealed):  # no leader appends to a segment the site sealed
        store.append(KEY, E3, SEG, batches[0])
    copy = store.read(KEY, SEG, store.copy(KEY, SEG).log_start_offset, 1 << 20)  # type: ignore[union-attr]
    assert copy.data == b"".join(batches), "the copy is the member's bytes, local prefixes included"
    assert store.open_sealed_copy(KEY, SEG, BASE, {A: OriginSeq(9)}, now_ms=0) == end, "again: it goes on from its end"
    store.close()


def test_a_sealed_copy_stores_nothing_of_a_bad_chunk(tmp_path: Path) -> None:
    batches, end = source_batches(tmp_path, 4)
    store = ReplicaStore(tmp_path / "target", now_ms=0)
    with pytest.raises(ReplicaError, match="not sealed"):  # a copy that skipped open_sealed_copy
        store.open_segment(KEY, E3, SEG, BASE, {A: OriginSeq(9)}, now_ms=0)
        store.append_sealed_copy(KEY, SEG, end, batches[0])
    store.close()
    store = ReplicaStore(tmp_path / "target2", now_ms=0)
    store.open_sealed_copy(KEY, SEG, BASE, {A: OriginSeq(9)}, now_ms=0)
    flipped = bytearray(b"".join(batches[:2]))
    flipped[-10] ^= 0x40  # inside the second batch's records: its CRC no longer checks
    with pytest.raises(CorruptReplicaChunk):
        store.append_sealed_copy(KEY, SEG, end, bytes(flipped))
    with pytest.raises(CorruptReplicaChunk):  # ends inside a batch
        store.append_sealed_copy(KEY, SEG, end, batches[0] + batches[1][:30])
    with pytest.raises(PastSealedEnd):
        store.append_sealed_copy(KEY, SEG, end - 1, b"".join(batches))
    with pytest.raises(NotContiguous):
        store.append_sealed_copy(KEY, SEG, end, batches[1])
    assert store.end_offset(KEY, SEG) == BASE, "nothing of a refused chunk is stored"
    store.close()


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def test_copy_in_reads_the_sealed_range_from_a_member_over_grpc_from_where_it_holds(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    """A short member (it holds two batches) is filled from a member that holds it all, over ReadSegment; a
    source that holds less than the seal makes the copy fail, keeping what was good."""
    batches, end = source_batches(tmp_path, 8)
    source = ReplicaStore(tmp_path / "source", now_ms=0)
    source.open_segment(KEY, E3, SEG, BASE, {A: OriginSeq(9)}, now_ms=0)
    source.append(KEY, E3, SEG, b"".join(batches))
    source.flush(KEY, SEG)
    target = ReplicaStore(tmp_path / "target", now_ms=0)
    target.open_segment(KEY, E3, SEG, BASE, {A: OriginSeq(9)}, now_ms=0)
    target.append(KEY, E3, SEG, b"".join(batches[:2]))
    segment = SealedRange(KEY, SEG, BASE, {A: OriginSeq(9)}, end)

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((SegmentService(source, executor, lambda: 0).handler(),))
        port = add_port(server, "127.0.0.1:0")
        await server.start()
        try:
            assert target.moved.total == 0, "a leader's stream is the write itself, not bytes moved"
            flushed, copied = await copy_in(target, segment, f"127.0.0.1:{port}", executor, 0)
            assert flushed == end and copied == sum(len(b) for b in batches[2:])
            assert target.moved.total == copied, "the fill's bytes are counted as moved"
            again = await copy_in(target, segment, f"127.0.0.1:{port}", executor, 0)
            assert again == (end, 0), "a copy that is whole reads nothing"
            assert target.moved.total == copied
            longer = SealedRange(KEY, SegmentId(6), end, {}, end + 10)
            with pytest.raises(CopyFailed, match="NOT_FOUND"):
                await copy_in(target, longer, f"127.0.0.1:{port}", executor, 0)
        finally:
            await server.stop(None)

    asyncio.run(run())
    got = target.read(KEY, SEG, LocalOffset(BASE), 1 << 20)
    assert got.data == b"".join(batches)
    moved = target.moved.total
    source.close()
    target.close()
    reopened = ReplicaStore(tmp_path / "target", now_ms=0)
    assert reopened.moved.total == moved > 0, "the count of bytes moved survives a restart"
    reopened.close()
    (tmp_path / "target" / MOVED_FILE).write_text("{not json")
    with pytest.raises(MovedBytesCorrupt, match="delete it to count from 0"):
        ReplicaStore(tmp_path / "target", now_ms=0)


# -- real nodes ----------------------------------------------------------------------------------------------------

EXTRA = ["--session-timeout-ms", "1500", "--repair-delay-ms", "2000", "--segment-bytes-max", "8192"]


def _leader_hint(exc: grpc.RpcError) -> str:
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == LEADER_METADATA:
            return str(value)
    return ""


def held(site: ClusterSite, n: int) -> dict[int, int]:
    """Node ``n``'s copies of ``TOPIC``/0: segment id -> fsynced end."""
    with open_channel(site.address(n)) as channel:
        answer = pbg.SegmentsStub(channel).ListSegments(pb.ListSegmentsRequest(), timeout=5)
    return {h.segment.segment_id: h.flushed_offset for h in answer.segments if h.segment.topic == TOPIC}


def read_copies(root: Path, nodes: list[int]) -> dict[int, dict[int, bytes]]:
    """Per node, its copies of ``TOPIC``/0 read with ``ReplicaStore``: segment id -> bytes."""
    out: dict[int, dict[int, bytes]] = {}
    for n in nodes:
        store = ReplicaStore(root / str(n), now_ms=0)
        try:
            out[n] = {}
            for sid in store.segment_ids((TOPIC, 0)):
                data, offset = b"", store.copy((TOPIC, 0), sid).log_start_offset  # type: ignore[union-attr]
                while True:
                    r = store.read((TOPIC, 0), sid, offset, 1 << 20)
                    if not r.data:
                        break
                    data, offset = data + r.data, r.next_offset
                out[n][sid] = data
        finally:
            store.close()
    return out


def sealed_ids(answer: pb.ClusterStatusResponse) -> int:
    """How many segments of ``TOPIC``/0 there are (the last may be open)."""
    return next(p.segments for p in answer.partitions if p.topic == TOPIC and p.partition == 0)


@pytest.mark.slow
def test_a_node_back_from_kill_9_gets_every_sealed_segment_it_lacks_and_all_copies_match(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=EXTRA)
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
        leader = site.wait_leader(TOPIC)
        produce(site, 12, "before")
        victim = next(n for n in (1, 2, 3) if n != leader)
        site.nodes[victim].kill9()
        # Once the site knows it dead (a session), new segments open on the two live nodes only; writes as fast as
        # a quiet machine makes them would otherwise roll them all with the dead node still in their ensembles.
        wait_for(
            "the site sees the killed node dead",
            lambda: not next(n for n in status(site).nodes if n.node_id == victim).live,
            30,
        )
        before = sealed_ids(status(site))
        produce(site, 60, "down")  # ~60 KiB: several 8 KiB segments, opened on the two live nodes
        during = status(site)
        assert sealed_ids(during) >= before + 4, "the writes did not roll several segments while the node was down"
        short = [u for u in during.under_replicated if u.sealed and victim not in u.ensemble]
        assert short, "no sealed segment opened without the dead node: nothing for repair to widen"
        site.nodes[victim].start(60)

        def repaired() -> bool | str:
            answer = status(site)
            if answer.under_replicated:
                return f"{len(answer.under_replicated)} under-replicated: {answer.under_replicated[0].message}"
            copies = {n: held(site, n) for n in (1, 2, 3)}
            count = sealed_ids(answer)
            sealed = range(count - 1)  # the last one is open (or sealed by a roll that just happened)
            ends = [{n: copies[n].get(s) for n in (1, 2, 3)} for s in sealed]
            uneven = [
                (s, e) for s, e in zip(sealed, ends, strict=True) if None in e.values() or len(set(e.values())) > 1
            ]
            return True if not uneven else f"segments whose copies differ or are missing: {uneven[:3]}"

        wait_for("every sealed segment back on 3 nodes with equal ends", repaired)
        final = status(site)
        members = sum(n.segments for n in final.nodes)
        assert members == 3 * sealed_ids(final), "the metadata does not give every segment a 3-member ensemble"
        doc = json.loads(
            ok(georep("cluster", "status", "--json", "--partitions", "--all", "--bootstrap", site.address(leader)))
        )
        moved = {n["node"]: n["bytes_moved"] for n in doc["nodes"]}
        assert moved[victim] > 0 and doc["bytes_moved"] == sum(moved.values()), (
            f"the segments copied back to node {victim} are not counted as bytes moved: {moved}"
        )
        produce(site, 5, "after")
    finally:
        site.close()
    copies = read_copies(tmp_path / "a", [1, 2, 3])
    common = sorted(set(copies[1]) & set(copies[2]) & set(copies[3]))
    assert len(common) >= 5, f"too few segments on all three nodes: {common}"
    for sid in common[:-1]:  # the last may still have been open when the site stopped
        assert copies[1][sid] == copies[2][sid] == copies[3][sid], f"the copies of segment {sid} differ"
    written_while_down = [s for s in common[:-1] if s >= before and copies[victim][s]]
    assert len(written_while_down) >= 3, f"few segments written while node {victim} was down came back to it"


@pytest.mark.slow
def test_a_decommissioned_node_ends_holding_nothing_that_three_others_do_not_and_writes_go_on(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 4, extra_args=EXTRA)
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
        leader = site.wait_leader(TOPIC)
        produce(site, 40, "before")
        victim = leader  # the hardest case: it leads the partition and is in its open segment
        other = site.address(1 + victim % 4)
        unknown = georep("cluster", "decommission", "9", "--bootstrap", other)
        assert unknown.returncode == 2 and b"not a node of this site" in unknown.stderr, unknown.stderr
        result = georep(
            "cluster",
            "decommission",
            str(victim),
            "--bootstrap",
            other,
            "--wait",
            "--wait-timeout-s",
            str(WAIT_S),
            timeout=WAIT_S + 30,
        )
        lines = ok(result).splitlines()
        assert f"node {victim} is draining" in lines[0] and "leads 1 partition(s)" in lines[0], lines
        assert f"node {victim} is drained" in lines[-1], lines
        node = next(n for n in status(site).nodes if n.node_id == victim)
        assert node.draining and node.segments == 0 and node.leader_of == 0, node
        assert site.wait_leader(TOPIC, not_node=victim) != victim
        assert produce(site, 20, "after") == 20, "writes stopped after the decommission"
        # Under load a live node's session can lapse for a moment, and a segment then opens on fewer members:
        # repair makes it whole again.
        wait_for("every segment fully replicated", lambda: not status(site).under_replicated)
        # What the drain copied off the node is bytes moved (each target's count reaches the metadata with its
        # next heartbeat).
        wait_for("the drain's copies counted as bytes moved", lambda: status(site).bytes_moved > 0)
        again = open_channel(site.address(victim))
        assert pbg.NodeStub(again).DecommissionNode(pb.DecommissionNodeRequest(node_id=victim), timeout=30).drained
        again.close()
    finally:
        site.close()
    copies = read_copies(tmp_path / "a", [1, 2, 3, 4])
    others = [n for n in (1, 2, 3, 4) if n != victim]
    assert copies[victim], "the decommissioned node held nothing to move"
    for sid, data in sorted(copies[victim].items()):
        holders = [n for n in others if sid in copies[n] and copies[n][sid].startswith(data)]
        assert len(holders) == 3, f"segment {sid} of node {victim} is on {holders} only"
        assert len({copies[n][sid] for n in holders}) == 1, f"the three copies of segment {sid} differ"
