"""The Kafka listener: an asyncio TCP server in the node process, the thin shell around
``georep/kafka/protocol.py`` (frames, codec) and ``georep/kafka/gateway.py`` (handlers).

Per connection, one reader task splits frames and dispatches each request as it arrives (a produce's
appends happen then, in order), and one writer task sends the responses in request order, as Kafka
clients require. A request the gateway does not serve gets an error response; only bytes that cannot be
framed (a negative or huge size) close the connection.

**SASL** (``georep node --kafka-sasl scram``, docs/kafka.md): the connection-level rule lives here, the
exchange in ``georep/kafka/sasl.py``. :class:`SaslSession` answers SaslHandshake (v0: the SASL tokens then
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography import x509

from georep.broker.acks import LEADER, Acks
from georep.broker.errors import InternalTopic
from georep.kafka.gateway import Client, KafkaGateway, Pending
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
from georep.kafka.sasl import MECHANISMS, ScramCredential, ScramFailed, ScramServer
from georep.security.acl_rpc import Policy
from georep.security.credentials import CredentialLookup
from georep.security.principal import Principal
from georep.security.tls import TlsConfig, principal_of_certificate
from topology.filters import INTERNAL_TOPIC_PREFIX, is_internal

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.groups import GroupService
    from georep.server.site_cluster import SiteCluster

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
IN_FLIGHT_MAX = 100  # requests read ahead of their responses, per connection (back-pressure on the reader)
NONCE_BYTES = 18
API_VERSIONS_KEY = 18
ILLEGAL_SASL_STATE = 34
UNSUPPORTED_SASL_MECHANISM = 33
SASL_AUTHENTICATION_FAILED = 58

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


class KafkaServer:
    def __init__(self, gateway: KafkaGateway, ssl_context: ssl.SSLContext | None = None,
                 sasl: Lookup | None = None) -> None:  # fmt: skip
        self.gateway = gateway
        self.ssl_context = ssl_context
        self.sasl = sasl  # the credentials of the SASL users; None: the listener takes no SASL
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
        sasl = SaslSession(self.sasl)
        queue: asyncio.Queue[tuple[Request, asyncio.Task[Any]] | bytes | None] = asyncio.Queue(IN_FLIGHT_MAX)
        sender = asyncio.create_task(self._send(queue, writer))
        frames = FrameReader()
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                for frame in frames.feed(data):
                    if sasl.raw:  # after a v0 handshake: a bare SASL token, answered bare
                        try:
                            token = sasl.step(frame)
                        except ScramFailed as exc:
                            raise CloseConnection(f"SASL authentication failed: {exc}") from None
                        await queue.put(len(token).to_bytes(4, "big") + token)
                        if sasl.principal is not None:
                            client = Client(host, sasl.principal)
                        continue
                    try:
                        req = decode_request(frame)
                        if not isinstance(req, Request):
                            if sasl.required and req.api_key not in (API_VERSIONS_KEY, SASL_HANDSHAKE,
                                                                     SASL_AUTHENTICATE):  # fmt: skip
                                raise CloseConnection(f"API key {req.api_key} before SASL authentication")
                            log.info("kafka: %s from %s: answered with an error code", req.reason, host)
                            await queue.put(error_response(req))
                            continue
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
                    except ValueError:
                        continue  # no header: nothing to answer
                    await queue.put((req, asyncio.ensure_future(pending)))
                    if close is not None:
                        raise CloseConnection(close)
        except CloseConnection as exc:
            log.info("kafka: closing the connection from %s: %s", host, exc)
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
    policy: Policy | None = None  # TLS or SASL: the site's ACLs, checked for every request
    sasl: bool = False  # --kafka-sasl scram: SASL/SCRAM required (SASL_SSL, or SASL_PLAINTEXT with --insecure)


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
    lookup = CredentialLookup(broker.metadata.acls) if options.sasl else None
    if lookup is not None and options.ssl_context is not None:  # SASL_SSL: SCRAM authenticates, not a certificate
        options.ssl_context.verify_mode = ssl.CERT_OPTIONAL
    server = KafkaServer(gateway, options.ssl_context, lookup)
    bound = await server.start(host, port)
    gateway.port = bound
    return server, f"{host}:{bound}"
