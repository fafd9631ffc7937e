"""Channels to georep nodes: the bootstrap list, reachability, reconnects.

A bootstrap list is ``host:port[,host:port...]``. The client uses the first
node that accepts a TCP connection and moves to the next one when that node
goes away. Before opening a gRPC channel the client probes the address with a
plain TCP connect, so a dead address fails at once with a message that says
why ("connection refused", "unknown host", "timed out") instead of gRPC's
generic retrying.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from georep.client.errors import InvalidRequest, NodeUnavailable, TlsRefused
from georep.proto import georep_pb2, georep_pb2_grpc
from georep.security.tls import MESSAGE_BYTES_MAX, TlsConfig, TlsError, client_channel, handshake_problem

T = TypeVar("T")

DEFAULT_BOOTSTRAP = "127.0.0.1:7101"
IDENTIFY_ATTEMPTS = 4
IDENTIFY_RETRY_S = 0.05
BOOTSTRAP_ENV = "GEOREP_BOOTSTRAP"

CONNECT_TIMEOUT_MS = 5_000  # a handshake over a long link takes a few round trips

# The factory sets both bounds on every channel (georep.security.tls): above the largest batch a topic may allow,
# since a fetch response holds at least one whole batch, whatever max_bytes says.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    # gRPC's own reconnect backoff starts at 1 s and grows to 120 s; a restarted
    # node should be found again within a fraction of a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    # Despite its name, grpc-core uses this as the time a connection attempt may
    # take before it gives up (default 20 s). At 100 ms, as it was, a server whose
    # SETTINGS frame comes back after more than 100 ms (a 200 ms RTT link) was
    # given up on again and again ("connection attempt timed out before receiving
    # SETTINGS frame", measured through the fault proxy). A refused connection
    # still fails at once and is retried after the backoff above.
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]


def default_bootstrap() -> str:
    return os.environ.get(BOOTSTRAP_ENV) or DEFAULT_BOOTSTRAP


def parse_bootstrap(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"h1:p1,h2:p2"`` (or a list of ``host:port``) as a list of addresses."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in parts:
        address = raw.strip()
        if not address:
            continue
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest(
                f"invalid bootstrap address {address!r}: expected HOST:PORT, for example 127.0.0.1:7101"
            )
        out.append(address)
    if not out:
        raise InvalidRequest("empty bootstrap list: give HOST:PORT[,HOST:PORT...] (or set GEOREP_BOOTSTRAP)")
    return out


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def probe(address: str, timeout_s: float) -> str | None:
    """None if ``address`` accepts a TCP connection, else why not, in a few words."""
    host, port = _split(address)
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return "connection refused"
    except socket.gaierror:
        return "unknown host"
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return exc.strerror or str(exc)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


def unreachable(addresses: list[str], reasons: list[str]) -> NodeUnavailable:
    if len(addresses) == 1:
        return NodeUnavailable(
            f"cannot reach georep node at {addresses[0]} ({reasons[0]}): is it running? check --bootstrap"
        )
    detail = "; ".join(f"{a}: {r}" for a, r in zip(addresses, reasons, strict=True))
    return NodeUnavailable(
        f"cannot reach any georep node of {','.join(addresses)} ({detail}): is one running? check --bootstrap"
    )


async def tls_problem(address: str, tls: TlsConfig | None, timeout_s: float = 3.0) -> str | None:
    """Why TLS keeps a call to ``address`` from working, if it does (``handshake_problem``, in an executor)."""
    return await asyncio.get_running_loop().run_in_executor(None, handshake_problem, address, tls, timeout_s)


class Connection:
    """One gRPC channel to one node of the bootstrap list, replaced on reconnect.

    ``generation`` counts channels: several tasks sharing the connection (a
    consumer's fetchers) all see a broken channel, and only the first of them
    to call :meth:`reconnect` with the old generation replaces it.
    """

    def __init__(
        self, bootstrap: str | list[str], connect_timeout_ms: int = 5000, tls: TlsConfig | None = None
    ) -> None:
        self.addresses = parse_bootstrap(bootstrap)
        self.connect_timeout_s = connect_timeout_ms / 1000
        self.tls = tls  # None: plaintext, for a node started with --insecure
        self.address = ""
        # site@epoch of the node connected to: local offsets mean something only there
        self.origin = ""
        self.generation = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: georep_pb2_grpc.NodeAsyncStub | None = None
        self._index = 0
        self._lock = asyncio.Lock()
        self._opened: asyncio.Future[None] | None = None

    @property
    def stub(self) -> georep_pb2_grpc.NodeAsyncStub:
        if self._stub is None:
            raise NodeUnavailable("not connected: call start() (or use 'async with') first")
        return self._stub

    @property
    def connected(self) -> bool:
        return self._stub is not None

    def opened(self) -> asyncio.Future[None]:
        """Resolves the next time a channel opens: a reconnect, maybe to another site."""
        if self._opened is None or self._opened.done():
            self._opened = asyncio.get_running_loop().create_future()
        return self._opened

    async def connect(self) -> georep_pb2_grpc.NodeAsyncStub:
        """Open a channel to the first reachable node, starting at the current one."""
        async with self._lock:
            if self._stub is not None:
                return self._stub
            await self._open()
            assert self._stub is not None
            return self._stub

    async def reconnect(self, generation: int) -> georep_pb2_grpc.NodeAsyncStub:
        """Replace the channel of ``generation`` (if nobody did yet) and return the current stub."""
        async with self._lock:
            if generation == self.generation and self._channel is not None:
                await self._close_channel()
            if self._stub is None:
                await self._open()
            assert self._stub is not None
            return self._stub

    async def unary(self, call: Awaitable[T]) -> T:
        """Await one call on this connection's channel.

        Another task sharing the connection may close the channel under the call
        to reconnect (a fetcher saw the node go). grpc.aio then cancels the call,
        and the cancellation would reach the caller as if its own task had been
        cancelled, ending it: an application's poll loop or a group's heartbeat
        would stop for good. Here that is :class:`NodeUnavailable`, which callers
        already retry on the new channel. A real cancellation of the caller's
        task still propagates.
        """
        address = self.address
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise NodeUnavailable(
                f"the channel to {address} was replaced while a call was in flight (the node went away): retry"
            ) from None

    async def _open(self) -> None:
        n = len(self.addresses)
        reasons: list[str] = []
        tried: list[str] = []
        for i in range(n):
            index = (self._index + i) % n
            address = self.addresses[index]
            reason = await probe(address, self.connect_timeout_s)
            if reason is None:
                try:
                    channel = client_channel(address, self.tls, CHANNEL_OPTIONS)
                except TlsError as exc:
                    raise TlsRefused(str(exc)) from None
                stub = georep_pb2_grpc.NodeStub(channel)
                health = await self._identify(stub)
                if isinstance(health, str):
                    await channel.close(grace=None)
                    await self._check_handshake(address)
                    tried.append(address)
                    reasons.append(health)
                    continue
                self._index = index
                self.address = address
                self.origin = f"{health.site}@{health.epoch}"
                self._channel, self._stub = channel, stub
                self.generation += 1
                if self._opened is not None and not self._opened.done():
                    self._opened.set_result(None)
                return
            tried.append(address)
            reasons.append(reason)
        self._index = (self._index + 1) % n
        raise unreachable(tried, reasons)

    async def _identify(self, stub: georep_pb2_grpc.NodeAsyncStub) -> georep_pb2.HealthResponse | str:
        """The node's identity, or why there is none. A fresh channel may answer
        UNAVAILABLE once under load: try a few times, quickly, rather than wait
        for readiness (a node killed right after the probe would hold us for the
        whole connect timeout)."""
        for attempt in range(IDENTIFY_ATTEMPTS):
            try:
                health: georep_pb2.HealthResponse = await stub.Health(
                    georep_pb2.HealthRequest(), timeout=self.connect_timeout_s
                )
                return health
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == IDENTIFY_ATTEMPTS - 1:
                    return f"not a georep node, or not answering: {exc.code().name}"
                await asyncio.sleep(IDENTIFY_RETRY_S)
        raise AssertionError("unreachable")

    async def _check_handshake(self, address: str) -> None:
        """A node that took the TCP connection but not the call: if TLS is why (one side wants it and the other
        does not, or a certificate was refused), raise :class:`TlsRefused` saying which and what to pass, instead
        of gRPC's bare "Socket closed"."""
        problem = await tls_problem(address, self.tls, self.connect_timeout_s)
        if problem is not None:
            raise TlsRefused(problem)

    async def _close_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        async with self._lock:
            await self._close_channel()
