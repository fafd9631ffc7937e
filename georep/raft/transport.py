"""A node's Raft port: pysyncobj's TCP transport with limits before authentication, and with the messages that
count on the journal held until it is fdatasynced.

pysyncobj 0.3.17's ``TcpConnection`` appends whatever arrives to one ``bytes`` buffer and reads a frame only once
all of the length its header announces is there; the secret is checked after that. So a process without the secret
that announces a frame of 2^31-1 bytes and streams makes the node copy the whole buffer at every read (50 MB took
20 s), in the tick thread, which then runs no election, heartbeat or commit: the node's site sees it as dead. It
also keeps an accepted connection open as long as no byte arrives on it. :class:`GuardedTransport` keeps pysyncobj's
``TCPTransport`` (the handshake, the members' connections, the utility messages) and replaces its connections and
its server:

* :class:`GuardedConnection` speaks the same frames (``georep.raft.frames``) and closes a connection at the first
  header over its bound: ``FRAME_BYTES_BEFORE_AUTH`` until a message on it has passed the secret's check (or, on a
  port without a secret, until its first message), then the largest frame a member sends. It decompresses at most
  the largest message, reads at most ``reads_per_event`` times per event, so one connection cannot hold the tick
  thread, and checks the token's timestamp and the connection's random key with ``if``, not with ``assert`` (gone
  under ``python -O``) as pysyncobj does. It closes a connection for silence only when an append (or its
  connect) went unanswered for ``connectionTimeout``, checked at each tick (:meth:`GuardedConnection.check_answered`):
  pysyncobj closed every connection that had received nothing for that long at its next send or read, dropping the
  message, and two followers exchange nothing until their leader dies, so the first vote request of every election
  was lost.
* :class:`GuardedServer` accepts up to ``accepts_per_event`` connections per event with a backlog of its own.
* :class:`GuardedTransport` keeps at most ``pending_connections_max`` accepted connections that are not a member's
  yet (the oldest is closed to make room, so a flood cannot keep a restarted member out: a member's handshake takes
  one round trip), closes each of them ``handshake_timeout_s`` after it was accepted, refuses any connection beyond
  ``connections_max``, and logs what it closed and why, at most every :data:`REFUSED_LOG_INTERVAL_S` per reason.

**Held messages** (``journal_sync``): Raft counts an entry as persisted on a node once it is in that node's
journal, so no node may answer for an entry, nor a leader count itself in its commit, while the entry is not
fsynced yet. With a ``journal_sync``, every message pysyncobj sends waits in an outbox. After each pass of the
poller (where a follower appends what the leader sent) and at the end of each tick (where the leader appends new
commands), the outbox goes out: first a leader's appends (Raft lets a leader write its log while it replicates it,
so the followers' fdatasyncs run meanwhile), then one fdatasync of the journal for everything added since the last
one (group commit), then every other message. The leader counts itself in a commit only from its next tick, after
that fdatasync. A message meant for a connection that closed meanwhile is dropped, as TCP would have dropped it. If
the fdatasync fails, nothing is sent any more and the replica stops before its next tick (the journal says why in
the log): a retried fsync may report success for pages the kernel dropped.

pysyncobj's habits around repeated appends are corrected on the way in (``georep.raft.appends``).
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pysyncobj.pickle as syncobj_pickle
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.monotonic import monotonic as syncobj_clock
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, _getAddrType, set_keepalive
from pysyncobj.transport import TCPTransport

from georep.raft.appends import Entry, TransmissionPieces, next_index_after_answer, trim_append
from georep.raft.frames import FRAME_HEADER_BYTES, FrameBounds, frame_length_fault

logger = logging.getLogger(__name__)

REFUSED_LOG_INTERVAL_S = 30.0
_HEADER = struct.Struct("i")  # pysyncobj's: a native int
_RETRY_LATER = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


@dataclass(frozen=True, slots=True)
class RaftPortLimits:
    """How much of a node the connections to its Raft port may take; see the module docstring."""

    pending_connections_max: int = 32  # accepted, not a member's yet (members handshake in one round trip)
    connections_max: int = 256  # accepted connections of every kind
    handshake_timeout_s: float = 5.0  # from accept until the connection is a member's
    reads_per_event: int = 16  # recv calls per readable event of one connection
    accepts_per_event: int = 16
    backlog: int = 128

    def __post_init__(self) -> None:
        if (
            min(
                self.pending_connections_max,
                self.connections_max,
                self.reads_per_event,
                self.accepts_per_event,
                self.backlog,
            )
            < 1
            or self.handshake_timeout_s <= 0
        ):
            raise ValueError(f"invalid Raft port limits {self}: every limit must be positive")


class _Refused(Exception):
    """A message that closes its connection."""


def _decompress(data: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise _Refused(f"a message that decompresses past {limit} bytes")
    return out


def _release(poller: Any, fileno: int | None, sock: socket.socket | None) -> None:
    """Stop polling ``fileno`` and close ``sock``: a socket is never left to the garbage collector."""
    if fileno is not None:
        poller.unsubscribe(fileno)
    if sock is not None:
        sock.close()


class GuardedConnection:
    """pysyncobj's ``TcpConnection``, the same interface and frames, with bounded frames, messages and reads.

    ``trusted``: frames may be as long as a member's from the start (an outgoing connection on a port without a
    secret, whose peer we dialled and which sends no handshake). ``on_refused(connection, why)`` is called when a
    frame or message closes the connection, before it closes.
    """

    def __init__(
        self,
        poller: Any,
        bounds: FrameBounds,
        on_refused: Callable[[GuardedConnection, str], None],
        *,
        sock: socket.socket | None = None,
        peer: str = "",
        trusted: bool = False,
        timeout_s: float = 10.0,
        send_buffer_bytes: int = 1 << 16,
        recv_buffer_bytes: int = 1 << 16,
        keepalive: tuple[int, int, int] | None = None,
        reads_per_event: int = 16,
    ) -> None:
        # read and written by pysyncobj's TCPTransport (the handshake of a port with a secret)
        self.sendRandKey: Any = None
        self.recvRandKey: Any = None
        self.recvLastTimestamp = 0
        self.encryptor: Any = None

        self.peer = peer
        self.opened_at = time.monotonic()
        self.epoch = 0  # changes at every connect and disconnect: a message held for an older one is dropped
        self._poller = poller
        self._bounds = bounds
        self._on_refused = on_refused
        self._trusted = trusted
        self._authenticated = trusted
        self._timeout_s = timeout_s
        self._send_buffer_bytes = send_buffer_bytes
        self._recv_buffer_bytes = recv_buffer_bytes
        self._keepalive = keepalive
        self._reads_per_event = reads_per_event
        self._read_buffer = bytearray()
        self._write_buffer = bytearray()
        # When the peer started to owe an answer (our connect, or an append since its last byte): see check_answered
        self._unanswered_since: float | None = None
        self._on_message: Callable[[Any], None] | None = None
        self._on_connected: Callable[[], None] | None = None
        self._on_disconnected: Callable[[], None] | None = None
        self._socket = sock
        self._fileno: int | None = None
        self._state = CONNECTION_STATE.DISCONNECTED
        if sock is not None:
            self._fileno = sock.fileno()
            self._state = CONNECTION_STATE.CONNECTED
            self._set_keepalive()
            self._subscribe(write=True)

    # -- the interface pysyncobj's TCPTransport uses ---------------------------------------------------------

    @property
    def state(self) -> int:
        return int(self._state)

    @property
    def authenticated(self) -> bool:
        """A message on it passed the secret's check (or, without a secret, it carried one message)."""
        return self._authenticated

    @property
    def frame_limit(self) -> int:
        return self._bounds.after_auth if self._authenticated else self._bounds.before_auth

    def setOnConnectedCallback(self, callback: Callable[[], None] | None) -> None:
        self._on_connected = callback

    def setOnMessageReceivedCallback(self, callback: Callable[[Any], None] | None) -> None:
        self._on_message = callback

    def setOnDisconnectedCallback(self, callback: Callable[[], None] | None) -> None:
        self._on_disconnected = callback

    def fileno(self) -> int | None:
        return self._fileno

    def getSendBufferSize(self) -> int:
        return len(self._write_buffer)

    def connect(self, host: str | None, port: int) -> bool:
        if host is None:
            return False
        self._drop_socket()  # a reconnect without a disconnect first must not leak the previous socket
        self._state = CONNECTION_STATE.DISCONNECTED
        self.epoch += 1
        self._authenticated = self._trusted
        self._read_buffer = bytearray()
        self._write_buffer = bytearray()
        self._unanswered_since = syncobj_clock()  # the connect must complete in time
        self.opened_at = time.monotonic()
        self.peer = f"{host}:{port}"
        sock = socket.socket(_getAddrType(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._socket = sock
        self._set_keepalive()
        try:
            sock.connect((host, port))
        except OSError as e:
            if e.errno not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                sock.close()
                self._socket = None
                return False
        self._fileno = sock.fileno()
        self._state = CONNECTION_STATE.CONNECTING
        self._subscribe(write=True)
        return True

    def _drop_socket(self) -> None:
        _release(self._poller, self._fileno, self._socket)
        self._fileno, self._socket = None, None

    def send(self, message: Any) -> None:
        if self._unanswered_since is None and _is_append(message):
            self._unanswered_since = syncobj_clock()
        if self.sendRandKey:
            message = (self.sendRandKey, message)
        data = zlib.compress(syncobj_pickle.dumps(message), 3)
        if self.encryptor:
            data = self.encryptor.encrypt_at_time(data, int(syncobj_clock()))
        if len(data) > self._bounds.after_auth:
            logger.error(
                "a Raft message of %d bytes to %s is over the %d bytes a member accepts: the peer will "
                "close the connection (a command larger than georep allows?)",
                len(data),
                self.peer,
                self._bounds.after_auth,
            )
        self._write_buffer += _HEADER.pack(len(data))
        self._write_buffer += data
        self._try_send()

    def disconnect(self) -> None:
        notify = self._on_disconnected is not None and self._state != CONNECTION_STATE.DISCONNECTED
        self.sendRandKey = None
        self.recvRandKey = None
        self.recvLastTimestamp = 0
        self._drop_socket()
        self._write_buffer = bytearray()
        self._read_buffer = bytearray()
        self._state = CONNECTION_STATE.DISCONNECTED
        self.epoch += 1
        if notify and self._on_disconnected is not None:
            self._on_disconnected()

    # -- events --------------------------------------------------------------------------------------------------

    def _set_keepalive(self) -> None:
        if self._socket is not None and self._keepalive is not None:
            set_keepalive(self._socket, *self._keepalive)

    def _subscribe(self, write: bool) -> None:
        mask = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR | (POLL_EVENT_TYPE.WRITE if write else 0)
        if self._fileno is not None:
            self._poller.subscribe(self._fileno, self._on_event, mask)

    def _on_event(self, descr: int, event: int) -> None:
        if descr != self._fileno:  # an event for a socket this connection closed meanwhile
            self._poller.unsubscribe(descr)
            return
        if event & POLL_EVENT_TYPE.ERROR:
            self.disconnect()
            return
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return
        if self._state == CONNECTION_STATE.CONNECTING and event & (POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE):
            assert self._socket is not None
            if self._socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.disconnect()
                return
            if self._on_connected is not None:
                self._on_connected()
            if self._state == CONNECTION_STATE.DISCONNECTED:
                return
            self._state = CONNECTION_STATE.CONNECTED
            self._unanswered_since = None
            return
        if event & POLL_EVENT_TYPE.WRITE:
            self._try_send()
            if self._state == CONNECTION_STATE.DISCONNECTED:
                return
            self._subscribe(write=bool(self._write_buffer))
        if event & POLL_EVENT_TYPE.READ:
            self._read()

    def check_answered(self) -> None:
        """Close the connection if its connect, or an append sent on it, has had no byte back for ``timeout_s``.

        pysyncobj closes a connection that has received nothing for its ``connectionTimeout`` whenever it next sends
        or reads on it, and drops the message that found it so. But two followers exchange nothing while their
        leader lives, so when it dies the first vote request one sends the other, and the other's answer, each found
        their connection "dead": the vote was lost, the other follower ran for leader too, and every death of a Raft
        leader cost a split vote (``bench/site_cluster.py --victim raft-leader``: two elections and 0.4 to 0.7 s
        without a leader, at a 500 ms session). Silence is no sign of death when nothing was asked: only an append
        (which a live member always answers) or a connect starts the clock, any byte back stops it, and the check
        runs at each tick, never on a send or a read, so it drops no message. A process that dies closes its
        connections at once; this catches a peer whose host went silent."""
        since = self._unanswered_since
        if (
            self._state != CONNECTION_STATE.DISCONNECTED
            and since is not None
            and syncobj_clock() - since > self._timeout_s
        ):
            self.disconnect()

    def _try_send(self) -> None:
        if self._state == CONNECTION_STATE.DISCONNECTED or self._socket is None:
            return
        while self._write_buffer:
            try:
                sent = self._socket.send(self._write_buffer)
            except OSError as e:
                if e.errno not in _RETRY_LATER:
                    self.disconnect()
                    return
                break
            if sent <= 0:
                break
            del self._write_buffer[:sent]
        if self._write_buffer and self._state == CONNECTION_STATE.CONNECTED:
            self._subscribe(write=True)  # pysyncobj waits for its next message to send the rest

    def _read(self) -> None:
        for _ in range(self._reads_per_event):
            if self._socket is None:
                return
            try:
                incoming = self._socket.recv(self._recv_buffer_bytes)
            except OSError as e:
                if e.errno not in _RETRY_LATER:
                    self.disconnect()
                    return
                break
            if not incoming:
                self.disconnect()
                return
            self._unanswered_since = None
            self._read_buffer += incoming
            self._deliver()
            if self._state == CONNECTION_STATE.DISCONNECTED:
                return
            if len(incoming) < self._recv_buffer_bytes:
                break  # drained

    def _deliver(self) -> None:
        """Hand over every whole frame in the read buffer; close at the first header over the bound."""
        while self._state != CONNECTION_STATE.DISCONNECTED:
            buffer = self._read_buffer
            if len(buffer) < FRAME_HEADER_BYTES:
                return
            (length,) = _HEADER.unpack_from(buffer)
            fault = frame_length_fault(length, self.frame_limit)
            if fault is not None:
                self._refuse(fault)
                return
            end = FRAME_HEADER_BYTES + length
            if len(buffer) < end:
                return
            frame = bytes(buffer[FRAME_HEADER_BYTES:end])
            del buffer[:end]
            try:
                message = self._decode(frame)
            except _Refused as e:
                self._refuse(str(e))
                return
            except Exception:  # not sealed with the secret (the encryptor logs it), or not a message
                self.disconnect()
                return
            self._authenticated = True
            if self._on_message is not None:
                self._on_message(message)

    def _decode(self, frame: bytes) -> Any:
        data = frame
        if self.encryptor:
            timestamp = self.encryptor.extract_timestamp(data)  # checks the HMAC first
            if timestamp < self.recvLastTimestamp:
                raise ValueError("a token older than the last one on this connection")
            self.recvLastTimestamp = timestamp
            data = self.encryptor.decrypt(data)
        message = syncobj_pickle.loads(_decompress(data, self._bounds.payload))
        if self.recvRandKey:
            rand_key, message = message
            if rand_key != self.recvRandKey:
                raise ValueError("a message without this connection's key")
        return message

    def _refuse(self, why: str) -> None:
        self._on_refused(self, why)
        self.disconnect()


class GuardedServer:
    """pysyncobj's ``TcpServer``: the listening socket, accepting a bounded number of connections per event and
    handing each socket to ``on_accepted(sock, peer)``."""

    def __init__(
        self,
        poller: Any,
        host: str,
        port: int,
        on_accepted: Callable[[socket.socket, str], None],
        limits: RaftPortLimits,
        send_buffer_bytes: int,
        recv_buffer_bytes: int,
    ) -> None:
        self._poller = poller
        self._host = host
        self._port = int(port)
        self._on_accepted = on_accepted
        self._limits = limits
        self._send_buffer_bytes = send_buffer_bytes
        self._recv_buffer_bytes = recv_buffer_bytes
        self._socket: socket.socket | None = None
        self._fileno: int | None = None

    def bind(self) -> None:
        sock = socket.socket(_getAddrType(self._host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_bytes)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
            sock.bind((self._host, self._port))
            sock.listen(self._limits.backlog)
        except OSError:
            sock.close()
            raise
        self._socket = sock
        self._fileno = sock.fileno()
        self._poller.subscribe(self._fileno, self._on_event, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def unbind(self) -> None:
        _release(self._poller, self._fileno, self._socket)
        self._fileno, self._socket = None, None

    def _on_event(self, descr: int, event: int) -> None:
        if event & POLL_EVENT_TYPE.ERROR:
            self.unbind()
            return
        if not event & POLL_EVENT_TYPE.READ or self._socket is None:
            return
        for _ in range(self._limits.accepts_per_event):
            try:
                sock, address = self._socket.accept()
            except OSError as e:
                if e.errno not in _RETRY_LATER + (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
                    logger.error("the Raft port %s:%d stopped accepting connections: %s", self._host, self._port, e)
                    self.unbind()
                return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_bytes)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            self._on_accepted(sock, f"{address[0]}:{address[1]}")


class _RefusalLog:
    """Warnings about closed connections: the first of each reason at once, later ones at most every
    :data:`REFUSED_LOG_INTERVAL_S` with their count."""

    def __init__(self, me: str) -> None:
        self._me = me
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}

    def note(self, reason: str, level: int, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            logged_at = self._logged_at.get(reason)
            if logged_at is not None and now - logged_at < REFUSED_LOG_INTERVAL_S:
                return
            count = self._counts.pop(reason)
            self._logged_at[reason] = now
        logger.log(level, "Raft node %s closed %d connection(s) to its Raft port: %s", self._me, count, detail)


_STRANGER = (
    "; a process without the site's Raft secret is probing or flooding the port, which should be "
    "reachable from the site's nodes only"
)


def _is_append(message: Any) -> bool:
    return isinstance(message, dict) and message.get("type") == "append_entries"


def _entry_at(raft_log: Any, index: int) -> Entry | None:
    position = index - raft_log[0][1]
    if 0 <= position < len(raft_log):
        entry: Entry = raft_log[position]
        return entry
    return None


class GuardedTransport(TCPTransport):  # type: ignore[misc]  # pysyncobj has no type hints
    """pysyncobj's ``TCPTransport`` over :class:`GuardedConnection` and :class:`GuardedServer`, with the limits and
    held messages of the module docstring. Build it through ``SyncObj(transportClass=functools.partial(
    GuardedTransport, limits=..., journal_sync=...))``."""

    def __init__(
        self,
        syncObj: Any,
        selfNode: Any,
        otherNodes: Any,
        *,
        limits: RaftPortLimits,
        journal_sync: Callable[[], None] | None = None,
    ) -> None:
        # before TCPTransport.__init__: it calls addNode and _createServer
        self._limits = limits
        self._bounds = FrameBounds.for_port(sealed=syncObj.encryptor is not None)
        self._pending: dict[GuardedConnection, None] = {}  # accepted, not a member's yet; oldest first
        self._pieces: dict[Any, TransmissionPieces] = {}  # per member: the split entry it is receiving (appends.py)
        self._accepted: set[GuardedConnection] = set()
        self._outbox: list[tuple[Any, GuardedConnection, int, Any]] = []
        self._journal_sync = journal_sync
        self._journal_failed = False
        self._refusals = _RefusalLog(selfNode.address if selfNode is not None else "(read-only)")
        super().__init__(syncObj, selfNode, otherNodes)
        if journal_sync is not None:
            poller = syncObj._poller
            poll = poller.poll

            def poll_then_flush(timeout: float) -> None:
                poll(timeout)
                self._flush()

            poller.poll = poll_then_flush

    @property
    def bounds(self) -> FrameBounds:
        return self._bounds

    # -- connections ---------------------------------------------------------------------------------------------

    def _new_connection(self, sock: socket.socket | None, peer: str, trusted: bool) -> GuardedConnection:
        conf = self._syncObj.conf
        return GuardedConnection(
            self._syncObj._poller,
            self._bounds,
            self._on_refused,
            sock=sock,
            peer=peer,
            trusted=trusted,
            timeout_s=conf.connectionTimeout,
            send_buffer_bytes=conf.sendBufferSize,
            recv_buffer_bytes=conf.recvBufferSize,
            keepalive=conf.tcp_keepalive,
            reads_per_event=self._limits.reads_per_event,
        )

    def _createServer(self) -> None:
        conf = self._syncObj.conf
        address = conf.bindAddress or self._selfNode.address
        host, port = address.rsplit(":", 1)
        if conf.bindAddress is None:  # pysyncobj's choice: every interface
            host = "::" if ":" in host else "0.0.0.0"
        if host not in ("0.0.0.0", "::"):
            host = globalDnsResolver().resolve(host)
        self._server = GuardedServer(
            self._syncObj._poller,
            host,
            int(port),
            self._on_accepted,
            self._limits,
            conf.sendBufferSize,
            conf.recvBufferSize,
        )

    def addNode(self, node: Any) -> None:
        self._nodes.add(node)
        self._nodeAddrToNode[node.address] = node
        if self._shouldConnect(node):
            # On a port without a secret the member we dial sends no handshake: its first frame may be an append.
            conn = self._new_connection(None, node.address, trusted=self._syncObj.encryptor is None)
            conn.encryptor = self._syncObj.encryptor
            conn.setOnConnectedCallback(lambda: self._onOutgoingConnected(conn))
            conn.setOnMessageReceivedCallback(lambda message: self._onMessageReceived(node, message))
            conn.setOnDisconnectedCallback(lambda: self._onDisconnected(conn))
            self._connections[node] = conn

    def _on_accepted(self, sock: socket.socket, peer: str) -> None:
        if len(self._accepted) >= self._limits.connections_max:
            sock.close()
            self._refusals.note(
                "connections",
                logging.WARNING,
                f"{self._limits.connections_max} connections open already (the last from {peer})",
            )
            return
        if len(self._pending) >= self._limits.pending_connections_max:
            oldest = next(iter(self._pending))
            self._refusals.note(
                "pending",
                logging.WARNING,
                f"{self._limits.pending_connections_max} connections had not authenticated: the "
                f"oldest (from {oldest.peer}) made room for a new one" + _STRANGER,
            )
            oldest.disconnect()
            self._pending.pop(oldest, None)
            self._accepted.discard(oldest)
        conn = self._new_connection(sock, peer, trusted=False)
        self._accepted.add(conn)
        self._pending[conn] = None
        self._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: GuardedConnection, message: Any) -> None:
        super()._onIncomingMessageReceived(conn, message)
        if conn not in self._unknownConnections:  # a member's now (or closed)
            self._pending.pop(conn, None)

    def _onDisconnected(self, conn: GuardedConnection) -> None:
        super()._onDisconnected(conn)
        self._pending.pop(conn, None)
        self._accepted.discard(conn)

    def _on_refused(self, conn: GuardedConnection, why: str) -> None:
        if not conn.authenticated:
            self._refusals.note(
                "frame-before-auth", logging.WARNING, f"{why} before authentication (from {conn.peer})" + _STRANGER
            )
        else:
            self._refusals.note(
                "frame",
                logging.ERROR,
                f"{why} from {conn.peer}, which holds the site's Raft secret: a node of another "
                "georep version, or a bug (a message larger than georep's bound)",
            )

    def _expire_pending(self) -> None:
        deadline = time.monotonic() - self._limits.handshake_timeout_s
        for conn in list(self._pending):
            if conn.opened_at > deadline:
                break  # oldest first
            self._refusals.note(
                "handshake",
                logging.WARNING,
                f"not a member's {self._limits.handshake_timeout_s:g} s after it was accepted "
                f"(from {conn.peer})" + _STRANGER,
            )
            conn.disconnect()
            self._pending.pop(conn, None)

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        """A member's message, with ``georep.raft.appends``' corrections, to pysyncobj."""
        if not isinstance(message, dict):
            super()._onMessageReceived(node, message)
            return
        if "transmission" in message:
            message = dict(self._pieces.setdefault(node, TransmissionPieces()).relabel(message))
        raft_log = self._syncObj._SyncObj__raftLog
        if len(raft_log) > 0:
            trimmed = trim_append(message, lambda index: _entry_at(raft_log, index), raft_log[-1][1])
            if trimmed is None:
                return
            message = trimmed
        next_index: dict[Any, int] = self._syncObj._SyncObj__raftNextIndex
        before = next_index.get(node)
        super()._onMessageReceived(node, message)
        kept = next_index_after_answer(message, before, next_index.get(node))
        if kept is not None and node in next_index:
            next_index[node] = kept

    def _onTick(self) -> None:
        super()._onTick()
        self._expire_pending()
        for conn in list(self._connections.values()):
            conn.check_answered()
        self._flush()

    # -- held messages -------------------------------------------------------------------------------------------

    def send(self, node: Any, message: Any) -> bool:
        if self._journal_sync is None:
            return bool(super().send(node, message))
        conn = self._connections.get(node)
        if conn is None or conn.state != CONNECTION_STATE.CONNECTED:
            return False
        self._outbox.append((node, conn, conn.epoch, message))
        return True

    def _flush(self) -> None:
        """Send a leader's appends, fdatasync the journal, then send what waited for it."""
        if self._journal_sync is None:
            return
        if self._journal_failed:
            self._outbox.clear()
            return
        outbox, self._outbox = self._outbox, []
        later = []
        for item in outbox:
            if _is_append(item[3]):
                self._send_held(*item)
            else:
                later.append(item)
        try:
            self._journal_sync()
        except OSError:  # the journal logged it: stop before the next tick could count this node in a commit
            if not self._journal_failed:
                self._journal_failed = True
                self._syncObj.destroy()
            return
        for item in later:
            self._send_held(*item)

    def _send_held(self, node: Any, conn: GuardedConnection, epoch: int, message: Any) -> None:
        if self._connections.get(node) is conn and conn.epoch == epoch and conn.state == CONNECTION_STATE.CONNECTED:
            conn.send(message)

    def destroy(self) -> None:
        self._outbox.clear()
        super().destroy()
        for conn in list(self._accepted):
            conn.disconnect()
        self._pending.clear()
        self._accepted.clear()
