"""The destination's pull session over one link ``src -> dst``. Sans I/O.

dst pulls: it opens a ``Replicate`` stream to src with its *wants* (for each
partition the link carries, the origin sites this upstream should send, per
``LinkManager.wants``) and its have-vectors, and applies what comes back. A
:class:`PullSession` makes every decision of that loop; the node's replicator
(``georep/server/replicator.py``) drives it with grpc.aio and a writer
thread, and the simulator with its event heap. Events go in (a message, the
outcome of an apply, the end of a stream, ``tick(now_ms)``); effects come out:

* :class:`OpenStream`: open a stream with these wants and have-vectors, at
  this node of src (the shell drops any earlier one). The have-vector is the
  site's vector with its own current origin marked fully held (``pull_have``);
  the node is :class:`~georep.replication.upstream.UpstreamNodes`' choice.
* :class:`ApplyChunks`: append a message's data chunks (``apply_chunk`` each,
  in order), then report :meth:`PullSession.on_applied` for each, in order.
  A message's chunks go out together, so a driver can apply them in one hop
  (the node: one writer-thread hop per message, not per partition, issue 22);
  the next message's wait until all of them are reported. A driver that stops
  at a chunk (an error) reports the ones before it and ends the stream.
* :class:`LinkEvent`: something to log or count (up, down, reopen and why).

The rules:

* **Open** at start, right after a stream ends cleanly, and ``backoff`` after
  a failure (doubling from ``backoff_min_ms`` to ``backoff_max_ms``). Only
  progress resets it and clears the link's last error: a message with data
  applied whole, or a heartbeat once the stream has lived ``backoff_max_ms``
  (a source heartbeats as soon as a stream opens, so an earlier one proves
  nothing). A stream that opens and fails on its first apply (a full local
  disk, a batch refused as invalid) therefore backs off instead of reopening
  every ``backoff_min_ms``, and its error stays on show while it does. A
  failure that repeats with no progress between is logged once, and the link
  is announced up again only with progress.
* **Reopen at once** when the stream is out of step with this site's vector:
  a chunk that starts past the vector (a gap: a batch was lost on the way, or
  the stream raced a failover), a chunk whose batches straddle the vector
  (divergence: never appended, reported), or a *lost tail* (below). And when
  the wants change: a link went up or down, or a stall began or ended
  (checked on every tick, and after the first message and every reopen).
* **Stall detection** is ``LinkManager``'s: every chunk feeds it src's
  vector, every apply this site's vector.
* **A dead stream**: no message for ``idle_timeout_ms`` (heartbeats
  included), and no apply of its chunks completed either (a dst busy with a
  message of many partitions reads no other meanwhile: its silence is not
  src's), is a failure: the link is down and its origins route elsewhere.
  Every failed stream (this, or an end with an error) moves the next one to
  src's next node (``georep/replication/upstream.py``).
* **A lost tail.** A gap shows only when a later batch of the origin comes.
  When the last data of a stream is lost, none comes, and heartbeats keep the
  stream alive. Heartbeats carry src's *durable* vector (what it can serve).
  One heartbeat that shows more than this site holds proves nothing (the data
  may be behind it on the way), but two in a row that carry a partition, with
  no data of it between them, while this site is still short of what the
  first one showed of it, mean that the data was sent and lost: reopen. Per
  partition, since one stream may merge several source nodes' pulls. A
  heartbeat carries only the partitions whose state changed and a few in
  turn (``source.py``, "Delta heartbeats"); "in a row" means two heartbeats
  that carry the partition, whatever other heartbeats came between, so the
  rule needs only that each partition is carried again now and then.
* **An operator cut** (``set_enabled(False)``) ends the stream and marks the
  link down until it is healed.

Streams are numbered (``stream_ids``): a message or an apply outcome of a
stream the session has left is ignored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from georep.replication.links import LinkManager, LinkState, PartitionKey
from georep.replication.sink import ApplyOutcome, pull_have
from georep.replication.source import Chunk
from georep.replication.upstream import UpstreamNodes
from offsets.coordinates import Origin
from topology.ids import SiteId

Wants = dict[PartitionKey, tuple[SiteId, ...]]
# What a stream asks for: per partition, the have-vector and the origin sites to send.
StreamWants = dict[PartitionKey, tuple[dict[Origin, int], tuple[str, ...]]]
DISABLED = "cut by an operator (georep link cut); heal it with georep link heal"


@dataclass(frozen=True, slots=True)
class PullConfig:
    idle_timeout_ms: int = 5_000  # no message for this long: the stream is dead
    backoff_min_ms: int = 100
    backoff_max_ms: int = 2_000


@dataclass(frozen=True, slots=True)
class OpenStream:
    stream_id: int
    wants: StreamWants
    address: str = ""  # the node of src to open it at ("": the session was given no nodes to choose from)


@dataclass(frozen=True, slots=True)
class ApplyChunk:
    stream_id: int
    key: PartitionKey
    batches: bytes


@dataclass(frozen=True, slots=True)
class ApplyChunks:
    """A message's data chunks, to apply in this order (see the module doc)."""

    stream_id: int
    chunks: tuple[ApplyChunk, ...]


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """``kind``: up, down, timeout, gap, tail, diverged, wants, ended, disabled, healed."""

    kind: str
    text: str


Effect = OpenStream | ApplyChunks | LinkEvent


@dataclass(slots=True)
class PullStats:
    applied_batches: int = 0
    applied_bytes: int = 0
    applied_records: int = 0
    skipped_batches: int = 0
    gaps: int = 0
    reopens: int = 0
    streams_opened: int = 0
    last_error: str = ""


@dataclass(slots=True)
class _Message:
    chunks: deque[Chunk]
    heartbeat: bool
    first: bool
    keys: tuple[PartitionKey, ...]  # the partitions it carries (consumed chunks say nothing more)


@dataclass(slots=True)
class _Stream:
    stream_id: int
    wants: Wants
    opened_ms: int
    last_message_ms: int
    delivered: bool = False
    applying: int = 0  # chunks handed out (ApplyChunks) whose outcome is not in yet
    inbox: deque[_Message] = field(default_factory=deque)
    # Set by a heartbeat that showed src holding more of a wanted origin than dst; cleared by data.
    promised: dict[PartitionKey, dict[Origin, int]] | None = None
    # What ``wants`` was last found equal to the stream's from: the links' answer (the same object until the
    # routing changes) and the shell's word on usability (``usable_basis``). Unchanged: no need to compare again.
    basis: tuple[object, object] | None = None


class PullSession:
    """dst's side of the link ``src -> dst``."""

    def __init__(
        self,
        src: SiteId,
        links: LinkManager,
        own: Origin,
        vector_of: Callable[[PartitionKey], Mapping[Origin, int]],
        stream_ids: Iterator[int],
        config: PullConfig | None = None,
        usable: Callable[[PartitionKey], bool] | None = None,
        nodes: UpstreamNodes | None = None,
        usable_basis: Callable[[], object] | None = None,
    ) -> None:
        self.src = src
        self.links = links
        self.own = own
        self.vector_of = vector_of  # this site's vector of a partition, now
        self.config = config or PullConfig()
        # Partitions a stream may ask for (the node leaves out topics src does not have yet, or in conflict).
        self.usable = usable or (lambda key: True)
        self.nodes = nodes  # src's nodes: a failed stream moves the next one to another
        # A value that changes whenever ``usable`` may answer differently (None: not known, compare every time).
        self.usable_basis = usable_basis
        self.stats = PullStats()
        self.enabled = True
        self._ids = stream_ids
        self._stream: _Stream | None = None
        self._retry_at_ms: int | None = None
        self._backoff_ms = self.config.backoff_min_ms

    # -- queries ------------------------------------------------------------------

    @property
    def stream_id(self) -> int | None:
        return None if self._stream is None else self._stream.stream_id

    @property
    def streaming(self) -> Wants:
        """What the open stream pulls (empty while none is open): the wants it was opened with."""
        return {} if self._stream is None else self._stream.wants

    def wants(self) -> Wants:
        usable = self.usable
        return {k: v for k, v in self.links.wants(self.src).items() if usable(k)}

    def next_due_ms(self) -> int | None:
        """When :meth:`tick` next has something to do (a retry, or the idle timeout)."""
        if not self.enabled:
            return None
        if self._stream is None:
            return self._retry_at_ms
        return self._stream.last_message_ms + self.config.idle_timeout_ms

    # -- events -------------------------------------------------------------------

    def start(self, now_ms: int) -> list[Effect]:
        return self._open(now_ms) if self.enabled and self._stream is None else []

    def tick(self, now_ms: int) -> list[Effect]:
        if not self.enabled:
            return []
        s = self._stream
        if s is None:
            if self._retry_at_ms is not None and now_ms >= self._retry_at_ms:
                return self._open(now_ms)
            return []
        if now_ms - s.last_message_ms >= self.config.idle_timeout_ms:
            return self._fail(now_ms, "timeout", f"no message from {self.src} for {self.config.idle_timeout_ms} ms")
        if not s.applying and not s.inbox:
            return self._check_wants(now_ms)
        return []

    def on_message(self, stream_id: int, chunks: Sequence[Chunk], heartbeat: bool, now_ms: int) -> list[Effect]:
        """A ``ReplicateResponse`` of stream ``stream_id``: ``chunks`` in order; ``heartbeat`` if it holds no data."""
        s = self._stream
        if s is None or s.stream_id != stream_id:
            return []  # a message of a stream this session has left
        s.last_message_ms = now_ms
        out: list[Effect] = []
        first = not s.delivered
        if first:
            s.delivered = True
            self.links.link_up(self.src, now_ms)
            if not self.stats.last_error:  # else the failure on show is not over: "up" comes with progress
                out.append(LinkEvent("up", f"link {self.src} -> {self.links.site} streaming"))
        s.inbox.append(_Message(deque(chunks), heartbeat, first, tuple(c.key for c in chunks)))
        if not s.applying:
            out += self._drain(s, now_ms)
        return out

    def on_applied(self, stream_id: int, key: PartitionKey, outcome: ApplyOutcome, now_ms: int) -> list[Effect]:
        """The outcome of one chunk of an :class:`ApplyChunks` of stream ``stream_id``.

        The partition may have stopped being usable while the chunk was applied (a multi-node site's node stops
        serving a partition when its segment rolls or its leadership moves): this site's vector of it cannot be
        read here then, and the stream, whose wants no longer match, is reopened; what the apply appended is its
        segment's seal's to keep or cut."""
        usable = self.usable(key)
        if usable:
            self.links.local_vector(key, self.vector_of(key))
        st = self.stats
        st.applied_batches += outcome.appended_batches
        st.applied_bytes += outcome.appended_bytes
        st.applied_records += outcome.appended_records
        st.skipped_batches += outcome.skipped_batches
        s = self._stream
        if s is None or s.stream_id != stream_id:
            return []
        s.applying = max(0, s.applying - 1)
        # An apply is a sign of life too: a dst busy applying a long message (many partitions, each its own
        # apply) reads no further message meanwhile, and that silence is its own, not src's.
        s.last_message_ms = max(s.last_message_ms, now_ms)
        if outcome.overlaps:
            text = outcome.overlaps[0].message()
            st.last_error = text
            return [LinkEvent("diverged", text), *self._reopen(now_ms)]
        if outcome.gap is not None:
            st.gaps += 1
            return [LinkEvent("gap", outcome.gap.message()), *self._reopen(now_ms)]
        if not usable:
            return [LinkEvent("wants", f"{key[0]}-{key[1]} is no longer pulled here: reopening"), *self._reopen(now_ms)]
        return [] if s.applying else self._drain(s, now_ms)

    def on_stream_ended(self, stream_id: int, now_ms: int, error: str | None = None) -> list[Effect]:
        """Stream ``stream_id`` ended: cleanly by src (``error`` None: reopen now), or with an error."""
        s = self._stream
        if s is None or s.stream_id != stream_id:
            return []
        if error is None:
            return [LinkEvent("ended", f"site {self.src} ended the stream"), *self._reopen(now_ms)]
        return self._fail(now_ms, "down", error)

    def set_enabled(self, enabled: bool, now_ms: int) -> list[Effect]:
        """An operator cut (False) or healed (True) the link."""
        if enabled == self.enabled:
            return []
        self.enabled = enabled
        if not enabled:
            self._stream = None
            self._retry_at_ms = None
            self.stats.last_error = DISABLED
            self.links.link_down(self.src, now_ms, DISABLED)
            return [LinkEvent("disabled", f"link {self.src} -> {self.links.site} {DISABLED}")]
        self._backoff_ms = self.config.backoff_min_ms
        return [LinkEvent("healed", f"link {self.src} -> {self.links.site} healed by an operator"), *self._open(now_ms)]

    # -- internals ------------------------------------------------------------------

    def _open(self, now_ms: int) -> list[Effect]:
        basis = self._basis()  # before wants(): a change in between is then seen at the next check
        wants = self.wants()
        stream_wants: StreamWants = {
            key: (pull_have(self.vector_of(key), self.own), tuple(str(site) for site in sites))
            for key, sites in sorted(wants.items())
        }
        stream_id = next(self._ids)
        self.stats.streams_opened += 1
        self._stream = _Stream(stream_id, wants, now_ms, now_ms, basis=basis)
        self._retry_at_ms = None
        return [OpenStream(stream_id, stream_wants, "" if self.nodes is None else self.nodes.current)]

    def _basis(self) -> tuple[object, object] | None:
        return None if self.usable_basis is None else (self.links.wants(self.src), self.usable_basis())

    def _reopen(self, now_ms: int) -> list[Effect]:
        self.stats.reopens += 1
        return self._open(now_ms)

    def _fail(self, now_ms: int, kind: str, error: str) -> list[Effect]:
        was_down = self.links.links[self.src].state is LinkState.DOWN
        repeated = error == self.stats.last_error  # no progress since the same failure: logged then
        self.links.link_down(self.src, now_ms, error)
        if self.nodes is not None:
            self.nodes.stream_failed(kind)
        self.stats.last_error = error
        self._stream = None
        self._retry_at_ms = now_ms + self._backoff_ms
        self._backoff_ms = min(self._backoff_ms * 2, self.config.backoff_max_ms)
        text = f"link {self.src} -> {self.links.site} down: {error}"
        return [] if (was_down and kind == "down") or repeated else [LinkEvent(kind, text)]

    def _drain(self, s: _Stream, now_ms: int) -> list[Effect]:
        """Go on with the queued messages: the next message's chunks to apply, or what ends a message."""
        links = self.links
        out: list[Effect] = []
        while s.inbox:
            msg = s.inbox[0]
            applies: list[ApplyChunk] = []
            while msg.chunks:
                chunk = msg.chunks.popleft()
                links.upstream_vector(self.src, chunk.key, chunk.src_vector)
                if chunk.batches:
                    applies.append(ApplyChunk(s.stream_id, chunk.key, chunk.batches))
            if applies:
                s.applying = len(applies)
                return [*out, ApplyChunks(s.stream_id, tuple(applies))]
            s.inbox.popleft()
            out += self._progressed(s, msg, now_ms)
            if self._tail_lost(s, msg):
                return [
                    *out,
                    LinkEvent("tail", f"data from {self.src} was lost on the way: reopening"),
                    *self._reopen(now_ms),
                ]
            if msg.first:
                wants = self._check_wants(now_ms)
                if wants:
                    return [*out, *wants]
        return out

    def _progressed(self, s: _Stream, msg: _Message, now_ms: int) -> list[Effect]:
        """A message was applied whole: the link works again, unless it is a heartbeat of a young stream."""
        if msg.heartbeat and now_ms - s.opened_ms < self.config.backoff_max_ms:
            return []
        failed = self.stats.last_error
        self._backoff_ms = self.config.backoff_min_ms
        self.stats.last_error = self.links.links[self.src].last_error = ""
        return [LinkEvent("up", f"link {self.src} -> {self.links.site} streaming again")] if failed else []

    def _check_wants(self, now_ms: int) -> list[Effect]:
        """Reopen if the wants changed. Comparing them is O(partitions): done only when what they are computed
        from changed (``_Stream.basis``), so an idle link's tick is O(1)."""
        s = self._stream
        if s is None:
            return []
        basis = self._basis()
        if basis is not None and s.basis is not None and basis[0] is s.basis[0] and basis[1] == s.basis[1]:
            return []
        if self.wants() == s.wants:
            s.basis = basis
            return []
        return [LinkEvent("wants", f"wants from {self.src} changed: reopening"), *self._reopen(now_ms)]

    def _tail_lost(self, s: _Stream, msg: _Message) -> bool:
        """Two heartbeats in a row carrying a partition, both promising more of it than this site holds, with no
        data of it between: lost.

        Judged per partition, because a stream may merge the pulls of several source nodes (a multi-node site
        passes on the partitions other nodes lead): one node's heartbeat says nothing of another's partitions,
        whose data may still be on its way. A source sends every batch of a partition it promised before its next
        heartbeat (it heartbeats only when it has nothing left to send), so the rule holds for each source."""
        if not msg.heartbeat:
            if s.promised is not None:
                for key in msg.keys:
                    s.promised.pop(key, None)
            return False
        vector_of = self.vector_of
        promised = s.promised if s.promised is not None else {}
        # A partition no longer usable here has no vector to compare (see on_applied); the wants check reopens.
        for key in sorted(set(msg.keys) & set(promised)):
            if not self.usable(key):
                continue
            held = vector_of(key)
            if any(held.get(o, 0) < seq for o, seq in promised[key].items()):
                return True
        # The heartbeat's chunks were consumed by _drain; their vectors are the upstream's, as fed to links.
        for key in msg.keys:
            sites = s.wants.get(key)
            upstream = self.links.links[self.src].vectors.get(key)
            promised.pop(key, None)
            if sites is None or not upstream or not self.usable(key):
                continue
            held = vector_of(key)
            ahead = {o: n for o, n in upstream.items() if o.site in sites and n > held.get(o, 0)}
            if ahead:
                promised[key] = ahead
        s.promised = promised or None
        return False
