"""The Kafka listener's connection table: who may connect, and who has gone idle. Pure: time comes in as ``now_ms``.

Kafka's listener bounds, decided here and enforced by ``georep/kafka/server.py``:

* ``max.connections``: at most :attr:`ListenerLimits.max_connections` connections at once; one more is refused at
  accept, before its TLS handshake or any byte of it is read.
* ``max.connections.per.ip``: at most :attr:`ListenerLimits.max_connections_per_ip` of them from one address, so one
  host cannot take every slot (0: no bound per address).
* ``connections.max.idle.ms``: a connection is idle when no complete request arrived and no response left it for
  :attr:`ListenerLimits.idle_ms`, and no request of it is still being answered. A half-sent frame is no activity:
  the bytes of a frame count only once the frame is whole.

The table keeps its connections in the order of their last activity (an ``OrderedDict`` whose entries move to the
end at each activity), so a sweep reads only the idle ones at its head: one sweep over the listener instead of a
timer per connection, at a cost that does not grow with the connections that are busy.

:class:`LogThrottle` keeps a flood of refusals from flooding the log as well.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

# Kept free of kafka-python (slow to import): ``georep node`` reads these defaults for its flags' help.
FRAME_BYTES_MAX = 100 << 20  # Kafka's socket.request.max.bytes
FRAME_BYTES_BEFORE_AUTH = 512 << 10  # Kafka's sasl.server.max.receive.size
MAX_CONNECTIONS_DEFAULT = 1000
MAX_CONNECTIONS_PER_IP_DEFAULT = 100
IDLE_MS_DEFAULT = 600_000  # Kafka's connections.max.idle.ms
LOG_INTERVAL_MS = 10_000


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The bounds of one Kafka listener (``georep node --kafka-max-connections`` and its companions)."""

    max_connections: int = MAX_CONNECTIONS_DEFAULT
    max_connections_per_ip: int = MAX_CONNECTIONS_PER_IP_DEFAULT  # 0: no bound per address
    idle_ms: int = IDLE_MS_DEFAULT
    frame_bytes_before_auth: int = FRAME_BYTES_BEFORE_AUTH  # until SASL authentication succeeds
    frame_bytes_max: int = FRAME_BYTES_MAX  # afterwards, and on a listener that authenticates at its TLS handshake

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_connections_per_ip < 0 or self.idle_ms < 1:
            raise ValueError(
                f"invalid listener limits {self}: at least one connection, a bound per address of 0 "
                "(none) or more, and an idle time of at least 1 ms"
            )
        if not 0 < self.frame_bytes_before_auth <= self.frame_bytes_max:
            raise ValueError(
                f"invalid listener limits {self}: the bound before authentication must be positive and "
                "at most the frame bound"
            )

    def sweep_interval_ms(self) -> int:
        """How often the listener looks for idle connections: a tenth of the idle time, between 50 ms and 5 s (a
        connection is closed at most that much later than its idle time)."""
        return max(50, min(self.idle_ms // 10, 5_000))


@dataclass(frozen=True, slots=True)
class Refused:
    """A connection refused at accept; ``reason`` says which bound and the flag that sets it, ``bound`` names the
    bound (each is logged apart: a flood from one address does not hide a full listener)."""

    reason: str
    bound: str = "max_connections"


@dataclass(slots=True)
class _Connection:
    host: str
    last_active_ms: int
    in_flight: int = 0
    closing: bool = False  # returned by idle() once: the shell is closing it


class ConnectionTable:
    """The open connections of one listener, with their addresses and last activity."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.limits = limits
        self._connections: OrderedDict[int, _Connection] = OrderedDict()
        self._per_host: Counter[str] = Counter()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._connections)

    def admit(self, host: str, now_ms: int) -> int | Refused:
        """A new connection from ``host``: its id, or why it must be closed at once."""
        limits = self.limits
        if len(self._connections) >= limits.max_connections:
            return Refused(
                f"{len(self._connections)} connections are open, the most this listener takes (--kafka-max-connections)"
            )
        if limits.max_connections_per_ip and self._per_host[host] >= limits.max_connections_per_ip:
            return Refused(
                f"{self._per_host[host]} connections from {host} are open, the most one address may "
                "have (--kafka-max-connections-per-ip)",
                "max_connections_per_ip",
            )
        self._next_id += 1
        self._connections[self._next_id] = _Connection(host, now_ms)
        self._per_host[host] += 1
        return self._next_id

    def request(self, conn: int, now_ms: int) -> None:
        """A complete request arrived on ``conn``; it is in flight until :meth:`answered`."""
        state = self._connections.get(conn)
        if state is not None:
            state.in_flight += 1
            self._touch(conn, state, now_ms)

    def answered(self, conn: int, now_ms: int) -> None:
        """A request of ``conn`` was answered (or needed no answer)."""
        state = self._connections.get(conn)
        if state is not None:
            state.in_flight = max(0, state.in_flight - 1)
            self._touch(conn, state, now_ms)

    def release(self, conn: int) -> None:
        """``conn`` closed, for whatever reason."""
        state = self._connections.pop(conn, None)
        if state is not None:
            self._per_host[state.host] -= 1
            if self._per_host[state.host] <= 0:
                del self._per_host[state.host]

    def idle(self, now_ms: int) -> list[int]:
        """The connections idle for at least the idle time and not yet reported, oldest first; each is reported
        once (the caller closes it, then :meth:`release` s it)."""
        out: list[int] = []
        horizon = now_ms - self.limits.idle_ms
        for conn, state in self._connections.items():
            if state.last_active_ms > horizon:
                break  # every later one was active more recently
            if state.in_flight == 0 and not state.closing:
                state.closing = True
                out.append(conn)
        return out

    def host(self, conn: int) -> str:
        state = self._connections.get(conn)
        return "" if state is None else state.host

    def _touch(self, conn: int, state: _Connection, now_ms: int) -> None:
        state.last_active_ms = max(state.last_active_ms, now_ms)
        self._connections.move_to_end(conn)


class LogThrottle:
    """At most one log line per ``interval_ms`` for one kind of event: a flood of refusals is logged as a line now
    and then that says how many were left out since the previous one."""

    def __init__(self, interval_ms: int = LOG_INTERVAL_MS) -> None:
        self.interval_ms = interval_ms
        self._next_ms: int | None = None
        self._left_out = 0

    def allow(self, now_ms: int) -> int | None:
        """None: leave this event out of the log. Otherwise log it, with the returned count of the events left
        out since the last line."""
        if self._next_ms is not None and now_ms < self._next_ms:
            self._left_out += 1
            return None
        left_out, self._left_out = self._left_out, 0
        self._next_ms = now_ms + self.interval_ms
        return left_out
