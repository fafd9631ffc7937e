"""One gRPC channel per peer node, shared by the node's in-site calls: a recovery's fences, copies and seals, and
the segment writers' streams. Shell.

A channel per call cost a survivor of a node's kill 6 to 9% of its CPU in ``Channel.__init__``, and as much again
building a stub per call (each survivor recovers thousands of partitions, a fence and a stream per member).

A channel to a peer that died backs its reconnects off, up to two minutes by gRPC's default: reused for a peer
that came back, it would fail calls long after the peer serves. So a call that fails ``UNAVAILABLE`` retires its
channel (the next call connects afresh; the retired one closes once its last user is done), and the channels'
reconnect backoff is bounded at a second for the calls that share one meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import grpc

from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel

# A channel whose peer is down tries again within a second, never after gRPC's two minutes. Its connection is its
# own: from gRPC's process-wide pool, a fresh channel would get the retired one's connection, still backing off.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
)

ChannelUse = Callable[[str], AbstractAsyncContextManager[grpc.aio.Channel]]

_STUB_ATTRIBUTE = "_georep_segments_stub"


def segments_stub(channel: grpc.aio.Channel) -> pbg.SegmentsAsyncStub:
    """The ``Segments`` stub of ``channel``, built once per channel (a stub builds a callable per method). Kept on the
    channel itself: a table of stubs by channel would keep every retired channel alive through its stub."""
    stub: pbg.SegmentsAsyncStub | None = getattr(channel, _STUB_ATTRIBUTE, None)
    if stub is None:
        stub = pbg.SegmentsStub(channel)
        setattr(channel, _STUB_ATTRIBUTE, stub)
    return stub


class _Peer:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.users = 0
        self.retired = False


class PeerChannels:
    """``address -> async with channel``: the current channel to that address, shared, never closed by its users."""

    def __init__(self, tls: TlsConfig | None) -> None:
        self._tls = tls
        self._current: dict[str, _Peer] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def __call__(self, address: str) -> AbstractAsyncContextManager[grpc.aio.Channel]:
        return self._use(address)

    @contextlib.asynccontextmanager
    async def _use(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        peer = self._current.get(address)
        if peer is None:
            peer = self._current[address] = _Peer(client_channel(address, self._tls, RECONNECT_OPTIONS))
        peer.users += 1
        try:
            yield peer.channel
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._retire(address, peer)
            raise
        finally:
            peer.users -= 1
            if peer.retired and peer.users == 0:
                task = asyncio.get_running_loop().create_task(peer.channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def _retire(self, address: str, peer: _Peer) -> None:
        if self._current.get(address) is peer:
            del self._current[address]
        peer.retired = True

    async def close(self) -> None:
        """Close every channel (the node stops: no call is left)."""
        peers, self._current = list(self._current.values()), {}
        for peer in peers:
            await peer.channel.close(grace=None)
        await asyncio.gather(*self._closing, return_exceptions=True)
