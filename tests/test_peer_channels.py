"""A node's channels to the other nodes of its site (georep/server/peer_channels.py): one per peer for every
fence, copy and stream, and a fresh one once a peer was found down."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.server.peer_channels import PeerChannels, segments_stub
from georep.server.segments import SegmentService
from georep.storage.replica_store import ReplicaStore
from tests.support.channels import add_port

CALL_S = 10.0  # a bound on each call, never reached when the member serves


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The address of every gRPC channel built from here on."""
    out: list[str] = []
    real = grpc.aio.insecure_channel

    def counted(address: str, *args: object, **kwargs: object) -> grpc.aio.Channel:
        out.append(address)
        return real(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(grpc.aio, "insecure_channel", counted)
    yield out


async def serve(
    store: ReplicaStore, executor: ThreadPoolExecutor, address: str = "127.0.0.1:0"
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((SegmentService(store, executor, lambda: 0).handler(),))
    port = add_port(server, address)
    await server.start()
    return server, f"127.0.0.1:{port}"


class Member:
    """A site member's segment service on one address, which a test may stop and serve again."""

    def __init__(self, tmp_path: Path) -> None:
        self.store, self.executor = ReplicaStore(tmp_path, 0), ThreadPoolExecutor(2)
        self.server: grpc.aio.Server | None = None
        self.address = "127.0.0.1:0"

    async def serve(self) -> str:
        self.server, self.address = await serve(self.store, self.executor, self.address)
        return self.address

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
        self.executor.shutdown()
        self.store.close()


async def fence(peers: PeerChannels, address: str, partition: int) -> None:
    async with peers(address) as channel:
        request = pb.FenceSegmentsRequest(topic="t", partition=partition, leader_epoch=1)
        await segments_stub(channel).FenceSegments(request, timeout=CALL_S)


def test_a_survivors_fences_of_many_partitions_share_one_channel_to_a_peer(tmp_path: Path, created: list[str]) -> None:
    """A survivor of a kill fences thousands of partitions on each peer: a channel (and a stub) per call was 6 to 9%
    of its CPU."""

    async def run() -> None:
        member, peers = Member(tmp_path), PeerChannels(None)
        address = await member.serve()
        try:
            await asyncio.gather(*(fence(peers, address, p) for p in range(20)))
            for p in range(20, 40):
                await fence(peers, address, p)
            assert created == [address], f"{len(created)} channels for 40 fences to one peer"
        finally:
            await peers.close()
            await member.close()

    asyncio.run(run())


def test_a_peer_found_down_is_reached_at_the_first_call_once_it_serves_again(
    tmp_path: Path, created: list[str]
) -> None:
    """A channel to a dead peer backs its reconnects off: kept, it would fail the first calls to the peer once it is
    back. A call that fails UNAVAILABLE retires it, and the next call connects afresh."""

    async def run() -> None:
        member, peers = Member(tmp_path), PeerChannels(None)
        address = await member.serve()
        try:
            await fence(peers, address, 0)
            assert member.server is not None
            await member.server.stop(None)
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await fence(peers, address, 1)
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            await member.serve()  # again, on the same address
            await fence(peers, address, 2)  # the first call after it serves again
            assert created == [address, address]
        finally:
            await peers.close()
            await member.close()

    asyncio.run(run())
