"""A survivor's recoveries after a node's kill fence the other survivor thousands of times at once
(georep/server/fence_waves.py): the peer's gRPC server sheds what it cannot queue, and every shed fence failed its
recovery. In bounded waves, with a shed fence sent again, every recovery fences its quorum, and none loses an acked
write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from georep.broker.errors import RecoveryFailed
from georep.record.batch import iter_headers
from georep.server.fence_waves import FenceWaves
from georep.server.recovery import SegmentToRecover, recover_segment
from georep.server.segments import SegmentService
from georep.storage.api import LogConfig
from georep.storage.replica_store import PartitionKey, ReplicaStore
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset
from tests.support.channels import add_port
from tests.support.ports import free_port
from tests.support.segments import A, Writer, read_all
from topology.ids import LeaderEpoch, NodeId, SegmentId

PARTITIONS = 60
PEER_CALLS_MAX = 8  # the peer's server refuses calls past this many at once, as a busy survivor's sheds them
BUSY_FENCE_S = 0.1
SEG = SegmentId(0)
E1, E2 = LeaderEpoch(1), LeaderEpoch(2)
DEAD, PEER, NEW = NodeId(1), NodeId(2), NodeId(3)


def acked_chunk(tmp_path: Path) -> bytes:
    """Batches that the dead leader wrote to the peer and the new leader: acked (two of three hold them)."""
    log = SegmentLog.create_at(tmp_path / "scratch", LogConfig(), 0, {}, 0)
    w = Writer(log, next_seq={A: 0})
    for i in range(5):
        w.append(A, 1 + i % 3, value_bytes=100)
    chunk = b"".join(read_all(log))
    log.close()
    return chunk


def holding(root: Path, chunk: bytes) -> ReplicaStore:
    store = ReplicaStore(root, now_ms=0)
    for p in range(PARTITIONS):
        store.open_segment(("t", p), E1, SEG, 0, {}, 0)
        store.append(("t", p), E1, SEG, chunk)
        store.flush(("t", p), SEG)
    return store


def busy(fence: Callable[[PartitionKey, LeaderEpoch], dict[SegmentId, LocalOffset]]) -> Any:
    """A busy survivor's fence (its guard's fsync among its own recoveries' writes) takes a while: fences sent at
    once then overlap past what its server takes, whatever the load on the machine running the test."""

    def slow(key: PartitionKey, epoch: LeaderEpoch) -> dict[SegmentId, LocalOffset]:
        time.sleep(BUSY_FENCE_S)
        return fence(key, epoch)

    return slow


async def recover_all(tmp_path: Path, fences: FenceWaves) -> list[LocalOffset | BaseException]:
    chunk = acked_chunk(tmp_path)
    with ThreadPoolExecutor(4) as executor:
        peer, mine = holding(tmp_path / "peer", chunk), holding(tmp_path / "new", chunk)
        peer.fence = busy(peer.fence)  # type: ignore[method-assign]
        server = grpc.aio.server(maximum_concurrent_rpcs=PEER_CALLS_MAX)
        server.add_generic_rpc_handlers((SegmentService(peer, executor, lambda: 0).handler(),))
        port = add_port(server, "127.0.0.1:0")
        await server.start()
        addresses = {DEAD: f"127.0.0.1:{free_port()}", PEER: f"127.0.0.1:{port}"}

        async def seal(segment_id: SegmentId, end: LocalOffset) -> str | None:
            return None

        async def recover(p: int) -> LocalOffset:
            segment = SegmentToRecover(("t", p), SEG, 0, {}, (DEAD, PEER, NEW), 2, E2)
            return await recover_segment(mine, segment, NEW, addresses, seal, executor, lambda: 0, fences=fences)

        try:
            return await asyncio.gather(*(recover(p) for p in range(PARTITIONS)), return_exceptions=True)
        finally:
            await server.stop(None)
            peer.close()
            mine.close()


def test_every_recovery_fences_a_busy_peer_and_seals_at_the_acked_end(tmp_path: Path) -> None:
    """60 recoveries at once against a peer that takes 8 calls at a time: each gets the peer's fence (its quorum of
    two with this node) and seals at the end both hold, every acked batch. Sent all at once, as before, most fences
    were refused and their recoveries failed ("1 of 3 members can answer its fence")."""
    acked_end = iter_headers(acked_chunk(tmp_path / "size"))[-1].next_offset
    outcomes = asyncio.run(recover_all(tmp_path, FenceWaves(per_peer=PEER_CALLS_MAX // 2)))
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} of {PARTITIONS} recoveries failed, e.g. {failed[0]!r}"
    assert outcomes == [acked_end] * PARTITIONS  # every acked batch stays, nothing is invented


def test_fences_sent_all_at_once_are_shed_by_a_busy_peer(tmp_path: Path) -> None:
    """The failure the waves prevent, shown with them off (no bound, no second try): the peer refuses fences, and
    recoveries fail rather than pick an end without their quorum."""
    outcomes = asyncio.run(recover_all(tmp_path, FenceWaves(per_peer=10 * PARTITIONS, tries=1)))
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed and all(isinstance(o, RecoveryFailed) for o in failed), outcomes
    with pytest.raises(ValueError):
        FenceWaves(per_peer=0)


def test_a_peers_slots_are_never_more_than_its_bound_and_a_cancelled_waiter_gives_its_turn_on() -> None:
    async def run() -> None:
        waves = FenceWaves(per_peer=3)
        running, most = 0, 0
        gate = asyncio.Event()

        async def fence() -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await gate.wait()
            running -= 1

        tasks = [asyncio.create_task(waves.send("peer", fence)) for _ in range(20)]
        await asyncio.sleep(0.01)
        tasks[10].cancel()  # a recovery that ended while its fence waited
        gate.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert most == 3
        assert [isinstance(o, asyncio.CancelledError) for o in outcomes] == [i == 10 for i in range(20)]

    asyncio.run(run())
