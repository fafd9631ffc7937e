"""The source side of one ``Replicate`` stream: which batches to send, in what order. Sans-I/O.

``ReplicaSource`` works over the ``PartitionLog`` port only, so the grpc.aio
handler and the deterministic simulator (with ``MemoryLog``) drive the same
object. It holds no sockets, clocks or tasks: the caller asks
:meth:`ReplicaSource.next_chunks` for what to send now, and waits for appends
or flushes itself when the answer is empty.

Per wanted partition there is a cursor:

* ``sent``: the dst's have-vector, advanced by every batch handed out. A batch
  is sent only if its origin site is wanted and it extends ``sent``
  (``last_origin_seq >= sent[origin]``); every other batch is skipped. So a
  batch the dst already holds never crosses the link, which is what makes
  cycles in the topology cost nothing.
* ``offset``: the local offset where reading continues. It starts at the
  smallest local offset of a batch the dst lacks, found through the origin
  index (``offset_for_origin_seq``), over the wanted origin sites.

Batches are read whole with ``PartitionLog.read``: the source never looks
inside records and never rewrites bytes.

**Only durable batches are served.** A batch at or beyond
``log.flushed_offset`` is never sent. An origin that crashes loses its
unflushed batches and then re-issues those coordinates with other records; if
such a batch had already left the site, two sites would hold different bytes
for one coordinate (I1). So replication exposes only what survives a crash.

A partition log holds every origin's batches interleaved, so the batches of
origin sites this link does not carry are read and skipped. That costs a read
of data that is not sent; it is fine while a link carries most origins (the
usual case: a site's upstreams split the origins between them). A per-origin
read path through the origin index would remove it.

**Costs follow what moved, not the partition count (issue 22).**

* *Active cursors.* Only cursors that may have durable batches to read are
  looked at: at first all of them (one pass, at the stream's start), then
  those the driver names with :meth:`ReplicaSource.flushed` (it must, for
  every move of a wanted partition's ``flushed_offset``: the node from
  ``Partition.notify_durable``, the simulator from its fsyncs and seals). A
  cursor found caught up leaves the turns. A cursor waiting at a quarantined
  batch is polled each step until the batch is repaired (few, and rare).
* *Delta heartbeats.* ``_told`` is what this stream last told the dst of each
  partition (src vector, log end), by any chunk. A heartbeat carries a
  partition whose state differs from it, plus ``REANNOUNCE`` partitions in
  turn, changed or not. The stream's first message is a summary: every
  partition of which the source holds anything (``{}`` and 0 are what the dst
  assumes of a partition it was told nothing about; ``LinkManager`` forgets a
  link's vectors when it goes down, and a new stream starts with a summary).

Why it is safe. A gRPC stream is reliable and ordered: the last chunk of a
partition the dst received is the last the source sent, so the dst's view of
src (``LinkManager`` vectors: routing, stalls, lag) is the same as if every
heartbeat repeated it. In the simulator, a stream may lose messages; what the
dst then misses is told again by the rotation within ``partitions /
REANNOUNCE`` heartbeats. The dst's lost-tail rule (``session.py``: two
heartbeats in a row that carry a partition, promising more than the dst
holds, with no data of it between) rests on one premise, per partition:
*when a heartbeat carries a partition, every batch its earlier heartbeats'
vectors covered has been handed out*. A heartbeat carries a partition only if
its cursor has no durable batch left to read at that moment (otherwise it is
left out and read first), and batches are handed out in log order, so the
premise holds for each partition on its own; the rule never needed the other
partitions in the same heartbeat. The rotation makes sure every partition is
carried again, so a lost last message is found after at most two rounds of
the rotation. A missed :meth:`ReplicaSource.flushed` cannot make a heartbeat
promise what was not handed out either (the same check), it only delays the
batches until the rotation or the next flush finds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from georep.record.batch import headers_in
from georep.storage.api import BatchDamaged, DamagedBatch, OffsetOutOfRange, PartitionLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq

PartitionKey = tuple[str, int]
# Partitions a heartbeat re-announces in turn, whether or not they changed: what bounds how long a dst that lost a
# stream's last message for a partition takes to notice (see the module docstring), at O(1) per heartbeat.
REANNOUNCE = 8
# Bytes of skipped batches one next_chunks() call may read, as a multiple of
# max_bytes: a long stretch of unwanted or covered batches must not hold the
# event loop. Past it, next_chunks() returns what it has and has_more() says so.
SCAN_BUDGET_FACTOR = 16
# Reads ask for at least this much, so skipping small batches takes few reads;
# batches past the budget are left for the next call (the cursor says where).
READ_BYTES_MIN = 64 * 1024
# A stream's first message of data carries at most this much, and each one after twice the one before, up to the
# caller's max_bytes (TCP's slow start, for latency, not congestion). A stream opened for a new subscription then
# hands its first few partitions to the next hop at once: with 1 MiB messages, each hop of a chain first wrote,
# synced and served 1,000 cold partitions of 100,000-topic sites, and the subscriber waited a second for them.
FIRST_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Chunk:
    """Whole batches of one partition, verbatim, with the source's state of the partition.

    ``batches`` is empty in a heartbeat. ``src_vector`` is the source's durable
    vector of the partition: what it can serve (``flushed_vector``).
    """

    key: tuple[str, int]
    batches: bytes
    src_vector: Mapping[Origin, int]
    src_log_end: int


@dataclass(frozen=True, slots=True)
class Serve:
    """One step of a stream (:meth:`ReplicaSource.step`).

    ``chunks``: to send now, as one message (data, or a heartbeat when
    ``heartbeat``). ``again``: step again as soon as other work has run.
    Otherwise step again at ``wake_ms``, or sooner when a wanted partition's
    flushed offset moves.
    """

    chunks: list[Chunk]
    heartbeat: bool
    again: bool
    wake_ms: int


class _Cursor:
    __slots__ = ("key", "log", "sites", "sent", "handed_out", "offset", "blocked")

    def __init__(self, key: PartitionKey, log: PartitionLog, have: Mapping[Origin, int], sites: tuple[str, ...]):
        self.key = key
        self.log = log
        self.sites = frozenset(sites)
        self.sent: dict[Origin, int] = {o: s for o, s in have.items() if s > 0}
        # What this stream itself sent, per origin (``sent`` starts at the dst's word): the next seq after it.
        self.handed_out: dict[Origin, int] = {}
        start = log.log_end_offset
        for origin, next_seq in sorted(log.vector().items()):
            have_seq = self.sent.get(origin, 0)
            if origin.site not in self.sites or have_seq >= next_seq:
                continue
            at = log.offset_for_origin_seq(origin, OriginSeq(have_seq))
            if at is not None:
                start = min(start, at)
        self.offset = LocalOffset(max(start, log.log_start_offset))
        # A quarantined batch the dst needs: the cursor waits at it until it is repaired (never skips it).
        self.blocked: DamagedBatch | None = None

    def pending(self) -> bool:
        if self.offset >= self.log.flushed_offset:
            return False
        if self.blocked is not None:
            if any(d.base_offset == self.blocked.base_offset for d in self.log.damaged_batches()):
                return False
            self.blocked = None
        return True

    def src_vector(self) -> dict[Origin, int]:
        """What this site can serve of the partition: its durable vector, held back at a quarantined batch
        (so the dst neither waits for it here nor takes its absence for a lost tail, and routes around)."""
        vector: dict[Origin, int] = dict(self.log.flushed_vector())
        if self.blocked is not None:
            origin = self.blocked.origin
            vector[origin] = min(vector.get(origin, 0), self.blocked.base_origin_seq)
        return vector

    def take(self, budget: int, scan_budget: int, oversize_ok: bool) -> tuple[list[memoryview], int, int]:
        """Read from ``offset``: the batches to send (within ``budget`` bytes), bytes sent, bytes scanned.

        ``oversize_ok``: the first batch may exceed ``budget`` (a response
        holds at least one batch).
        """
        out: list[memoryview] = []
        sent_bytes = 0
        scanned = 0
        log = self.log
        while scanned < scan_budget:
            flushed = log.flushed_offset
            if self.offset >= flushed:
                break
            try:
                res = log.read(self.offset, max(budget - sent_bytes, READ_BYTES_MIN))
            except BatchDamaged as exc:
                d = exc.damaged
                if d.origin.site in self.sites and d.last_origin_seq >= self.sent.get(d.origin, 0):
                    self.blocked = d  # the dst needs it: wait for the repair
                    break
                self.offset = LocalOffset(d.next_offset)  # the dst does not want it, or has it: step over
                continue
            except OffsetOutOfRange:
                # Retention removed what the cursor pointed at: go on from the
                # oldest retained batch. The dst sees the hole as a gap.
                if self.offset < log.log_start_offset:
                    self.offset = log.log_start_offset
                    continue
                raise
            if not res.data:
                break
            view = memoryview(res.data)
            pos = 0
            full = False
            for h in headers_in(res.data):  # a read may hold far more than is durable or fits: parse as we go
                if h.base_offset >= flushed:
                    full = True  # not durable yet: stop before it
                    break
                size = h.size_bytes
                origin = h.origin
                if origin.site in self.sites and h.last_origin_seq >= self.sent.get(origin, 0):
                    if sent_bytes + size > budget and (out or not oversize_ok):
                        full = True
                        break
                    out.append(view[pos : pos + size])
                    sent_bytes += size
                    if h.next_origin_seq > self.sent.get(origin, 0):
                        self.sent[origin] = h.next_origin_seq
                    self.handed_out[origin] = h.next_origin_seq  # per origin, a log holds seqs in order (I3)
                scanned += size
                pos += size
                self.offset = h.next_offset
            if full or sent_bytes >= budget:
                break
            if pos == 0:
                break  # a read that yielded no whole batch: nothing more to do now
        return out, sent_bytes, scanned


class ReplicaSource:
    """What one ``Replicate`` stream sends: wanted batches the dst lacks, durable ones only, fairly across partitions.

    ``wants`` maps each partition key to the dst's have-vector for it and the
    origin sites to send (every epoch of those sites). Every key must be in
    ``logs``. The driver calls :meth:`flushed` whenever a wanted partition's
    durable offset or vector moves (see the module docstring: the source
    looks only at partitions it was told about, and at a rotating few).
    """

    def __init__(
        self,
        logs: Mapping[tuple[str, int], PartitionLog],
        wants: Mapping[tuple[str, int], tuple[dict[Origin, int], tuple[str, ...]]],
        heartbeat_ms: int = 500,
        reannounce: int = REANNOUNCE,
    ) -> None:
        self._cursors = [_Cursor(key, logs[key], have, sites) for key, (have, sites) in sorted(wants.items())]
        self._wanted = frozenset(c.key for c in self._cursors)
        self._by_key = {c.key: c for c in self._cursors}
        # Cursors that may have durable batches to read, in round-robin order (a dict: an ordered set).
        self._active: dict[PartitionKey, _Cursor] = {c.key: c for c in self._cursors}
        # Cursors waiting at a quarantined batch: polled every step until it is repaired (rare, and few).
        self._blocked: dict[PartitionKey, _Cursor] = {}
        # Partitions whose state may differ from what this stream last told the dst (``_told``).
        self._changed: dict[PartitionKey, None] = {}
        # What this stream last told the dst of each partition (src vector, log end); absent: nothing yet.
        self._told: dict[PartitionKey, tuple[dict[Origin, int], int]] = {}
        self._reannounce = max(1, reannounce)
        self._rotation = 0  # the next partition to re-announce
        self.heartbeat_ms = heartbeat_ms
        self._last_sent_ms: int | None = None
        self._message_bytes = FIRST_MESSAGE_BYTES  # what the next message of data may carry (max_bytes caps it)

    @property
    def keys(self) -> list[PartitionKey]:
        return [c.key for c in self._cursors]

    @property
    def wanted(self) -> frozenset[PartitionKey]:
        return self._wanted

    def handed_out(self, key: PartitionKey, origin: Origin) -> int:
        """The next seq after the last batch of ``origin`` this stream sent of ``key`` (0: none): what has left
        (``offsets.held.ServedGate``), unlike the cursor's position, which starts at the dst's have-vector."""
        cursor = self._by_key.get(key)
        return 0 if cursor is None else cursor.handed_out.get(origin, 0)

    def flushed(self, key: PartitionKey) -> None:
        """``key``'s durable offset or vector moved (a flush, a quorum, a repair, a cut): look at it again."""
        cursor = self._by_key.get(key)
        if cursor is not None:
            self._active[key] = cursor
            self._changed[key] = None

    def active(self) -> list[PartitionKey]:
        """The partitions the next :meth:`step` may read (a multi-node site prepares their chains for it)."""
        return [*self._active, *self._blocked]

    def next_chunks(self, max_bytes: int) -> list[Chunk]:
        """The batches to send now, at most ``max_bytes`` in all (but at least one batch), advancing cursors.

        Only the active partitions (told :meth:`flushed`, or not yet caught
        up) are looked at, in turns: each call starts one partition further
        on. The answer is ``[]`` when every active cursor has reached its
        log's flushed offset, or when only skipped batches were read this
        call (:meth:`has_more` then says there is more to scan).
        """
        self._unblock()
        if not self._active:
            return []
        budget = max(max_bytes, 1)
        scan_budget = budget * SCAN_BUDGET_FACTOR
        out: list[Chunk] = []
        total = 0
        for cursor in list(self._active.values()):
            if total >= budget or scan_budget <= 0:
                break
            # Next call starts one further on: this cursor goes to the back (or leaves, when caught up).
            del self._active[cursor.key]
            if not self._pending(cursor):
                self._changed[cursor.key] = None  # caught up: the next heartbeat tells its vector if it moved
                continue
            views, size, scanned = cursor.take(budget - total, scan_budget, oversize_ok=not out)
            scan_budget -= scanned
            if cursor.blocked is not None:
                self._blocked[cursor.key] = cursor
                self._changed[cursor.key] = None  # its src vector is now held back at the damage
            elif cursor.offset < cursor.log.flushed_offset:
                self._active[cursor.key] = cursor
            if views:
                total += size
                data = views[0].tobytes() if len(views) == 1 else b"".join(views)
                out.append(self._tell(cursor, data))
        return out

    def heartbeat(self) -> list[Chunk]:
        """An empty chunk for each partition whose state differs from what this stream last told the dst, and for
        the next few partitions in turn (``reannounce``), with the source's durable vector and log end.

        A partition with durable batches still to read is left out (and made
        active): a heartbeat carries a partition only once everything its
        vector covers has been handed out, which the dst's lost-tail rule
        relies on (``session.py``)."""
        changed, self._changed = self._changed, {}
        rotated: set[PartitionKey] = set()
        n = len(self._cursors)
        for _ in range(min(self._reannounce, n)):
            rotated.add(self._cursors[self._rotation].key)
            self._rotation = (self._rotation + 1) % n
        out: list[Chunk] = []
        for key in [*changed, *sorted(rotated - changed.keys())]:
            cursor = self._by_key[key]
            if self._pending(cursor):
                self._active[key] = cursor
                self._changed[key] = None  # told after its batches are
                continue
            state = (cursor.src_vector(), cursor.log.log_end_offset)
            if key in rotated or self._told.get(key) != state:
                out.append(self._tell(cursor, b"", state))
        return out

    def summary(self) -> list[Chunk]:
        """The first heartbeat of a stream: every partition of which the source holds anything (an empty vector
        and log is what the dst assumes of a partition it was told nothing about)."""
        out: list[Chunk] = []
        for cursor in self._cursors:
            state = (cursor.src_vector(), cursor.log.log_end_offset)
            if state[0] or state[1]:
                out.append(self._tell(cursor, b"", state))
            else:
                self._told[cursor.key] = state
        return out

    def step(self, now_ms: int, max_bytes: int) -> Serve:
        """What the stream does now: send data, send a heartbeat, scan on, or wait.

        The first step of a stream is a heartbeat with the summary, so dst
        learns at once that the stream is up and what this site holds. After
        that: the batches to send, if any (:data:`FIRST_MESSAGE_BYTES` at
        first, each message up to twice the last, at most ``max_bytes``); a
        heartbeat when nothing was sent
        for ``heartbeat_ms``; otherwise wait until the heartbeat is due or a
        wanted partition's flushed offset moves (:meth:`flushed`).
        """
        if self._last_sent_ms is None:
            self._last_sent_ms = now_ms
            return Serve(self.summary(), True, bool(self._active), now_ms + self.heartbeat_ms)
        chunks = self.next_chunks(min(max_bytes, self._message_bytes))
        if chunks:
            self._last_sent_ms = now_ms
            self._message_bytes = min(2 * self._message_bytes, max_bytes)
            return Serve(chunks, False, True, now_ms)
        due = self._last_sent_ms + self.heartbeat_ms
        if now_ms >= due:
            # Due even while only skipped batches are scanned (a long stretch of other origins' batches, at many
            # partitions): the dst would take the silence for a dead stream. Safe: a heartbeat leaves out every
            # partition with batches still to read (and it may find some a flush left unannounced).
            beat = self.heartbeat()
            self._last_sent_ms = now_ms
            return Serve(beat, True, bool(self._active), now_ms + self.heartbeat_ms)
        if self.has_more():
            return Serve([], False, True, now_ms)  # only skipped batches so far: go on after others ran
        return Serve([], False, False, due)

    def has_more(self) -> bool:
        """Whether some active cursor has durable batches left to read (sent or skipped)."""
        self._unblock()
        for key, cursor in list(self._active.items()):
            if self._pending(cursor):
                return True
            del self._active[key]  # caught up: out of the turns until the next flush
            self._changed[key] = None
        return False

    # -- internals ----------------------------------------------------------------------------

    def _pending(self, cursor: _Cursor) -> bool:
        if cursor.pending():
            return True
        if cursor.blocked is not None:
            self._blocked[cursor.key] = cursor
        return False

    def _unblock(self) -> None:
        for key, cursor in list(self._blocked.items()):
            if cursor.blocked is None or cursor.pending():  # repaired: read on, and tell the dst the new vector
                del self._blocked[key]
                self._active[key] = cursor
                self._changed[key] = None

    def _tell(self, cursor: _Cursor, data: bytes, state: tuple[dict[Origin, int], int] | None = None) -> Chunk:
        vector, log_end = state if state is not None else (cursor.src_vector(), cursor.log.log_end_offset)
        self._told[cursor.key] = (vector, log_end)
        return Chunk(cursor.key, data, vector, log_end)
