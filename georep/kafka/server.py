"""The Kafka listener: an asyncio TCP server in the node process, the thin shell around
``georep/kafka/protocol.py`` (frames, codec) and ``georep/kafka/gateway.py`` (handlers).

Per connection, one reader task splits frames and dispatches each request as it arrives (a produce's
appends happen then, in order), and one writer task sends the responses in request order, as Kafka
clients require. A request the gateway does not serve gets an error response; only bytes that cannot be
framed (a negative or huge size) close the connection.

**SASL** (``georep node --kafka-sasl scram``, docs/kafka.md): the connection-level rule lives here, the
exchange in ``georep/auth/sasl.py``. :class:`SaslSession` answers SaslHandshake (v0: the SASL tokens then
come as raw frames, without a Kafka header; v1: inside SaslAuthenticate) and SaslAuthenticate, and the
connection's principal becomes ``client:<user>`` once the exchange succeeds, replacing any TLS client
certificate's (Kafka's rule: the SASL principal wins). Until then only ApiVersions, SaslHandshake and
SaslAuthenticate are served; any other request closes the connection, as Kafka does (the client reports
the missing authentication rather than a per-request error it might retry). A failed authentication is
answered with SASL_AUTHENTICATION_FAILED and its message, then the connection is closed (Kafka again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509

from georep.auth.credentials import CredentialLookup
from georep.auth.policy import Policy
from georep.auth.principal import Principal
from georep.auth.sasl import MECHANISMS, ScramCredential, ScramFailed, ScramServer
from georep.broker.acks import LEADER, Acks
from georep.broker.errors import NotLeader
from georep.kafka.connections import ConnectionTable, ListenerLimits, LogThrottle, Refused
from georep.kafka.errors import OFFSET_OUT_OF_RANGE
from georep.kafka.gateway import AskLeader, Client, KafkaGateway, LeaderRefused, Pending
from georep.kafka.protocol import (
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    FrameReader,
    FrameTooLarge,
    Request,
    decode_request,
    encode_response,
    error_response,
    failure_response,
    sasl_authenticate_body,
    sasl_handshake_body,
)
from georep.metadata.kafka_config import SiteSettings
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, principal_of_certificate

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.groups import GroupService
    from georep.server.site_cluster import SiteCluster
    from georep.server.topic_changes import TopicChanges

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
STOP_GRACE_S = 2.0
TLS_HANDSHAKE_TIMEOUT_S = 10.0
IN_FLIGHT_MAX = 100  # requests read ahead of their responses, per connection (back-pressure on the reader)
NONCE_BYTES = 18
API_VERSIONS_KEY = 18
ILLEGAL_SASL_STATE = 34
UNSUPPORTED_SASL_MECHANISM = 33
SASL_AUTHENTICATION_FAILED = 58
LEADER_ASK_TIMEOUT_S = 5.0  # a group coordinator's ask of a partition's leader (a commit's vector)

Lookup = Callable[[str, str], ScramCredential | None]  # (mechanism, user) -> the user's credential, if any


class CloseConnection(Exception):
    """The connection must close once what was read is answered; the message says why (logged)."""


class SaslSession:
    """One connection's SASL state: no handshake yet, a handshake (an exchange under way) or authenticated.
    ``lookup`` None: the listener does not take SASL (handshakes are answered ILLEGAL_SASL_STATE)."""

    def __init__(self, lookup: Lookup | None) -> None:
        self.lookup = lookup
        self.scram: ScramServer | None = None
        self.raw = False  # a v0 handshake: the next frames are bare SASL tokens
        self.principal: Principal | None = None

    @property
    def required(self) -> bool:
        return self.lookup is not None and self.principal is None

    def handshake(self, req: Request) -> Any:
        mechanism = req.body.mechanism
        if self.lookup is None or self.scram is not None or self.principal is not None:
            return sasl_handshake_body(req.version, ILLEGAL_SASL_STATE, [])
        if mechanism not in MECHANISMS:
            return sasl_handshake_body(req.version, UNSUPPORTED_SASL_MECHANISM, list(MECHANISMS))
        lookup = self.lookup
        self.scram = ScramServer(mechanism, lambda user: lookup(mechanism, user), secrets.token_urlsafe(NONCE_BYTES))
        self.raw = req.version == 0
        return sasl_handshake_body(req.version, 0, list(MECHANISMS))

    def step(self, token: bytes) -> bytes:
        """The answer to one client token; raises :class:`ScramFailed` (and stays failed)."""
        if self.scram is None or self.principal is not None:
            raise ScramFailed("SaslAuthenticate without a SaslHandshake first, or after authentication")
        out = self.scram.step(token)
        if self.scram.done:
            self.principal = Principal("client", self.scram.user)
            self.raw = False
        return out

    def authenticate(self, req: Request) -> tuple[Any, bool]:
        """SaslAuthenticate's response, and whether the connection must close (a failure)."""
        try:
            return sasl_authenticate_body(req.version, 0, None, self.step(bytes(req.body.auth_bytes))), False
        except ScramFailed as exc:
            return sasl_authenticate_body(req.version, SASL_AUTHENTICATION_FAILED, str(exc), b""), True


Answer = tuple[Request, "asyncio.Future[Any]"] | bytes  # a request and its pending response, or raw SASL bytes


class KafkaServer:
    def __init__(
        self,
        gateway: KafkaGateway,
        ssl_context: ssl.SSLContext | None = None,
        sasl: Lookup | None = None,
        limits: ListenerLimits | None = None,
    ) -> None:
        self.gateway = gateway
        self.ssl_context = ssl_context
        self.sasl = sasl  # the credentials of the SASL users; None: the listener takes no SASL
        self.limits = limits = limits or ListenerLimits()
        self.table = ConnectionTable(limits)
        self._server: asyncio.Server | None = None
        self._open: dict[int, _Open] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._refused_log: dict[str, LogThrottle] = {}
        self._oversized_log = LogThrottle()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (the one chosen, for port 0). Raises ``OSError`` if it cannot."""
        loop = asyncio.get_running_loop()

        def accepted() -> _Accepted:
            return _Accepted(asyncio.StreamReader(loop=loop), self._serve, loop=loop)

        # TLS is started by each connection's task once the connection is admitted (start_server's ssl= would
        # shake hands with every connection first, however many are open).
        self._server = await loop.create_server(accepted, host, port, reuse_address=True)
        self._sweeper = asyncio.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Close the port and every connection; requests in flight are dropped (their clients retry elsewhere)."""
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            self._server.close()
        for conn in list(self._open.values()):
            conn.close()
        tasks = [conn.task for conn in self._open.values()]
        if tasks:
            _done, late = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            for task in late:  # not expected: every connection ends once its transport is closed
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), STOP_GRACE_S)

    async def _sweep(self) -> None:
        """Close the connections idle past the idle time (``connections.max.idle.ms``): one pass for all of them."""
        interval_s = self.limits.sweep_interval_ms() / 1000
        while True:
            await asyncio.sleep(interval_s)
            idle = self.table.idle(_now_ms())
            if not idle:
                continue
            peers = [self._open[c].peer for c in idle if c in self._open]
            log.info(
                "kafka: closing %d connection(s) with no request for %d ms (--connections-max-idle-ms): %s%s",
                len(idle),
                self.limits.idle_ms,
                ", ".join(peers[:5]),
                f" and {len(peers) - 5} more" if len(peers) > 5 else "",
            )
            for conn in idle:
                if conn in self._open:
                    self._open[conn].close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Only stop() cancels a connection, and only one that outlived its grace. Ending normally matters: asyncio
        # logs a cancelled connection task as an error, with a traceback (its callback asks the task's exception).
        with contextlib.suppress(asyncio.CancelledError):
            await self._connection(reader, writer)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        host = str(peername[0]) if peername else ""
        peer = f"{host}:{peername[1]}" if peername else "?"
        admitted = (
            self.table.admit(host, _now_ms()) if not self._stopping else Refused("the node is stopping", "stopping")
        )
        if isinstance(admitted, Refused):
            writer.transport.abort()
            left_out = self._refused_log.setdefault(admitted.bound, LogThrottle()).allow(_now_ms())
            if left_out is not None:
                log.warning(
                    "kafka: refused the connection from %s at accept: %s%s", peer, admitted.reason, _left_out(left_out)
                )
            return
        task = asyncio.current_task()
        assert task is not None
        conn = _Open(admitted, peer, writer, task)
        self._open[admitted] = conn
        try:
            if self.ssl_context is not None:
                try:
                    await writer.start_tls(
                        self.ssl_context, ssl_handshake_timeout=min(TLS_HANDSHAKE_TIMEOUT_S, self.limits.idle_ms / 1000)
                    )
                except (OSError, EOFError):  # a failed or abandoned handshake (ssl.SSLError is an OSError)
                    return
            else:
                transport = writer.transport
                assert isinstance(transport, asyncio.ReadTransport)
                transport.resume_reading()
            await self._requests(conn, reader, writer, host)
        finally:
            self._open.pop(admitted, None)
            self.table.release(admitted)
            writer.close()  # sends what is still buffered (a refusal's answer), then closes
            try:
                await asyncio.wait_for(writer.wait_closed(), STOP_GRACE_S)
            except Exception:  # a client that does not read, or a connection already reset
                writer.transport.abort()

    async def _requests(
        self, conn: _Open, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        client = Client(host, peer_principal(writer))
        sasl = SaslSession(self.sasl)
        queue: asyncio.Queue[Answer | None] = asyncio.Queue(IN_FLIGHT_MAX)
        sender = asyncio.create_task(self._send(conn.id, queue, writer))
        conn.sender = sender
        limits = self.limits
        frames = FrameReader(limits.frame_bytes_before_auth if sasl.required else limits.frame_bytes_max)
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                frames.feed(data)
                while not conn.closed and (frame := frames.next_frame()) is not None:
                    self.table.request(conn.id, _now_ms())
                    answer = self._answer(frame, client, sasl, host)
                    if answer is None:  # nothing to answer
                        self.table.answered(conn.id, _now_ms())
                        continue
                    item, client, close = answer
                    await queue.put(item)
                    if close is not None:
                        raise CloseConnection(close)
                    if not sasl.required:  # authenticated (or no SASL): the listener's full bound from now on
                        frames.max_frame_bytes = limits.frame_bytes_max
        except CloseConnection as exc:
            log.info("kafka: closing the connection from %s: %s", conn.peer, exc)
        except FrameTooLarge as exc:
            self._oversized(conn.peer, exc, sasl.required)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            try:
                queue.put_nowait(None)  # the sender answers what was read, then stops
            except asyncio.QueueFull:
                sender.cancel()
            if writer.transport.is_closing():  # closed by us (idle, stop) or by the client: nobody reads answers
                sender.cancel()
            with contextlib.suppress(BaseException):
                await sender

    def _answer(
        self, frame: bytes, client: Client, sasl: SaslSession, host: str
    ) -> tuple[Answer, Client, str | None] | None:
        """What to queue for one frame, the connection's client from then on, and why it must close after (None:
        it stays open); None for a frame with nothing to answer. Raises :class:`CloseConnection`."""
        if sasl.raw:  # after a v0 handshake: a bare SASL token, answered bare
            try:
                token = sasl.step(frame)
            except ScramFailed as exc:
                raise CloseConnection(f"SASL authentication failed: {exc}") from None
            if sasl.principal is not None:
                client = Client(host, sasl.principal)
            return len(token).to_bytes(4, "big") + token, client, None
        try:
            req = decode_request(frame)
        except ValueError:
            return None  # no header: nothing to answer
        if not isinstance(req, Request):
            if sasl.required and req.api_key not in (API_VERSIONS_KEY, SASL_HANDSHAKE, SASL_AUTHENTICATE):
                raise CloseConnection(f"API key {req.api_key} before SASL authentication")
            log.info("kafka: %s from %s: answered with an error code", req.reason, host)
            return error_response(req), client, None
        close: str | None = None
        if req.api_key == SASL_HANDSHAKE:
            pending: Pending = _done(sasl.handshake(req))
        elif req.api_key == SASL_AUTHENTICATE:
            response, failed = sasl.authenticate(req)
            pending = _done(response)
            close = f"SASL authentication failed: {response.error_message}" if failed else None
            if sasl.principal is not None:  # SASL's principal wins over the certificate's
                client = Client(host, sasl.principal)
        elif sasl.required and req.api_key != API_VERSIONS_KEY:
            raise CloseConnection(f"API key {req.api_key} before SASL authentication")
        else:
            pending = self.gateway.dispatch(req, client)
        return (req, asyncio.ensure_future(pending)), client, close

    def _oversized(self, peer: str, exc: FrameTooLarge, before_auth: bool) -> None:
        left_out = self._oversized_log.allow(_now_ms())
        if left_out is None:
            return
        if before_auth:
            log.warning(
                "kafka: closing the connection from %s: a frame of %d bytes before SASL authentication "
                "(at most %d until the client has authenticated, as Kafka's sasl.server.max.receive.size)%s",
                peer,
                exc.size,
                exc.limit,
                _left_out(left_out),
            )
        else:
            log.warning(
                "kafka: closing the connection from %s: a frame of %d bytes (at most %d, as Kafka's "
                "socket.request.max.bytes)%s",
                peer,
                exc.size,
                exc.limit,
                _left_out(left_out),
            )

    async def _send(self, conn: int, queue: asyncio.Queue[Answer | None], writer: asyncio.StreamWriter) -> None:
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
                        data = (
                            None
                            if response is None
                            else encode_response(req.api_key, req.version, req.correlation_id, response)
                        )
                    except Exception:  # a bug: answer UNKNOWN_SERVER_ERROR rather than leave the client waiting
                        log.exception("kafka: request %d v%d failed", req.api_key, req.version)
                        data = failure_response(req.api_key, req.version, req.correlation_id)
                    if data is not None:
                        writer.write(data)
                await writer.drain()
                self.table.answered(conn, _now_ms())
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, tuple):
                    item[1].cancel()


class _Accepted(asyncio.StreamReaderProtocol):
    """A connection just accepted: nothing is read from it until its task has admitted it, and started TLS if the
    listener takes TLS (a client hello read before would land in the plaintext buffer, and the handshake stall)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        transport.pause_reading()
        super().connection_made(transport)


@dataclass(slots=True)
class _Open:
    """One admitted connection, as the listener closes it (idle, or stopping)."""

    id: int
    peer: str  # HOST:PORT, for the log
    writer: asyncio.StreamWriter
    task: asyncio.Task[None]
    sender: asyncio.Task[None] | None = None
    closed: bool = False

    def close(self) -> None:
        """Abort the transport: the reader sees the end of the stream and the connection task ends by itself."""
        self.closed = True
        self.writer.transport.abort()
        if self.sender is not None:
            self.sender.cancel()  # answers in flight would go nowhere


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


def _left_out(count: int) -> str:
    return f" ({count} more like it since the last such line)" if count else ""


@dataclass(frozen=True, slots=True)
class KafkaOptions:
    """``georep node --kafka-listen HOST:PORT`` and its companions."""

    listen: tuple[str, int]
    commit_acks: Acks = LEADER  # the ack level of the commits OffsetCommit makes (geo:N waits for N sites)
    ssl_context: ssl.SSLContext | None = None  # TLS: mutual, with the node's certificates (server_ssl_context)
    policy: Policy | None = None  # TLS or SASL: the site's ACLs, checked for every request
    sasl: bool = False  # --kafka-sasl scram: SASL/SCRAM required (SASL_SSL, or SASL_PLAINTEXT with --insecure)
    limits: ListenerLimits | None = None  # --kafka-max-connections and its companions (None: the defaults)


def server_ssl_context(tls: TlsConfig, sasl: bool = False) -> ssl.SSLContext:
    """TLS from the node's own files (``georep certs init``): its certificate and key. Without SASL, only clients
    whose certificate the site's CA signed (Kafka's ``ssl.client.auth=required``); with SASL (SASL_SSL) the
    client authenticates with SCRAM, and a certificate is optional (checked against the CA if presented)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.verify_mode = ssl.CERT_OPTIONAL if sasl else ssl.CERT_REQUIRED
    return ctx


def _done(response: Any) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(response)
    return future


def peer_principal(writer: asyncio.StreamWriter) -> Principal | None:
    """The principal the client certificate names (``client:<name>``, ``site:<s>``...); None on plaintext."""
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    return principal_of_certificate(x509.load_der_x509_certificate(der))


async def start_kafka(
    options: KafkaOptions,
    broker: Broker,
    groups: GroupService,
    site_cluster: SiteCluster | None,
    topic_changes: TopicChanges | None = None,
) -> tuple[KafkaServer, str]:
    """Start the listener in the node's event loop; returns it and the address it serves (``node.json``).
    Raises ``OSError`` if it cannot listen."""
    host, port = options.listen

    async def create_topic(name: str, partitions: int, config: dict[str, str]) -> None:
        # An internal topic's name is refused by Broker.create_topic, for both front ends.
        if site_cluster is not None:
            await site_cluster.create_topic(name, partitions, config)
        else:
            broker.create_topic(name, partitions, config)

    gateway = KafkaGateway(broker, groups, host, port, create_topic, options.commit_acks, options.policy)
    gateway.topic_changes = topic_changes
    if site_cluster is not None:
        config = site_cluster.member.config
        gateway.site = SiteSettings(config.replication_factor, config.ack_quorum)
    lookup = CredentialLookup(broker.metadata.acls) if options.sasl else None
    if lookup is not None and options.ssl_context is not None:  # SASL_SSL: SCRAM authenticates, not a certificate
        options.ssl_context.verify_mode = ssl.CERT_OPTIONAL
    server = KafkaServer(gateway, options.ssl_context, lookup, options.limits)
    bound = await server.start(host, port)
    gateway.port = bound
    return server, f"{host}:{bound}"


def leader_asker(site_cluster: SiteCluster) -> AskLeader:
    """How a group's coordinator asks a partition's leader (another node of its site) for a Kafka offset: georep's
    ``ListOffsets`` with a ``kafka`` ask, over the site's peer channels."""

    async def ask(topic: str, partition: int, question: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        address = site_cluster.leader_address(topic, partition)
        if not address:
            raise NotLeader(topic, partition, "the site names no leader of it now")
        request = pb.ListOffsetsRequest(topic=topic, partition=partition, kafka=question)
        try:
            async with site_cluster.channel(address) as channel:
                answer = await pbg.NodeStub(channel).ListOffsets(request, timeout=LEADER_ASK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # a commit below the log start: the client must hear it
                raise LeaderRefused(OFFSET_OUT_OF_RANGE, str(exc.details())) from exc
            raise
        return answer.offsets[0]

    return ask
