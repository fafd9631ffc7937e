"""The Kafka listener: an asyncio TCP server in the node process, the thin shell around
``georep/kafka/protocol.py`` (frames, codec) and ``georep/kafka/gateway.py`` (handlers).

Per connection, one reader task splits frames and dispatches each request as it arrives (a produce's
appends happen then, in order), and one writer task sends the responses in request order, as Kafka
clients require. A request the gateway does not serve gets an error response; only bytes that cannot be
framed (a negative or huge size) close the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography import x509

from georep.broker.acks import LEADER, Acks
from georep.broker.errors import InternalTopic
from georep.kafka.gateway import Client, KafkaGateway, Pending
from georep.kafka.protocol import (
    FrameReader,
    FrameTooLarge,
    Request,
    decode_request,
    encode_response,
    error_response,
    failure_response,
)
from georep.security.acl_rpc import Policy
from georep.security.principal import Principal
from georep.security.tls import TlsConfig, principal_of_certificate
from topology.filters import INTERNAL_TOPIC_PREFIX, is_internal

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.groups import GroupService
    from georep.server.site_cluster import SiteCluster

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.groups import GroupService
    from georep.server.site_cluster import SiteCluster

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
IN_FLIGHT_MAX = 100  # requests read ahead of their responses, per connection (back-pressure on the reader)


class KafkaServer:
    def __init__(self, gateway: KafkaGateway, ssl_context: ssl.SSLContext | None = None) -> None:
        self.gateway = gateway
        self.ssl_context = ssl_context
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (the one chosen, for port 0). Raises ``OSError`` if it cannot."""
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl_context,
                                                  reuse_address=True)  # fmt: skip
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        client = Client(host, peer_principal(writer))
        queue: asyncio.Queue[tuple[Request, asyncio.Task[Any]] | bytes | None] = asyncio.Queue(IN_FLIGHT_MAX)
        sender = asyncio.create_task(self._send(queue, writer))
        frames = FrameReader()
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                for frame in frames.feed(data):
                    try:
                        req = decode_request(frame)
                        if not isinstance(req, Request):
                            log.info("kafka: %s from %s: answered with an error code", req.reason, host)
                            await queue.put(error_response(req))
                            continue
                        pending: Pending = self.gateway.dispatch(req, client)
                    except ValueError:
                        continue  # no header: nothing to answer
                    await queue.put((req, asyncio.ensure_future(pending)))
        except FrameTooLarge as exc:
            log.warning("kafka: closing the connection from %s: %s", host, exc)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            try:
                queue.put_nowait(None)  # the sender answers what was read, then stops
            except asyncio.QueueFull:
                sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._connections.discard(task)

    async def _send(self, queue: asyncio.Queue[tuple[Request, asyncio.Task[Any]] | bytes | None],
                    writer: asyncio.StreamWriter) -> None:  # fmt: skip
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, bytes):
                    writer.write(item)
                else:
                    req, task = item
                    try:
                        response = await task
                        data = None if response is None else encode_response(req.api_key, req.version,
                                                                              req.correlation_id, response)
                    except Exception:  # a bug: answer UNKNOWN_SERVER_ERROR rather than leave the client waiting
                        log.exception("kafka: request %d v%d failed", req.api_key, req.version)
                        data = failure_response(req.api_key, req.version, req.correlation_id)
                    if data is not None:
                        writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, tuple):
                    item[1].cancel()


@dataclass(frozen=True, slots=True)
class KafkaOptions:
    """``georep node --kafka-listen HOST:PORT`` and its companions."""

    listen: tuple[str, int]
    commit_acks: Acks = LEADER  # the ack level of the commits OffsetCommit makes (geo:N waits for N sites)
    ssl_context: ssl.SSLContext | None = None  # TLS: mutual, with the node's certificates (server_ssl_context)
    policy: Policy | None = None  # TLS: the site's ACLs, checked for every request


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """Mutual TLS from the node's own files (``georep certs init``): its certificate and key, and only clients
    whose certificate the site's CA signed (Kafka's ``ssl.client.auth=required``)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_principal(writer: asyncio.StreamWriter) -> Principal | None:
    """The principal the client certificate names (``client:<name>``, ``site:<s>``...); None on plaintext."""
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    return principal_of_certificate(x509.load_der_x509_certificate(der))


async def start_kafka(options: KafkaOptions, broker: Broker, groups: GroupService,
                      site_cluster: SiteCluster | None) -> tuple[KafkaServer, str]:  # fmt: skip
    """Start the listener in the node's event loop; returns it and the address it serves (``node.json``).
    Raises ``OSError`` if it cannot listen."""
    host, port = options.listen

    async def create_topic(name: str, partitions: int, config: dict[str, str]) -> None:
        if is_internal(name):
            raise InternalTopic(f"topic names starting with {INTERNAL_TOPIC_PREFIX!r} are reserved for georep: "
                                "choose another name")  # fmt: skip
        if site_cluster is not None:
            await site_cluster.create_topic(name, partitions, config)
        else:
            broker.create_topic(name, partitions, config)

    gateway = KafkaGateway(broker, groups, host, port, create_topic, options.commit_acks, options.policy)
    server = KafkaServer(gateway, options.ssl_context)
    bound = await server.start(host, port)
    gateway.port = bound
    return server, f"{host}:{bound}"
