"""The asyncio shell of the fault proxy: TCP relays with toxics, and the Toxiproxy HTTP API that manages them.

One event loop runs everything: the API server, every proxy's listener and,
per proxied connection, a reader and a writer task per direction. A reader
reads a chunk, hands it to its direction's :class:`~georep.faultproxy.toxics.Pipeline`
with the loop's clock, and queues the pieces that come back; the writer
writes them in order, each at its time. A direction stops reading while more
than ``BUFFER_BYTES_MAX`` wait to be written (back-pressure, so a throttled
link slows its sender instead of filling memory); a latency toxic's delay
line needs ``rate x latency`` bytes of that, so the bound is generous.

The API is the subset of Toxiproxy's that ``toxiproxy-python`` 0.1.1 uses,
plus what a test needs around it:

========================================  =========================================================
``GET /version``                          the server's version, as text
``POST /reset``                           enable every proxy and remove every toxic (204)
``GET /proxies``                          ``{name: proxy}``
``POST /proxies``                         create ``{name, upstream, listen?, enabled?}`` (201, 409 if it exists)
``GET|POST|PATCH|DELETE /proxies/NAME``   show; update ``enabled``, ``listen``, ``upstream``; delete (204)
``GET|POST /proxies/NAME/toxics``         list; add ``{name?, type, stream?, toxicity?, attributes?}``
``GET|POST|PATCH|DELETE .../toxics/T``    show; update; delete (204)
========================================  =========================================================

Errors are ``{"error": ..., "status": ...}`` with 400, 404 or 409, as
Toxiproxy answers them, so the client raises ``InvalidToxic``, ``NotFound``
or ``ProxyExists``. A disabled proxy closes its listener and every
connection it carries; enabling it listens again on the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import struct
from collections import deque
from collections.abc import Mapping
from typing import Any

from georep.faultproxy.toxics import STREAMS, End, Piece, Pipeline, ToxicError, ToxicSpec

log = logging.getLogger(__name__)

VERSION = "georep-faultproxy 1 (Toxiproxy API subset)"
READ_BYTES = 256 * 1024
BUFFER_BYTES_MAX = 64 * 1024 * 1024
API_BODY_BYTES_MAX = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def split_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ApiError(400, f"invalid {what} {address!r}: expected HOST:PORT, for example 127.0.0.1:7101")
    return host.strip("[]"), int(port)


class Direction:
    """One direction of a proxied connection: read, run the toxics, write each piece at its time."""

    def __init__(
        self, conn: Connection, stream: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.conn, self.stream = conn, stream
        self.reader, self.writer = reader, writer
        self.pipeline = Pipeline(conn.proxy.rng)
        self.queue: deque[Piece | None] = deque()  # None: the reader saw EOF, close the write side
        self.queued_bytes = 0
        self.changed = asyncio.Event()  # the queue grew, or shrank below the bound

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.queued_bytes > BUFFER_BYTES_MAX:
                self.changed.clear()
                await self.changed.wait()
            data = await self.reader.read(READ_BYTES)
            if not data:
                self.queue.append(None)
                self.changed.set()
                return
            pieces, end = self.pipeline.feed(data, loop.time() * 1000)
            for piece in pieces:
                self.queue.append(piece)
                self.queued_bytes += len(piece.data)
            if pieces:
                self.changed.set()
            if end is not None:
                self.conn.end_at(end)

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                self.changed.clear()
                await self.changed.wait()
                continue
            piece = self.queue[0]
            if piece is None:
                with contextlib.suppress(OSError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                return
            wait_s = piece.at_ms / 1000 - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            # Everything due by now goes in one write: a delay line at 100 MB/s would otherwise cost a timer and a
            # send per 64 KiB, and the proxy's own CPU would throttle the link it is meant only to delay.
            now_ms = loop.time() * 1000
            due: list[bytes] = []
            while self.queue and (head := self.queue[0]) is not None and head.at_ms <= now_ms:
                self.queue.popleft()
                due.append(head.data)
            size = sum(len(d) for d in due)
            self.queued_bytes -= size
            self.writer.write(due[0] if len(due) == 1 else b"".join(due))
            await self.writer.drain()
            self.changed.set()


class Connection:
    """A client connection and its connection to the upstream: two directions."""

    def __init__(
        self,
        proxy: Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_writer, self.upstream_writer = client[1], upstream[1]
        self.directions = {
            "upstream": Direction(self, "upstream", client[0], upstream[1]),
            "downstream": Direction(self, "downstream", upstream[0], client[1]),
        }
        self.tasks: list[asyncio.Task[None]] = []
        self.ending: asyncio.TimerHandle | None = None
        self.end_ms = float("inf")
        self.closed = asyncio.Event()

    def apply_toxics(self) -> None:
        loop = asyncio.get_running_loop()
        for stream, direction in self.directions.items():
            end = direction.pipeline.update(self.proxy.toxics_of(stream), loop.time() * 1000)
            if end is not None:
                self.end_at(end)

    def run(self) -> None:
        self.apply_toxics()
        for d in self.directions.values():
            self.tasks.append(asyncio.create_task(d.read_loop()))
            self.tasks.append(asyncio.create_task(d.write_loop()))
        for t in self.tasks:
            t.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        # A reset or closed peer ends the whole connection, as does both directions' end.
        if task.exception() is not None or all(t.done() for t in self.tasks):
            self.close(reset=False)

    def end_at(self, end: End) -> None:
        """End the connection at ``end.at_ms`` (the earliest end asked for wins)."""
        if end.at_ms >= self.end_ms:
            return
        self.end_ms = end.at_ms
        if self.ending is not None:
            self.ending.cancel()
        loop = asyncio.get_running_loop()
        self.ending = loop.call_at(end.at_ms / 1000, self.close, end.reset)

    def close(self, reset: bool) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self.ending is not None:
            self.ending.cancel()
        for t in self.tasks:
            t.cancel()
        for w in (self.client_writer, self.upstream_writer):
            if reset:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):  # linger 0: close sends RST and drops what is unsent
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
            else:
                w.close()
        self.proxy.connections.discard(self)


class Proxy:
    """A named listener relaying to ``upstream`` through its toxics."""

    def __init__(self, name: str, listen: str, upstream: str, rng: random.Random) -> None:
        self.name, self.listen, self.upstream = name, listen, upstream
        self.rng = rng
        self.enabled = False
        self.toxics: dict[str, ToxicSpec] = {}  # in the order they were added
        self.connections: set[Connection] = set()
        self.server: asyncio.Server | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": [t.as_json() for t in self.toxics.values()],
        }

    def toxics_of(self, stream: str) -> list[ToxicSpec]:
        return [t for t in self.toxics.values() if t.stream == stream]

    async def enable(self) -> None:
        if self.enabled:
            return
        host, port = split_address(self.listen, "listen address")
        try:
            self.server = await asyncio.start_server(self._accept, host, port, reuse_address=True)
        except OSError as exc:
            raise ApiError(
                500,
                f"proxy {self.name} cannot listen on {self.listen}: {exc.strerror or exc}; "
                "choose another port, or 127.0.0.1:0 for any free one",
            ) from None
        bound = self.server.sockets[0].getsockname()
        self.listen = f"{host}:{bound[1]}"  # a port 0 becomes the one bound, and stays across disable/enable
        self.enabled = True

    async def disable(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        server, self.server = self.server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.close(reset=False)
        if server is not None:
            await server.wait_closed()

    def toxics_changed(self) -> None:
        for conn in list(self.connections):
            conn.apply_toxics()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = split_address(self.upstream, "upstream address")
        try:
            upstream = await asyncio.open_connection(host, port)
        except OSError as exc:
            log.info("proxy %s: upstream %s refused a connection: %s", self.name, self.upstream, exc)
            writer.close()
            return
        if not self.enabled:  # disabled while connecting
            writer.close()
            upstream[1].close()
            return
        for w in (writer, upstream[1]):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(self, (reader, writer), upstream)
        self.connections.add(conn)
        conn.run()
        await conn.closed.wait()


class FaultProxy:
    """Every proxy, and the HTTP API that manages them. ``seed`` makes the toxics' random draws repeatable."""

    def __init__(self, seed: int | None = None) -> None:
        self.proxies: dict[str, Proxy] = {}
        self.rng = random.Random(seed)
        self.api_server: asyncio.Server | None = None
        self.api_address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve the API on ``host:port`` (0: any free port); returns the address bound."""
        self.api_server = await asyncio.start_server(self._serve_http, host, port, reuse_address=True)
        self.api_address = f"{host}:{self.api_server.sockets[0].getsockname()[1]}"
        return self.api_address

    async def stop(self) -> None:
        if self.api_server is not None:
            self.api_server.close()
        for p in list(self.proxies.values()):
            await p.disable()
        self.proxies.clear()
        if self.api_server is not None:
            await self.api_server.wait_closed()

    # -- the API, independent of HTTP --------------------------------------------

    def _proxy(self, name: str) -> Proxy:
        p = self.proxies.get(name)
        if p is None:
            raise ApiError(404, f"proxy not found: {name!r}; GET /proxies lists them")
        return p

    async def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """One API call: (status, JSON-able answer, None for no body, or text)."""
        parts = [p for p in path.split("?", 1)[0].split("/") if p]
        if parts == ["version"] and method == "GET":
            return 200, VERSION
        if parts == ["reset"] and method == "POST":
            for p in self.proxies.values():
                p.toxics.clear()
                p.toxics_changed()
                await p.enable()
            return 204, None
        if parts == ["proxies"]:
            if method == "GET":
                return 200, {name: p.as_json() for name, p in self.proxies.items()}
            if method == "POST":
                return 201, await self._create(_object(body))
        if len(parts) == 2 and parts[0] == "proxies":
            p = self._proxy(parts[1])
            if method == "GET":
                return 200, p.as_json()
            if method in ("POST", "PATCH"):
                return 200, await self._update(p, _object(body))
            if method == "DELETE":
                await p.disable()
                del self.proxies[p.name]
                return 204, None
        if len(parts) == 3 and parts[0] == "proxies" and parts[2] == "toxics":
            p = self._proxy(parts[1])
            if method == "GET":
                return 200, [t.as_json() for t in p.toxics.values()]
            if method == "POST":
                spec = _toxic(_object(body))
                if spec.name in p.toxics:
                    raise ApiError(409, f"toxic already exists: {spec.name!r}; delete it or give another name")
                p.toxics[spec.name] = spec
                p.toxics_changed()
                return 200, spec.as_json()
        if len(parts) == 4 and parts[0] == "proxies" and parts[2] == "toxics":
            p = self._proxy(parts[1])
            current = p.toxics.get(parts[3])
            if current is None:
                raise ApiError(404, f"toxic not found: {parts[3]!r} on proxy {p.name!r}")
            if method == "GET":
                return 200, current.as_json()
            if method in ("POST", "PATCH"):
                spec = _toxic({**_object(body), "name": current.name}, current)
                p.toxics[current.name] = spec
                p.toxics_changed()
                return 200, spec.as_json()
            if method == "DELETE":
                del p.toxics[current.name]
                p.toxics_changed()
                return 204, None
        raise ApiError(404, f"no such API call: {method} {path}")

    async def _create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        name, upstream = body.get("name"), body.get("upstream")
        if not isinstance(name, str) or not name or not isinstance(upstream, str):
            raise ApiError(400, "missing required field: a proxy needs a name and an upstream HOST:PORT")
        if name in self.proxies:
            raise ApiError(409, f"proxy already exists: {name!r}; delete it first or choose another name")
        listen = body.get("listen") or "127.0.0.1:0"
        if not isinstance(listen, str):
            raise ApiError(400, f"invalid listen address {listen!r}: expected HOST:PORT")
        split_address(listen, "listen address")
        split_address(upstream, "upstream address")
        p = Proxy(name, listen, upstream, self.rng)
        if body.get("enabled", True):
            await p.enable()
        self.proxies[name] = p
        return p.as_json()

    async def _update(self, p: Proxy, body: Mapping[str, Any]) -> dict[str, Any]:
        upstream = body.get("upstream")
        if upstream is not None:
            if not isinstance(upstream, str):
                raise ApiError(400, f"invalid upstream address {upstream!r}: expected HOST:PORT")
            split_address(upstream, "upstream address")
            p.upstream = upstream
        listen = body.get("listen")
        if listen is not None and listen != p.listen:
            if not isinstance(listen, str):
                raise ApiError(400, f"invalid listen address {listen!r}: expected HOST:PORT")
            split_address(listen, "listen address")
            was = p.enabled
            await p.disable()
            p.listen = listen
            if was:
                await p.enable()
        enabled = body.get("enabled")
        if enabled is True:
            await p.enable()
        elif enabled is False:
            await p.disable()
        return p.as_json()

    # -- HTTP/1.1, one request per connection ---------------------------------------

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, answer = await self._http_request(reader)
        except ApiError as exc:
            status, answer = exc.status, {"error": str(exc), "status": exc.status}
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, UnicodeDecodeError):
            writer.close()
            return
        if answer is None:
            payload, ctype = b"", "text/plain"
        elif isinstance(answer, str):
            payload, ctype = answer.encode(), "text/plain"
        else:
            payload, ctype = json.dumps(answer).encode(), "application/json"
        reason = {
            200: "OK",
            201: "Created",
            204: "No Content",
            400: "Bad Request",
            404: "Not Found",
            409: "Conflict",
            500: "Internal Server Error",
        }.get(status, "Status")
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nConnection: close\r\n"
        if status != 204:
            head += f"Content-Length: {len(payload)}\r\n"
        writer.write(head.encode() + b"\r\n" + (payload if status != 204 else b""))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _http_request(self, reader: asyncio.StreamReader) -> tuple[int, Any]:
        request_line = (await reader.readuntil(b"\r\n")).decode("latin-1").strip()
        method, path, _version = request_line.split(" ", 2)
        length = 0
        while True:
            line = (await reader.readuntil(b"\r\n")).decode("latin-1").strip()
            if not line:
                break
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-length":
                length = int(value.strip())
        if length > API_BODY_BYTES_MAX:
            raise ApiError(400, f"request body of {length} bytes is too large: the API takes JSON objects")
        raw = await reader.readexactly(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"bad request body: not JSON ({exc})") from None
        return await self.handle(method.upper(), path, body)


def _object(body: Any) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ApiError(400, "bad request body: send a JSON object")
    return body


def _toxic(body: Mapping[str, Any], current: ToxicSpec | None = None) -> ToxicSpec:
    try:
        return ToxicSpec.parse(body, current)
    except ToxicError as exc:
        raise ApiError(400, str(exc)) from None


__all__ = ["STREAMS", "ApiError", "FaultProxy", "Proxy"]
