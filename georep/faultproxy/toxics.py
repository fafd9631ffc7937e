"""Toxics: how a fault transforms one direction of a proxied TCP connection. Sans-I/O.

A proxied connection has two directions: ``upstream`` (client to server) and
``downstream`` (server to client). Each direction runs the bytes it reads
through a :class:`Pipeline` of the proxy's toxics for that direction, in the
order they were added (Toxiproxy's order). The shell
(``georep/faultproxy/proxy.py``) reads a chunk, calls
:meth:`Pipeline.feed` with it and ``now_ms``, and gets back
:class:`Piece` s, each with the time it may be written, and perhaps an
:class:`End` of the connection. It writes the pieces in the order it got
them, never before their time, so the byte stream keeps its order whatever a
toxic does (TCP never reorders, and neither does Toxiproxy: its toxics handle
one chunk at a time).

The toxics follow Toxiproxy's semantics (read from its documentation and
``toxics/*.go``; no code is taken from it):

* ``latency`` (``latency``, ``jitter`` in ms): each chunk leaves
  ``latency ± jitter`` after it was read, but never before the chunk ahead of
  it. The delay is a pure delay line: chunks are not held back by the ones
  still in flight, so a long-RTT link keeps its bandwidth (a long fat pipe).
* ``bandwidth`` (``rate`` in KB/s, that is bytes per ms): the direction
  drains at ``rate``; a chunk larger than 100 ms worth leaves in slices.
  0 means unlimited.
* ``slicer`` (``average_size``, ``size_variation`` in bytes, ``delay`` in
  µs): each chunk is cut in pieces of about ``average_size`` bytes (split in
  halves, each cut moved by up to ``size_variation``), ``delay`` apart.
* ``timeout`` (``timeout`` in ms): no data gets through (it is dropped); the
  connection is closed ``timeout`` ms after the toxic started on it, never if
  0. Removing the toxic closes the connections it was holding (so a client
  reconnects and finds the link working again).
* ``reset_peer`` (``timeout`` in ms): the first chunk after the toxic started
  is dropped, and ``timeout`` ms later the connection is reset (TCP RST, no
  FIN).
* ``limit_data`` (``bytes``): the connection is closed once that many bytes
  have passed in this direction.

``toxicity`` (0 to 1) is the chance that a toxic acts on a given connection;
it is drawn once per connection when the toxic starts on it, as in Toxiproxy.
Every random draw comes from the ``random.Random`` the shell passes in, so a
seeded run repeats itself.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

STREAMS = ("upstream", "downstream")


class ToxicError(Exception):
    """A toxic definition the API refuses (HTTP 400); the message says what to send instead."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes that may be written at ``at_ms``, not before."""

    at_ms: float
    data: bytes


@dataclass(frozen=True, slots=True)
class End:
    """The connection ends at ``at_ms``: reset (RST) or closed (FIN)."""

    at_ms: float
    reset: bool


# type -> {attribute: default}; every attribute is an integer.
ATTRIBUTES: dict[str, dict[str, int]] = {
    "latency": {"latency": 0, "jitter": 0},
    "bandwidth": {"rate": 0},
    "slicer": {"average_size": 0, "size_variation": 0, "delay": 0},
    "timeout": {"timeout": 0},
    "reset_peer": {"timeout": 0},
    "limit_data": {"bytes": 0},
}


@dataclass(frozen=True, slots=True)
class ToxicSpec:
    """One toxic as the API shows it."""

    name: str
    type: str
    stream: str
    toxicity: float
    attributes: Mapping[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
            "attributes": dict(self.attributes),
        }

    @classmethod
    def parse(cls, body: Mapping[str, object], current: ToxicSpec | None = None) -> ToxicSpec:
        """A toxic from an API body; with ``current``, an update (missing fields keep their values)."""
        kind = body.get("type", current.type if current else None)
        if not isinstance(kind, str) or kind not in ATTRIBUTES:
            raise ToxicError(f"invalid toxic type {kind!r}: use one of {', '.join(sorted(ATTRIBUTES))}")
        if current is not None and kind != current.type:
            raise ToxicError(f"toxic {current.name!r} is a {current.type} toxic: delete it to change its type")
        stream = body.get("stream", current.stream if current else "downstream")
        if stream not in STREAMS:
            raise ToxicError(f"invalid stream {stream!r}: use upstream or downstream")
        assert isinstance(stream, str)
        name = body.get("name", current.name if current else f"{kind}_{stream}")
        if not isinstance(name, str) or not name:
            raise ToxicError(f"invalid toxic name {name!r}: give a non-empty string")
        toxicity = body.get("toxicity", current.toxicity if current else 1.0)
        if isinstance(toxicity, bool) or not isinstance(toxicity, int | float) or not 0.0 <= toxicity <= 1.0:
            raise ToxicError(f"invalid toxicity {toxicity!r}: give a number from 0 to 1")
        given = body.get("attributes", {})
        if not isinstance(given, Mapping):
            raise ToxicError(f'invalid attributes {given!r}: give an object such as {{"latency": 100}}')
        attributes = dict(current.attributes) if current else dict(ATTRIBUTES[kind])
        for key, value in given.items():
            if key not in ATTRIBUTES[kind]:
                raise ToxicError(
                    f"a {kind} toxic has no attribute {key!r}: its attributes are {', '.join(sorted(ATTRIBUTES[kind]))}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ToxicError(f"invalid {kind} attribute {key}={value!r}: give a non-negative integer")
            attributes[key] = value
        return cls(name, kind, stream, float(toxicity), attributes)


class Stage:
    """One toxic acting on one direction of one connection: chunks in, pieces out."""

    closes_on_removal = False

    def start(self, now_ms: float) -> End | None:
        """The toxic starts acting on the connection now; it may schedule the connection's end."""
        return None

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        return [piece], None


class Passthrough(Stage):
    """A toxic that does not act on this connection (its toxicity draw said so)."""


class Latency(Stage):
    def __init__(self, latency_ms: int, jitter_ms: int, rng: random.Random) -> None:
        self.latency_ms, self.jitter_ms, self.rng = latency_ms, jitter_ms, rng
        self.last_ms = float("-inf")

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        delay = self.latency_ms
        if self.jitter_ms > 0:
            delay += self.rng.randrange(-self.jitter_ms, self.jitter_ms)
        self.last_ms = max(piece.at_ms + delay, self.last_ms)
        return [Piece(self.last_ms, piece.data)], None


class Bandwidth(Stage):
    SLICE_MS = 100  # a chunk larger than this much of the rate leaves in slices

    def __init__(self, rate_bytes_per_ms: int) -> None:
        self.rate = rate_bytes_per_ms
        self.free_ms = float("-inf")  # when the link has sent everything handed to it so far

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        if self.rate <= 0:
            return [piece], None
        out = []
        step = self.rate * self.SLICE_MS
        data = piece.data
        for pos in range(0, len(data), step):
            part = data[pos : pos + step]
            self.free_ms = max(self.free_ms, piece.at_ms) + len(part) / self.rate
            out.append(Piece(self.free_ms, part))
        return out, None


class Slicer(Stage):
    def __init__(self, average_size: int, size_variation: int, delay_us: int, rng: random.Random) -> None:
        self.average, self.variation, self.delay_ms, self.rng = average_size, size_variation, delay_us / 1000, rng
        self.last_ms = float("-inf")

    def cuts(self, start: int, end: int) -> list[int]:
        """Where to cut ``[start, end)``: halves, each cut moved by up to ``size_variation``, until small enough."""
        out = [start]
        todo = [(start, end)]
        while todo:  # depth first, left before right: the cuts come out in order
            lo, hi = todo.pop()
            if hi - lo - self.average <= self.variation or hi - lo < 2:
                out.append(hi)
                continue
            mid = lo + (hi - lo) // 2
            if self.variation > 0:
                mid += self.rng.randrange(-self.variation, self.variation)
            mid = min(max(mid, lo + 1), hi - 1)
            todo.append((mid, hi))
            todo.append((lo, mid))
        return out

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        if self.average <= 0:
            return [piece], None
        cuts = self.cuts(0, len(piece.data))
        out = []
        at = max(piece.at_ms, self.last_ms)
        for i in range(1, len(cuts)):
            out.append(Piece(at, piece.data[cuts[i - 1] : cuts[i]]))
            self.last_ms = at
            at += self.delay_ms
        return out, None


class Timeout(Stage):
    closes_on_removal = True

    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms

    def start(self, now_ms: float) -> End | None:
        return End(now_ms + self.timeout_ms, reset=False) if self.timeout_ms > 0 else None

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        return [], None  # dropped


class ResetPeer(Stage):
    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        self.triggered = False

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        if self.triggered:
            return [], None
        self.triggered = True
        return [], End(piece.at_ms + self.timeout_ms, reset=True)


class LimitData(Stage):
    def __init__(self, limit_bytes: int) -> None:
        self.left = limit_bytes

    def feed(self, piece: Piece) -> tuple[list[Piece], End | None]:
        if self.left <= 0:
            return [], End(piece.at_ms, reset=False)
        data = piece.data[: self.left]
        self.left -= len(data)
        return [Piece(piece.at_ms, data)], End(piece.at_ms, reset=False) if self.left <= 0 else None


def make_stage(spec: ToxicSpec, rng: random.Random) -> Stage:
    """The stage of ``spec`` for one new connection: its toxicity is drawn here."""
    if spec.toxicity < 1.0 and rng.random() >= spec.toxicity:
        return Passthrough()
    a = spec.attributes
    if spec.type == "latency":
        return Latency(a["latency"], a["jitter"], rng)
    if spec.type == "bandwidth":
        return Bandwidth(a["rate"])
    if spec.type == "slicer":
        return Slicer(a["average_size"], a["size_variation"], a["delay"], rng)
    if spec.type == "timeout":
        return Timeout(a["timeout"])
    if spec.type == "reset_peer":
        return ResetPeer(a["timeout"])
    if spec.type == "limit_data":
        return LimitData(a["bytes"])
    raise ToxicError(f"invalid toxic type {spec.type!r}")


class Pipeline:
    """The toxics of one direction of one connection, in order.

    :meth:`update` swaps in the proxy's current list of toxics: a toxic that
    stays (same name, same definition) keeps its stage, and with it its
    toxicity draw and its state (a latency's last departure, a bandwidth's
    queue), so changing one toxic does not disturb the others. It returns
    what the change means for the connection: an :class:`End` to schedule,
    if a new toxic scheduled one or a removed one closes on removal.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.stages: list[tuple[ToxicSpec, Stage]] = []

    def update(self, specs: list[ToxicSpec], now_ms: float) -> End | None:
        old = {spec.name: (spec, stage) for spec, stage in self.stages}
        end: End | None = None
        new: list[tuple[ToxicSpec, Stage]] = []
        for spec in specs:
            kept = old.pop(spec.name, None)
            if kept is not None and kept[0] == spec:
                new.append(kept)
                continue
            stage = make_stage(spec, self.rng)
            end = _earliest(end, stage.start(now_ms))
            if kept is not None and kept[1].closes_on_removal and not isinstance(kept[1], Passthrough):
                end = _earliest(end, End(now_ms, reset=False))
            new.append((spec, stage))
        for _spec, stage in old.values():
            if stage.closes_on_removal:
                end = _earliest(end, End(now_ms, reset=False))
        self.stages = new
        return end

    def feed(self, data: bytes, now_ms: float) -> tuple[list[Piece], End | None]:
        """``data`` was read at ``now_ms``: the pieces to write, in order, and perhaps the connection's end."""
        pieces = [Piece(now_ms, data)]
        end: End | None = None
        for _spec, stage in self.stages:
            out: list[Piece] = []
            for piece in pieces:
                more, stop = stage.feed(piece)
                out += more
                end = _earliest(end, stop)
            pieces = out
            if not pieces:
                break
        return pieces, end


def _earliest(a: End | None, b: End | None) -> End | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a.at_ms <= b.at_ms else b
