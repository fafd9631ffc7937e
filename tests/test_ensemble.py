"""A leader writes an open segment to its ensemble over gRPC (georep/server/ensemble.py, georep/server/segments.py):
real member processes, real disks, kill -9.

The leader runs in this process with its own ``ReplicaStore``; members 2 and 3 are ``georep node`` processes.
Ensemble (1, 2, 3), ack quorum 2: the LAC is what two of the three hold fsynced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster.lead import PartitionLead
from cluster.quorum import SegmentQuorum
from georep.broker.errors import NotLeader, RecoveryFailed
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import iter_headers
from georep.server.ensemble import SegmentToWrite, SegmentWriter, solo_writer
from georep.server.process import NodeProcess
from georep.server.recovery import SegmentToRecover, recover_segment
from georep.server.segments import SegmentService
from georep.storage.api import LogConfig
from georep.storage.replica_store import ReplicaStore
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, OriginSeq
from tests.support.channels import add_port, aio_channel
from tests.support.ports import free_port
from tests.support.segments import A, B, Writer, read_all
from topology.ids import LeaderEpoch, NodeId, SegmentId

KEY = ("orders", 0)
SEG = SegmentId(3)
BASE = 500
E1 = LeaderEpoch(1)
LEADER = NodeId(1)
WAIT_S = 30.0


def leader_batches(tmp_path: Path, count: int) -> list[bytes]:
    """The batches a leader appends to segment 3 from offset 500, as stored (local prefixes set)."""
    log = SegmentLog.create_at(tmp_path / "scratch", LogConfig(), BASE, {A: OriginSeq(40)}, 0)
    w = Writer(log, next_seq={A: 40})
    for i in range(count):
        w.append((A, B)[i % 2], 1 + i % 4, value_bytes=200)
    batches = read_all(log)
    log.close()
    return batches


@pytest.fixture
def members(tmp_path: Path) -> Iterator[dict[NodeId, NodeProcess]]:
    nodes = {NodeId(n): NodeProcess(site="a", data_dir=tmp_path / f"node-{n}") for n in (2, 3)}
    for node in nodes.values():
        node.start()
    yield nodes
    for node in nodes.values():
        node.kill9()


def restart_on_same_port(node: NodeProcess) -> None:
    node.kill9()
    node.listen = node.address
    node.start()


async def read_copy(address: str, end_offset: int = 0) -> bytes:
    async with aio_channel(address) as channel:
        stub = pbg.SegmentsStub(channel)
        ref = pb.SegmentRef(topic=KEY[0], partition=KEY[1], segment_id=SEG)
        chunks = [
            r.batches
            async for r in stub.ReadSegment(pb.ReadSegmentRequest(segment=ref, offset=BASE, end_offset=end_offset))
        ]
    return b"".join(chunks)


def writer_for(
    tmp_path: Path, members: dict[NodeId, NodeProcess], executor: ThreadPoolExecutor, epoch: LeaderEpoch = E1
) -> tuple[SegmentWriter, ReplicaStore, PartitionLead]:
    store = ReplicaStore(tmp_path / "leader", now_ms=0)
    segment = SegmentToWrite(KEY, SEG, BASE, {A: OriginSeq(40)}, (LEADER, *sorted(members)), 2, epoch)
    addresses = {n: p.address for n, p in members.items()}
    writer, lead = solo_writer(store, segment, LEADER, addresses, executor, clock_ms=lambda: 0)
    return writer, store, lead


def quorum(lead: PartitionLead) -> SegmentQuorum:
    """The writer's quorum, as its lead counts it (``cluster/lead.py``)."""
    assert lead.quorum is not None
    return lead.quorum


async def wait_for(what: str, check: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


def test_every_member_holds_the_leaders_bytes_and_the_lac_follows_the_fsyncs(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 60)

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            writer, store, lead = writer_for(tmp_path, members, executor)
            await writer.start()
            ends = [await writer.append(b) for b in batches]
            async with asyncio.timeout(WAIT_S):
                await writer.confirmed(ends[-1])
            assert writer.lac == ends[-1]
            everything = b"".join(batches)
            await wait_for(
                "both members caught up", lambda: all(quorum(lead).member_end(n) == ends[-1] for n in members)
            )
            for node in members.values():
                assert await read_copy(node.address) == everything  # byte for byte, local prefixes included
            # a read up to an offset inside the copy stops at the batch boundary below it
            cut = iter_headers(everything)[10].base_offset
            assert await read_copy(members[NodeId(2)].address, cut) == b"".join(batches[:10])
            await writer.close()
            store.close()

    asyncio.run(run())


def test_a_member_killed_mid_stream_costs_no_ack_and_catches_up_from_its_own_end(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 300)
    victim = members[NodeId(3)]

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            writer, store, lead = writer_for(tmp_path, members, executor)
            await writer.start()
            ends = []
            for i, b in enumerate(batches):
                ends.append(await writer.append(b))
                if i == 100:
                    victim.kill9()  # mid-stream: some of what was sent to it is lost with its page cache
                if i % 20 == 0:  # acks=all: the leader and node 2 are a quorum without node 3
                    async with asyncio.timeout(WAIT_S):
                        await writer.confirmed(ends[-1])
            async with asyncio.timeout(WAIT_S):
                await writer.confirmed(ends[-1])
            assert quorum(lead).member_end(NodeId(3)) < ends[-1] and NodeId(3) in quorum(lead).failed_members()
            # back on its port: it answers the end it kept, and the leader sends the rest from there
            restart_on_same_port(victim)
            await wait_for("node 3 caught up", lambda: quorum(lead).member_end(NodeId(3)) == ends[-1])
            assert await read_copy(victim.address) == b"".join(batches)
            await writer.close()
            store.close()

    asyncio.run(run())


def test_with_both_members_down_nothing_is_confirmed_until_one_comes_back(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 20)

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            writer, store, lead = writer_for(tmp_path, members, executor)
            await writer.start()
            first = await writer.append(batches[0])
            async with asyncio.timeout(WAIT_S):
                await writer.confirmed(first)
            for node in members.values():
                node.kill9()
            end = 0
            for b in batches[1:]:
                end = await writer.append(b)
            waiting = writer.confirmed(end)
            await wait_for("the leader saw both streams break", lambda: len(quorum(lead).failed_members()) == 2)
            assert not waiting.done() and writer.lac == first  # its own fsync alone is not a quorum
            restart_on_same_port(members[NodeId(2)])
            async with asyncio.timeout(WAIT_S):
                await waiting
            assert await read_copy(members[NodeId(2)].address) == b"".join(batches)
            await writer.close()
            store.close()

    asyncio.run(run())


def test_a_newer_leader_fences_the_members_and_the_old_writer_stops_with_not_leader(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 10)

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            writer, store, lead = writer_for(tmp_path, members, executor)
            await writer.start()
            for b in batches[:5]:
                end = await writer.append(b)
            async with asyncio.timeout(WAIT_S):
                await writer.confirmed(end)
            await wait_for("both members hold it", lambda: all(quorum(lead).member_end(n) == end for n in members))
            # the new leader (epoch 2) fences both members: each answers the end it holds, fsynced
            for node in members.values():
                async with aio_channel(node.address) as channel:
                    fenced = await pbg.SegmentsStub(channel).FenceSegments(
                        pb.FenceSegmentsRequest(topic=KEY[0], partition=KEY[1], leader_epoch=2)
                    )
                assert [(e.segment_id, e.end_offset) for e in fenced.ends] == [(SEG, end)]
            # the old leader's next write is refused by every member: it learns it is deposed
            late = await writer.append(batches[5])
            with pytest.raises(NotLeader, match="fenced by a newer leader"):
                async with asyncio.timeout(WAIT_S):
                    await writer.confirmed(late)
            with pytest.raises(NotLeader):
                await writer.append(batches[6])
            # nothing of the refused write reached a member
            for node in members.values():
                assert await read_copy(node.address) == b"".join(batches[:5])
            # the new leader seals the segment at the recovered end; an older epoch may not
            async with aio_channel(members[NodeId(2)].address) as channel:
                stub = pbg.SegmentsStub(channel)
                ref = pb.SegmentRef(topic=KEY[0], partition=KEY[1], segment_id=SEG)
                with pytest.raises(grpc.aio.AioRpcError) as old:
                    await stub.SealSegment(pb.SealSegmentRequest(segment=ref, leader_epoch=1, end_offset=end))
                assert old.value.code() == grpc.StatusCode.ABORTED
                sealed = await stub.SealSegment(pb.SealSegmentRequest(segment=ref, leader_epoch=2, end_offset=end))
                assert sealed.end_offset == end
            await writer.close()
            store.close()

    asyncio.run(run())


def test_malformed_segment_calls_get_a_clear_error(members: dict[NodeId, NodeProcess]) -> None:
    async def run() -> None:
        async with aio_channel(members[NodeId(2)].address) as channel:
            stub = pbg.SegmentsStub(channel)
            ref = pb.SegmentRef(topic=KEY[0], partition=KEY[1], segment_id=SEG)
            with pytest.raises(grpc.aio.AioRpcError) as no_open:
                async for _ in stub.AppendSegment(iter([pb.SegmentAppendRequest(batches=b"x")])):
                    pass
            assert no_open.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must open the segment" in (no_open.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                async for _ in stub.ReadSegment(pb.ReadSegmentRequest(segment=ref, offset=BASE)):
                    pass
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert "ask a member" in (unknown.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as epoch:
                await stub.FenceSegments(pb.FenceSegmentsRequest(topic=KEY[0], partition=0, leader_epoch=0))
            assert epoch.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())


# -- a new leader recovers the open segment (georep/server/recovery.py) ---------------------------------------


async def serve_member(store: ReplicaStore, executor: ThreadPoolExecutor) -> tuple[grpc.aio.Server, str]:
    """A member in this process: the same SegmentService a node serves, over ``store``."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((SegmentService(store, executor, lambda: 0).handler(),))
    port = add_port(server, "127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


NEW = NodeId(3)
E2 = LeaderEpoch(2)


def to_recover(epoch: LeaderEpoch = E2) -> SegmentToRecover:
    return SegmentToRecover(KEY, SEG, BASE, {A: OriginSeq(40)}, (LEADER, NodeId(2), NEW), 2, epoch)


async def recover_retrying(
    store: ReplicaStore,
    addresses: dict[NodeId, str],
    seal: Callable[[SegmentId, LocalOffset], Awaitable[str | None]],
    executor: ThreadPoolExecutor,
) -> int:
    """Recover as a leader does: again, a few times, while too few members answer the fence (a member just
    restarted may not answer yet on a loaded machine)."""
    for attempt in range(5):
        try:
            return await recover_segment(store, to_recover(), NEW, addresses, seal, executor, lambda: 0)
        except RecoveryFailed as exc:
            if attempt == 4 or "Bring a member back" not in str(exc):
                raise
            await asyncio.sleep(1)
    raise AssertionError("unreachable")


def test_the_new_leader_recovers_every_acked_write_copies_the_tail_seals_and_cuts(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 200)
    two = members[NodeId(2)]
    members[NodeId(3)].kill9()  # node 3 is this process from here on: the next leader

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            new_store = ReplicaStore(tmp_path / "node-3-here", now_ms=0)
            server, new_address = await serve_member(new_store, executor)
            old_store = ReplicaStore(tmp_path / "leader", now_ms=0)
            segment = SegmentToWrite(KEY, SEG, BASE, {A: OriginSeq(40)}, (LEADER, NodeId(2), NEW), 2, E1)
            writer, _ = solo_writer(
                old_store, segment, LEADER, {NodeId(2): two.address, NEW: new_address}, executor, clock_ms=lambda: 0
            )
            await writer.start()
            confirmed = 0
            for i, b in enumerate(batches):
                end = await writer.append(b)
                if i == 80:
                    two.kill9()  # node 2 misses the rest: the leader and node 3 go on as the quorum
                if i % 10 == 9:
                    async with asyncio.timeout(WAIT_S):
                        await writer.confirmed(end)
                    confirmed = end
            # the old leader dies: its copy is gone with it, and nothing more is sent
            await writer.close()
            old_store.close()
            two.listen = two.address
            two.start()
            seals: list[tuple[SegmentId, int]] = []

            async def seal(segment_id: SegmentId, end: LocalOffset) -> str | None:
                seals.append((segment_id, end))
                return None

            addresses = {LEADER: closed_port(), NodeId(2): two.address}
            sealed = await recover_retrying(new_store, addresses, seal, executor)
            # every acked write is below the sealed end, and nothing was invented
            assert confirmed <= sealed <= iter_headers(b"".join(batches))[-1].next_offset
            assert seals == [(SEG, sealed)]
            held = b"".join(batches)[
                : sum(h.size_bytes for h in iter_headers(b"".join(batches)) if h.base_offset < sealed)
            ]
            assert await read_copy(new_address) == held
            assert await read_copy(two.address) == held  # node 2 was copied the tail it missed
            # both members learned the seal: the old leader's epoch is refused from now on
            async with aio_channel(two.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await pbg.SegmentsStub(channel).FenceSegments(
                        pb.FenceSegmentsRequest(topic=KEY[0], partition=KEY[1], leader_epoch=1)
                    )
            assert late.value.code() == grpc.StatusCode.ABORTED
            await server.stop(None)
            new_store.close()

    asyncio.run(run())


def test_a_new_leader_that_fell_behind_copies_the_tail_to_itself_before_it_seals(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    batches = leader_batches(tmp_path, 120)
    two = members[NodeId(2)]
    members[NodeId(3)].kill9()  # node 3 is this process: it stops serving mid-stream, then leads

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            new_store = ReplicaStore(tmp_path / "node-3-here", now_ms=0)
            server, new_address = await serve_member(new_store, executor)
            old_store = ReplicaStore(tmp_path / "leader", now_ms=0)
            segment = SegmentToWrite(KEY, SEG, BASE, {A: OriginSeq(40)}, (LEADER, NodeId(2), NEW), 2, E1)
            writer, _ = solo_writer(
                old_store, segment, LEADER, {NodeId(2): two.address, NEW: new_address}, executor, clock_ms=lambda: 0
            )
            await writer.start()
            confirmed = 0
            for i, b in enumerate(batches):
                end = await writer.append(b)
                if i == 40:
                    await server.stop(None)  # node 3 misses the rest
                if i % 10 == 9:
                    async with asyncio.timeout(WAIT_S):
                        await writer.confirmed(end)
                    confirmed = end
            behind = new_store.end_offset(KEY, SEG)
            assert behind < confirmed
            await writer.close()
            old_store.close()

            async def seal(segment_id: SegmentId, end: LocalOffset) -> str | None:
                return None

            addresses = {LEADER: closed_port(), NodeId(2): two.address}
            sealed = await recover_retrying(new_store, addresses, seal, executor)
            assert sealed >= confirmed
            held = await read_copy(two.address)
            assert new_store.end_offset(KEY, SEG) == sealed
            assert new_store.read(KEY, SEG, LocalOffset(BASE), 1 << 24).data == held  # copied from node 2, whole
            new_store.close()

    asyncio.run(run())


def test_recovery_refuses_without_enough_members_and_steps_down_for_a_newer_leader(
    tmp_path: Path, members: dict[NodeId, NodeProcess]
) -> None:
    two = members[NodeId(2)]

    async def never(segment_id: SegmentId, end: LocalOffset) -> str | None:
        raise AssertionError("nothing may be sealed")

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            store = ReplicaStore(tmp_path / "node-3-here", now_ms=0)
            two.kill9()
            addresses = {LEADER: closed_port(), NodeId(2): closed_port()}
            with pytest.raises(RecoveryFailed, match="Bring a member back"):
                await recover_segment(store, to_recover(), NEW, addresses, never, executor, lambda: 0)
            two.listen = two.address
            two.start()
            async with aio_channel(two.address) as channel:  # a newer leader got there first
                await pbg.SegmentsStub(channel).FenceSegments(
                    pb.FenceSegmentsRequest(topic=KEY[0], partition=KEY[1], leader_epoch=5)
                )
            addresses[NodeId(2)] = two.address
            with pytest.raises(NotLeader, match="epoch 5"):
                await recover_segment(store, to_recover(), NEW, addresses, never, executor, lambda: 0)
            store.close()

    asyncio.run(run())


def test_a_recovery_whose_effect_fails_unforeseen_fails_and_does_not_hang(tmp_path: Path) -> None:
    """The writer died before its stream reached any member: no member holds a copy, the recovered end is the
    base. A seal callback that raised (reading this node's copy of it, which it does not have) once left the
    recovery waiting forever, and the partition without a leader that serves; it fails now, to be tried again."""

    async def unforeseen(segment_id: SegmentId, end: LocalOffset) -> str | None:
        assert end == BASE, "nothing was written, so nothing is recovered"
        raise OSError("this node holds no copy of the segment")

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            two_store = ReplicaStore(tmp_path / "node-2", now_ms=0)
            server, two_address = await serve_member(two_store, executor)
            store = ReplicaStore(tmp_path / "node-3-here", now_ms=0)
            addresses = {LEADER: closed_port(), NodeId(2): two_address}
            async with asyncio.timeout(WAIT_S):
                with pytest.raises(RecoveryFailed, match="OSError: this node holds no copy"):
                    await recover_segment(store, to_recover(), NEW, addresses, unforeseen, executor, lambda: 0)
            await server.stop(None)
            store.close()
            two_store.close()

    asyncio.run(run())
