"""The ack table: when a write may be acknowledged, and when to fsync. Sans I/O.

Every ack level is a promise about where the batch survives (ARCHITECTURE.md,
I6), and the ack is released only once that promise holds:

* ``acks=leader``: the batch is in this node's log. With ``flush_interval_ms
  = 0`` (fsync per batch, the default) that means fsynced: the ack waits for
  an fsync that covers the batch's end offset. With a flush interval, the ack
  goes out after the write, like Kafka's defaults, and the periodic flush
  makes the batch durable later.
* ``acks=all``: the ack quorum of the segment's ensemble. A partition
  replicated in the site (``open_partition(..., replicated_in_site=True)``)
  waits for the *last add confirmed* to reach the batch's end: ``lac >=
  end_offset``, fed by :meth:`AckTable.quorum_advanced` from
  ``cluster.quorum.SegmentQuorum``, which counts this node's fsync as one
  member; with fsync per batch it also waits for this node's own fsync, so
  ``all`` promises everything ``leader`` does. A partition of a single-node
  site has an ensemble of one: its quorum end is its flushed offset, and
  ``all`` is the ``leader`` promise.
* ``acks=geo:N``: the site's own ``all`` promise (for a partition replicated
  in the site: ``lac >= end_offset``; with fsync per batch: this node's fsync)
  and N sites, this one included, holding the batch durably. Each site's own
  entry in the :class:`~offsets.held.HeldTable`, which is what other sites are
  told it holds, comes from what is durable in the site: its LAC vector
  (:meth:`AckTable.quorum_advanced`) for a partition replicated in the site,
  its fsyncs (:meth:`AckTable.flush_done`) for a single-node one. The other
  sites' entries come from ``ReportHeld`` (:meth:`AckTable.held_reported`).
  After ``timeout_ms`` the waiter fails with :class:`GeoAckTimeout`; the batch
  stays written and replicates later.

A waiter on the quorum has no deadline of its own: the LAC reaching its end
releases it, and :meth:`AckTable.close` fails it. What the leader does when
too few members are live is the shell's call (``cluster.quorum.QuorumLost``).

**Group commit.** A partition runs one fsync at a time. A waiter whose end
offset the last fsync did not cover starts the next one when the current one
ends, so every ack waiting meanwhile shares it (as in etcd raft, where what
may leave only after an fsync waits in a list until ``Advance``). Replicated
batches ask for an fsync without a waiter (:meth:`AckTable.replicated`), so a
site serves them onward (only durable batches are served) without waiting for
the next write; so does the periodic flush of topics with a flush interval
(:meth:`AckTable.flush`).

Events go in, effects come out: :class:`StartFlush` (the shell fsyncs the
partition, then reports :meth:`AckTable.flush_done` with the flushed offset
and the vector of what it made durable), :class:`Release` and :class:`Fail`
(answer the waiter), :class:`HeldChanged` (report the table upstream). The
quorum is computed in ``cluster/quorum.py`` and only its LAC comes in
(:meth:`AckTable.quorum_advanced`), so a single-node site's path is
unchanged. Time comes in as ``now_ms``. The node drives it with asyncio
futures and worker threads; the simulator with its event heap, where I6 is
checked at every release.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from georep.broker.errors import BrokerError, FsyncFailed, GeoAcksUnreachable, GeoAckTimeout, InvalidAcks, NodeStopping
from offsets.coordinates import Origin
from offsets.held import HeldTable
from offsets.vector import VectorOffset

PartitionKey = tuple[str, int]
Token = Hashable
GEO_ACK_TIMEOUT_MS_DEFAULT = 30_000


class AckKind(enum.Enum):
    LEADER = "leader"
    ALL = "all"
    GEO = "geo"


@dataclass(frozen=True, slots=True)
class Acks:
    """An ack level: ``leader``, ``all`` or ``geo:N``."""

    kind: AckKind = AckKind.LEADER
    sites: int = 1

    def __str__(self) -> str:
        return f"geo:{self.sites}" if self.kind is AckKind.GEO else self.kind.value

    @classmethod
    def geo(cls, sites: int) -> Acks:
        return cls(AckKind.GEO, sites)


LEADER = Acks()


def check_acks(acks: Acks, topic: str, site: str, reach: int) -> None:
    """Refuse an ack level that can never be met: ``geo:N`` with N < 1, or more sites than the topic reaches."""
    if acks.kind is not AckKind.GEO:
        return
    if acks.sites < 1:
        raise InvalidAcks(f"acks=geo:{acks.sites}: N must be at least 1 (the origin site counts)")
    if acks.sites > reach:
        raise GeoAcksUnreachable(
            f"acks=geo:{acks.sites} needs {acks.sites} sites, but records of topic {topic!r} from site {site} "
            f"reach only {reach} site(s) over the topology's links and their filters: use acks=geo:{reach} or "
            "less, or change the topology"
        )


@dataclass(frozen=True, slots=True)
class StartFlush:
    """fsync this partition now, then call :meth:`AckTable.flush_done` (or ``flush_failed``)."""

    key: PartitionKey


@dataclass(frozen=True, slots=True)
class Release:
    """The waiter's promise holds: acknowledge."""

    token: Token


@dataclass(frozen=True, slots=True)
class Fail:
    """The waiter's promise cannot be kept: answer with ``error``."""

    token: Token
    error: BrokerError


@dataclass(frozen=True, slots=True)
class HeldChanged:
    """The held table learned something: report it to the upstreams (``offsets.held.HeldReporter``)."""


Effect = StartFlush | Release | Fail | HeldChanged


@dataclass(slots=True)
class _Waiter:
    token: Token
    key: PartitionKey
    end_offset: int  # 0: needs no local fsync
    origin: Origin
    seq: int  # the batch's last origin seq
    sites: int  # 1 unless geo:N
    deadline_ms: int  # geo only; -1 for none
    timeout_ms: int
    flushed: bool = False  # the local fsync it needed is done (or it needed none)
    quorum_offset: int = 0  # the LAC it waits for (all, geo:N in an in-site replicated partition); 0: none
    done: bool = False  # answered (released or failed): its entry in the deadline heap is dead


@dataclass(slots=True)
class _Partition:
    fsync_per_batch: bool
    replicated_in_site: bool = False
    lac: int = 0  # replicated in site only: the last add confirmed, never moves back
    flushing: bool = False
    flushed_offset: int = 0
    flush_target: int = 0  # the largest end offset someone asked to have fsynced
    waiters: list[_Waiter] = field(default_factory=list)


class AckTable:
    """Every partition's pending acks at one node of site ``site`` (origin ``origin``)."""

    def __init__(self, site: str, origin: Origin) -> None:
        self.site = site
        self.origin = origin
        self.held = HeldTable()
        self._partitions: dict[PartitionKey, _Partition] = {}
        # Geo waiters by deadline, answered ones left in place and dropped when they reach the top: finding the
        # next deadline and the expired waiters costs O(log n) per waiter, not a walk of every pending ack.
        self._deadlines: list[tuple[int, int, _Waiter]] = []
        self._deadline_order = itertools.count()
        self._closed = False

    # -- partitions -------------------------------------------------------------

    def open_partition(
        self,
        key: PartitionKey,
        fsync_per_batch: bool,
        flushed_offset: int,
        flushed_vector: VectorOffset,
        replicated_in_site: bool = False,
        lac: int = 0,
        lac_vector: VectorOffset | None = None,
    ) -> None:
        """A partition this node holds, with what is already durable in it.

        ``replicated_in_site``: the partition's segments have an ensemble of several nodes here, and ``lac`` and
        ``lac_vector`` say what its ack quorum already holds (the defaults: nothing yet). This site's held entry
        then starts from ``lac_vector``, not from ``flushed_vector``.
        """
        if not replicated_in_site and (lac or lac_vector is not None):
            raise ValueError(
                f"{key[0]}/{key[1]}: a LAC was given for a partition not replicated in the site; pass "
                "replicated_in_site=True, or leave lac and lac_vector out (its quorum end is its flushed offset)"
            )
        self._partitions[key] = _Partition(
            fsync_per_batch,
            replicated_in_site=replicated_in_site,
            lac=lac,
            flushed_offset=flushed_offset,
            flush_target=flushed_offset,
        )
        held = lac_vector if replicated_in_site else flushed_vector
        self.held.update(self.site, key[0], key[1], held if held is not None else VectorOffset())

    def close_partition(self, key: PartitionKey, error: BrokerError) -> list[Effect]:
        """This node stops serving ``key`` (a multi-node site's leader rolled its segment or lost the partition):
        every waiter fails with ``error``, and nothing more is known of it here. Its batches past the last add
        confirmed may be cut by the seal, so no ack may go for them; a producer's retry is deduplicated by the
        partition's next leader when the batch survived."""
        p = self._partitions.pop(key, None)
        if p is None:
            return []
        return self._answer_all(p.waiters, lambda _w: error)

    def fsync_per_batch(self, key: PartitionKey) -> bool:
        return self._partitions[key].fsync_per_batch

    # -- waiters ----------------------------------------------------------------

    def wait(
        self,
        token: Token,
        key: PartitionKey,
        end_offset: int,
        origin: Origin,
        last_seq: int,
        acks: Acks,
        now_ms: int,
        timeout_ms: int = 0,
    ) -> list[Effect]:
        """Hold the ack of a batch ending at ``end_offset`` (seqs up to ``last_seq`` of ``origin``) until ``acks``
        holds. Returns the effects now: a :class:`Release` if it already holds, a :class:`StartFlush` if it needs
        an fsync and none is running."""
        p = self._partitions[key]
        if self._closed:
            return [Fail(token, NodeStopping("node stopping; retry"))]
        sites = acks.sites if acks.kind is AckKind.GEO else 1
        timeout_ms = timeout_ms or GEO_ACK_TIMEOUT_MS_DEFAULT
        deadline = now_ms + timeout_ms if sites > 1 else -1
        needs_fsync = p.fsync_per_batch and end_offset > p.flushed_offset
        needs_quorum = p.replicated_in_site and acks.kind is not AckKind.LEADER and end_offset > p.lac
        w = _Waiter(
            token,
            key,
            end_offset if needs_fsync else 0,
            origin,
            last_seq,
            sites,
            deadline,
            timeout_ms,
            flushed=not needs_fsync,
            quorum_offset=end_offset if needs_quorum else 0,
        )
        out: list[Effect] = []
        if needs_fsync:
            out += self._want_flush(key, p, end_offset)
        if self._met(p, w):
            out.append(Release(token))
        else:
            p.waiters.append(w)
            if deadline >= 0:
                heapq.heappush(self._deadlines, (deadline, next(self._deadline_order), w))
        return out

    def replicated(self, key: PartitionKey, end_offset: int) -> list[Effect]:
        """Replicated batches now end at ``end_offset``: with fsync per batch, fsync them (nobody waits)."""
        if not self._partitions[key].fsync_per_batch:
            return []  # the periodic flush covers them
        return self.flush(key, end_offset)

    def flush(self, key: PartitionKey, end_offset: int) -> list[Effect]:
        """Ask for everything below ``end_offset`` to be fsynced, with nobody waiting (the periodic flush)."""
        p = self._partitions[key]
        if end_offset <= p.flushed_offset or self._closed:
            return []
        return self._want_flush(key, p, end_offset)

    def _want_flush(self, key: PartitionKey, p: _Partition, end_offset: int) -> list[Effect]:
        p.flush_target = max(p.flush_target, end_offset)
        if p.flushing:
            return []  # the running fsync's end starts the next one
        p.flushing = True
        return [StartFlush(key)]

    def _met(self, p: _Partition, w: _Waiter) -> bool:
        return w.flushed and p.lac >= w.quorum_offset and self._geo_met(w)

    def _geo_met(self, w: _Waiter) -> bool:
        if w.sites <= 1:
            return True
        holding = self.held.sites_holding(w.key[0], w.key[1], w.origin, w.seq)
        return len(holding) >= w.sites

    # -- events -----------------------------------------------------------------

    def flush_done(self, key: PartitionKey, flushed_offset: int, flushed_vector: VectorOffset) -> list[Effect]:
        """An fsync of ``key`` ended: everything below ``flushed_offset`` is durable, and ``flushed_vector``
        with it. For a partition replicated in the site this is one member's fsync: the site's held entry waits
        for :meth:`quorum_advanced`."""
        p = self._partitions[key]
        p.flushing = False
        p.flushed_offset = max(p.flushed_offset, flushed_offset)
        out: list[Effect] = []
        learned = not p.replicated_in_site and self.held.update(self.site, key[0], key[1], flushed_vector)
        if learned:
            out.append(HeldChanged())
        for w in p.waiters:
            if not w.flushed and w.end_offset <= p.flushed_offset:
                w.flushed = True
        out += self._release(p)
        if p.flush_target > p.flushed_offset and not self._closed:
            p.flushing = True
            out.append(StartFlush(key))
        return out

    def quorum_advanced(self, key: PartitionKey, lac: int, lac_vector: VectorOffset) -> list[Effect]:
        """The ack quorum of ``key`` holds everything below offset ``lac`` fsynced, and ``lac_vector`` with it
        (``cluster.quorum.LacAdvanced``). Releases the ``all`` and ``geo:N`` waiters it completes; this site's held
        entry becomes ``lac_vector``. A LAC below the one known is stale: it changes nothing."""
        p = self._partitions[key]
        if not p.replicated_in_site:
            raise ValueError(
                f"{key[0]}/{key[1]} is not replicated in the site: its quorum end is its flushed offset "
                "(flush_done); open it with replicated_in_site=True to feed it a LAC"
            )
        p.lac = max(p.lac, lac)
        out: list[Effect] = []
        if self.held.update(self.site, key[0], key[1], lac_vector):
            out.append(HeldChanged())
        out += self._release(p)
        return out

    def flush_failed(self, key: PartitionKey, error: str) -> list[Effect]:
        """An fsync of ``key`` failed: every waiter that needed it fails; nothing is acknowledged."""
        p = self._partitions[key]
        p.flushing = False
        p.flush_target = p.flushed_offset
        failed = [w for w in p.waiters if not w.flushed]
        p.waiters = [w for w in p.waiters if w.flushed]
        return self._answer_all(
            failed, lambda _w: FsyncFailed(f"fsync failed: {error}; the batch was written but not acked")
        )

    def held_reported(self, entries: Iterable[tuple[str, str, int, VectorOffset]]) -> list[Effect]:
        """What other sites hold fsynced (``ReportHeld``). This site's own entry comes from its fsyncs or its
        quorum only."""
        changed: set[PartitionKey] = set()
        for site, topic, index, vector in entries:
            if site != self.site and self.held.update(site, topic, index, vector):
                changed.add((topic, index))
        out: list[Effect] = [HeldChanged()] if changed else []
        for key in sorted(changed):
            p = self._partitions.get(key)
            if p is not None:
                out += self._release(p)
        return out

    def tick(self, now_ms: int) -> list[Effect]:
        """Fail the geo waiters whose time is up, in deadline order."""
        out: list[Effect] = []
        while self.next_deadline_ms() is not None and self._deadlines[0][0] <= now_ms:
            w = heapq.heappop(self._deadlines)[2]
            p = self._partitions[w.key]
            p.waiters.remove(w)
            w.done = True
            out.append(Fail(w.token, self._timeout(p, w)))
        return out

    def next_deadline_ms(self) -> int | None:
        """The earliest deadline of a geo waiter still waiting (None: no such waiter)."""
        heap = self._deadlines
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def close(self) -> list[Effect]:
        """The node is stopping: fail every waiter (the writes stay; a retry is deduplicated)."""
        self._closed = True
        out: list[Effect] = []
        for _key, p in sorted(self._partitions.items()):
            out += self._answer_all(p.waiters, lambda _w: NodeStopping("node stopping; retry"))
            p.waiters = []
        self._deadlines.clear()
        return out

    def pending(self) -> int:
        return sum(len(p.waiters) for p in self._partitions.values())

    # -- internals --------------------------------------------------------------

    def _release(self, p: _Partition) -> list[Effect]:
        out: list[Effect] = []
        keep: list[_Waiter] = []
        for w in p.waiters:
            if self._met(p, w):
                w.done = True
                out.append(Release(w.token))
            else:
                keep.append(w)
        p.waiters = keep
        return out

    @staticmethod
    def _answer_all(waiters: Iterable[_Waiter], error: Callable[[_Waiter], BrokerError]) -> list[Effect]:
        """Fail ``waiters`` (already out of their partition's list) with ``error(w)`` each."""
        out: list[Effect] = []
        for w in waiters:
            w.done = True
            out.append(Fail(w.token, error(w)))
        return out

    def _timeout(self, p: _Partition, w: _Waiter) -> GeoAckTimeout:
        holding = self.held.sites_holding(w.key[0], w.key[1], w.origin, w.seq)
        quorum = (
            f"; this site's ack quorum has not confirmed it yet (last add confirmed {p.lac}, batch ends at "
            f"{w.quorum_offset})"
            if p.lac < w.quorum_offset
            else ""
        )
        return GeoAckTimeout(
            f"acks=geo:{w.sites} not reached within {w.timeout_ms} ms: {len(holding)} site(s) "
            f"({', '.join(holding) or 'none'}) hold {w.key[0]}/{w.key[1]} origin seq {w.seq} of {w.origin}{quorum}. "
            f"The batch stays written at site {self.site} and replicates when the links allow; a retry by the same "
            "producer is deduplicated, so retrying is safe"
        )
