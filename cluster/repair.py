"""Repair planning: which segments to copy or roll after nodes die or drain. Pure.

Each segment of a partition is held by its *ensemble* (ARCHITECTURE.md,
"Inside a site"). When a member dies or is being decommissioned (draining),
the segment has fewer copies than the site asked for. :func:`plan_repair`
takes a snapshot of the segments (:class:`SegmentView`), of the nodes
(``cluster.placement.NodeLoad``), of when each dead node was first seen dead,
and of the copies already under way, and returns what to do, like
BookKeeper's autorecovery, without I/O and without reading a clock (time
comes in as ``now_ms``). The shell carries the effects out; running the
planner twice on the same input gives the same plan.

A member *must be replaced* when it is draining (dead or alive), or dead for
at least ``repair_delay_ms`` (``now_ms - down_since_ms[node] >=
repair_delay_ms``). A draining node is leaving by request, so waiting gains
nothing. A dead node may be rebooting: copying everything it held costs far
more than waiting a few minutes, which is why there is a delay
(BookKeeper's ``lostBookieRecoveryDelay``, HDFS's ten and a half minutes).

A segment is also *short* when its ensemble has fewer members than
``replication_factor`` (passed in; None: each segment's own ensemble size, so
none is short). A leader opens a segment on fewer nodes while fewer are
eligible, down to the ack quorum (``cluster/leadership.py``). A short sealed
segment *must be widened*, **at once**: one copy per missing member, whose
target then joins the ensemble (:class:`CopySegment` with ``replaces`` None;
the metadata's ``AddMember``). No delay, because the delay is a bet that a
dead member comes back with its copy and makes a copy unnecessary, and a
short segment has no such member: the nodes it lacks never held it, so its
``replication_factor - len(ensemble)`` copies must be made whatever happens,
and waiting would only keep its data on fewer copies for longer. In practice
the copy is made as soon as a node outside its ensemble is eligible (it
opened short because no other node was); until then each pass reports
:class:`NoRepairTarget`, which says why.

For each segment with a dead or draining member, or short, in order of
topic, partition and segment id:

* **No alive member** (every member dead, draining ones included):
  :class:`SegmentUnavailable`. Nothing can be copied or rolled; the data comes
  back only with one of its members, so their disks must not be wiped.
* **Open segment with a dead or draining member:** :class:`RollSegment`, at
  once (no delay). An open segment is still being written: a copy would
  chase a moving tail and race the leader's appends and fencing. Instead the leader seals it, which fixes its
  end, and opens the next segment on a fresh ensemble of eligible nodes
  (BookKeeper's ensemble change); the segment, now sealed, is then repaired by
  copy like any other. Rolling moves no bytes, while every batch written in
  the meantime lands on fewer nodes than the replication factor, so there is
  nothing to gain by waiting. One roll is planned per segment, naming the
  first dead member (else the first draining one) by node id. When that node
  is the leader (``ensemble[0]`` opened the segment), the leader change does
  the roll: the new leader's recovery seals the segment and opens the next.
* **Short open segment, every member healthy:** :class:`RollSegment` with
  ``dead`` None, at once, as soon as a node outside its ensemble is alive and
  not draining, so that the leader opens the next segment on
  ``replication_factor`` nodes; the sealed one is then widened by copy. Not
  before: with no node to add, the next segment would open just as short,
  and the roll would only add a seal. (The leader may still see fewer live
  nodes than the planner for a moment and open short once more; the next
  pass rolls that one too.)
* **Sealed segment:** members already being copied (``in_progress``,
  matched on topic, partition, segment id and ``replaces``) are left alone:
  a copy is never planned twice. Of the others, one :class:`CopySegment` per
  member that must be replaced, and one :class:`AwaitingRepairDelay` per
  member dead for less than the delay, with the time it becomes due
  (:attr:`RepairPlan.next_due_ms`: set a timer and plan again then). A short
  sealed segment gets one :class:`CopySegment` with ``replaces`` None per
  missing member, less the additions already in progress.

A copy's **source** is an alive member that holds the whole segment: a
non-draining one first (a draining node has the rest of its decommission to
serve), then the one sending the fewest copies (in progress, or planned
earlier in this pass), so that the copies of a dead node's segments are read
from all the nodes that hold them, then the least loaded, then the lowest id.
A sealed segment is immutable, and recovery copies every batch a quorum could
have acked to the members that answered its fence, but a member can still
hold *less* than the sealed end: one that was dead or cut off when its leader
rolled the segment at the LAC, one outside the recovery's fence quorum, or a
dead leader that lost its unfsynced tail. The shell reports those members
(:attr:`SegmentView.short`, from what each member says it holds); a short
member is never a source, and while it is alive and not draining it gets a
:class:`FillSegment`: the missing tail, copied from a member that holds it all
(no metadata change: it is a member already). The shell checks the CRCs after
every copy anyway. A dead node is never a source.

A copy's **target** is chosen with the placement preference
(``cluster.placement.choose_ensemble``: not overloaded, most free bytes in
coarse buckets, least load, a hash salted by the segment) among alive,
non-draining nodes
with at least ``size_bytes`` free, excluding the segment's members and the
targets of the copies of the same segment already in progress or planned
earlier in this pass. So a target is never a current member, and two copies
never land on the same node. Each planned copy counts, for the rest of the
pass, as ``size_bytes`` less free space and one more unit of load on its
target, so that one pass spreads its copies instead of sending all of them
to the emptiest node. No eligible target: :class:`NoRepairTarget`, with the
reason and what to do.

**At most ``max_concurrent_copies``** copies run at once, those in progress
included (0 pauses repair). When there are more to do, the segments with the
fewest copies left go first (fewest alive non-draining members, then fewest
alive members, then order): they are the closest to losing data. The rest
are :class:`CopyDeferred`, planned again on a later pass.

Why applying the copies leaves no sealed segment under-replicated when every
dead member is past the delay, every segment has an alive member, and there
are ``H`` alive, non-draining nodes with room, at least
``max(replication_factor, largest ensemble)``: for a segment with ensemble
``E``, ``h`` healthy members and ``R = max(replication_factor, |E|)``,
``|E| - h`` members must be replaced and ``R - |E|`` added, ``R - h`` copies
in all. At the ``k``-th of them, the earlier ``k - 1`` took one target each,
so at least ``H - h - (k - 1) >= R - h - (k - 1) >= 1`` healthy non-members
remain eligible: a target exists for every one, and each copy puts a healthy
node in a lost member's place or in a missing one. A pass therefore plans
``min(slots, copies left)`` copies, never none while one is left, and after
``ceil(copies / max_concurrent_copies)`` passes every sealed segment has
``R`` members, all healthy. (:func:`after_copy` is that update, which the
metadata makes once the copy is fsynced and its CRCs are checked.)

The caller drops a copy from ``in_progress`` once it is applied or has
failed (its source or target died): a failed copy is then planned again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import crc32c

from cluster.placement import NodeLoad, NotEnoughNodes, choose_ensemble, index_nodes
from topology.ids import NodeId, SegmentId

SegmentKey = tuple[str, int, SegmentId]


class InvalidRepairInput(ValueError):
    """The snapshot handed to the planner is inconsistent (a caller bug); the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class SegmentView:
    """What the planner needs of one segment of a partition's chain."""

    topic: str
    partition: int
    segment_id: SegmentId
    ensemble: tuple[NodeId, ...]  # ensemble[0] is the leader that opened it, until a copy replaces it
    sealed: bool
    size_bytes: int
    short: tuple[NodeId, ...] = ()  # members known to hold less than the sealed end: never a source; filled
    replication_factor: int | None = None  # its topic's own (issue 23); None: the plan's

    @property
    def key(self) -> SegmentKey:
        return (self.topic, self.partition, self.segment_id)


def _name(topic: str, partition: int, segment_id: SegmentId) -> str:
    return f"{topic}/{partition} segment {segment_id}"


def _nodes(nodes: Sequence[NodeId]) -> str:
    listed = ", ".join(str(n) for n in nodes)
    return f"node {listed}" if len(nodes) == 1 else f"nodes {listed}"


@dataclass(frozen=True, slots=True)
class CopySegment:
    """Effect: copy a sealed segment from ``source`` to ``target``; then ``target`` replaces ``replaces``
    (``ReplaceMember``), or, with ``replaces`` None, joins the ensemble, which is below ``replication_factor``
    (``AddMember``)."""

    topic: str
    partition: int
    segment_id: SegmentId
    source: NodeId
    target: NodeId
    replaces: NodeId | None

    @property
    def key(self) -> SegmentKey:
        return (self.topic, self.partition, self.segment_id)

    def message(self) -> str:
        then = (
            "adding a member (it has fewer than replication_factor)"
            if self.replaces is None
            else f"replacing node {self.replaces}"
        )
        return (
            f"copy {_name(self.topic, self.partition, self.segment_id)} from node {self.source} to node "
            f"{self.target}, {then}"
        )


@dataclass(frozen=True, slots=True)
class FillSegment:
    """Effect: copy the tail of a sealed segment that ``target``, a member, lacks, from ``source``, a member that
    holds it all. The ensemble does not change."""

    topic: str
    partition: int
    segment_id: SegmentId
    source: NodeId
    target: NodeId

    @property
    def key(self) -> SegmentKey:
        return (self.topic, self.partition, self.segment_id)

    def message(self) -> str:
        return (
            f"fill {_name(self.topic, self.partition, self.segment_id)} on node {self.target} (it holds less than the "
            f"sealed end) from node {self.source}"
        )


@dataclass(frozen=True, slots=True)
class RollSegment:
    """Effect: the partition's leader seals this open segment and opens the next one on eligible nodes."""

    topic: str
    partition: int
    segment_id: SegmentId
    dead: NodeId | None  # the first dead member, else the first draining one; None: short, and a node can join

    def message(self) -> str:
        if self.dead is None:
            return (
                f"roll {self.topic}/{self.partition}: open segment {self.segment_id} has fewer members than "
                "replication_factor and another node is eligible; the leader seals it and opens the next segment "
                "on replication_factor nodes"
            )
        return (
            f"roll {self.topic}/{self.partition}: open segment {self.segment_id} has node {self.dead} dead or "
            "draining; the leader seals it and opens the next segment without that node"
        )


@dataclass(frozen=True, slots=True)
class SegmentUnavailable:
    """No alive member holds the segment: its data cannot be read, copied or rolled until one comes back."""

    topic: str
    partition: int
    segment_id: SegmentId
    ensemble: tuple[NodeId, ...]

    def message(self) -> str:
        return (
            f"{_name(self.topic, self.partition, self.segment_id)} is unavailable: every member "
            f"({_nodes(self.ensemble)}) is dead. Bring one of them back; do not wipe their data dirs"
        )


@dataclass(frozen=True, slots=True)
class NoRepairTarget:
    """A member must be replaced (or added: ``replaces`` None) but no node can take the copy."""

    topic: str
    partition: int
    segment_id: SegmentId
    replaces: NodeId | None
    reason: str  # the placement error's message, with what to do

    def message(self) -> str:
        what = "get another member" if self.replaces is None else f"replace node {self.replaces}"
        return f"{_name(self.topic, self.partition, self.segment_id)} cannot {what}: {self.reason}"


@dataclass(frozen=True, slots=True)
class AwaitingRepairDelay:
    """A member is dead but not for ``repair_delay_ms`` yet: it may come back; copy at ``due_ms`` otherwise."""

    topic: str
    partition: int
    segment_id: SegmentId
    dead: NodeId
    due_ms: int

    def message(self) -> str:
        return (
            f"{_name(self.topic, self.partition, self.segment_id)} lost node {self.dead}; it is copied elsewhere "
            f"at {self.due_ms} ms unless the node comes back first"
        )


@dataclass(frozen=True, slots=True)
class CopyDeferred:
    """A copy that is due but waits for a free slot (``max_concurrent_copies``); ``replaces`` None: an addition."""

    topic: str
    partition: int
    segment_id: SegmentId
    replaces: NodeId | None

    def message(self) -> str:
        what = "add a member" if self.replaces is None else f"replace node {self.replaces}"
        return (
            f"{_name(self.topic, self.partition, self.segment_id)} waits for a copy slot to {what} (every slot is "
            "busy; raise max_concurrent_copies to repair faster)"
        )


Unrepairable = SegmentUnavailable | NoRepairTarget


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """One pass of the planner.

    ``copies`` are the copies to start, most urgent first; ``rolls`` the open
    segments to roll; ``unrepairable`` what cannot be repaired now, each with
    its reason; ``waiting`` the members still within the repair delay;
    ``deferred`` the copies that wait for a slot.
    """

    copies: tuple[CopySegment, ...]
    rolls: tuple[RollSegment, ...]
    unrepairable: tuple[Unrepairable, ...]
    waiting: tuple[AwaitingRepairDelay, ...]
    deferred: tuple[CopyDeferred, ...]
    fills: tuple[FillSegment, ...] = ()  # short members to fill, after the copies (they share the slots)

    @property
    def next_due_ms(self) -> int | None:
        """When the next waiting member becomes due, if any: plan again then."""
        return min((w.due_ms for w in self.waiting), default=None)


@dataclass(frozen=True, slots=True)
class UnderReplicated:
    """A segment with fewer alive, non-draining members than its ensemble size, or than ``replication_factor``."""

    topic: str
    partition: int
    segment_id: SegmentId
    sealed: bool
    ensemble: tuple[NodeId, ...]
    dead: tuple[NodeId, ...]
    draining: tuple[NodeId, ...]  # alive and draining
    replication_factor: int | None = None  # None: the ensemble's size

    @property
    def live_count(self) -> int:
        return len(self.ensemble) - len(self.dead) - len(self.draining)

    @property
    def wanted(self) -> int:
        """The members it should have: ``replication_factor``, or its ensemble's size if that is larger."""
        return max(len(self.ensemble), self.replication_factor or 0)

    def message(self) -> str:
        state = "sealed" if self.sealed else "open"
        lost = (("dead", self.dead), ("draining", self.draining))
        details = [f"{label}: {_nodes(ns)}" for label, ns in lost if ns]
        if self.wanted > len(self.ensemble):
            details.append(f"{self.wanted - len(self.ensemble)} short of replication_factor")
        return (
            f"{_name(self.topic, self.partition, self.segment_id)} ({state}) has {self.live_count} of "
            f"{self.wanted} members live ({'; '.join(details)})"
        )


def _segment_salt(segment: SegmentView) -> int:
    return int(crc32c.crc32c(f"{segment.topic}/{segment.partition}/{segment.segment_id}".encode()))


def _checked_segments(segments: Iterable[SegmentView], by_id: Mapping[NodeId, NodeLoad]) -> list[SegmentView]:
    """The segments in key order, refusing duplicates, empty ensembles and members not in the node table."""
    ordered = sorted(segments, key=lambda s: s.key)
    for i, s in enumerate(ordered):
        name = _name(s.topic, s.partition, s.segment_id)
        if i and ordered[i - 1].key == s.key:
            raise InvalidRepairInput(f"{name} appears twice: pass each segment once")
        if not s.ensemble:
            raise InvalidRepairInput(f"{name} has an empty ensemble: every segment is held by at least one node")
        if len(set(s.ensemble)) != len(s.ensemble):
            raise InvalidRepairInput(f"{name} lists a node twice in its ensemble ({_nodes(s.ensemble)})")
        if s.size_bytes < 0:
            raise InvalidRepairInput(f"{name} has size_bytes={s.size_bytes}: must be >= 0")
        unknown = [m for m in s.ensemble if m not in by_id]
        if unknown:
            raise InvalidRepairInput(
                f"{name} lists {_nodes(unknown)}, not in the node table: pass every node that a "
                "segment names (a node leaves the table only once drained)"
            )
    return ordered


def under_replicated(
    segments: Iterable[SegmentView], nodes: Iterable[NodeLoad], *, replication_factor: int | None = None
) -> tuple[UnderReplicated, ...]:
    """Segments with fewer alive, non-draining members than their ensemble size (or than ``replication_factor``,
    when given), in key order.

    For ``georep cluster status``; open and sealed segments alike.
    """
    _check_replication_factor(replication_factor)
    by_id = index_nodes(nodes)
    out: list[UnderReplicated] = []
    for s in _checked_segments(segments, by_id):
        dead = tuple(m for m in s.ensemble if not by_id[m].alive)
        draining = tuple(m for m in s.ensemble if by_id[m].alive and by_id[m].draining)
        rf = _rf(s, replication_factor)
        if dead or draining or _missing(s, rf):
            out.append(UnderReplicated(s.topic, s.partition, s.segment_id, s.sealed, s.ensemble, dead, draining, rf))
    return tuple(out)


def _check_replication_factor(replication_factor: int | None) -> None:
    if replication_factor is not None and replication_factor < 1:
        raise InvalidRepairInput(f"replication_factor={replication_factor}: must be >= 1 (or None)")


def _rf(segment: SegmentView, replication_factor: int | None) -> int | None:
    """The replication factor ``segment`` is held to: its topic's, else the plan's."""
    return replication_factor if segment.replication_factor is None else segment.replication_factor


def _missing(segment: SegmentView, replication_factor: int | None) -> int:
    """How many members ``segment`` lacks to have ``replication_factor`` (0 when None)."""
    return 0 if replication_factor is None else max(0, replication_factor - len(segment.ensemble))


def drained(node: NodeId, segments: Iterable[SegmentView]) -> bool:
    """Whether no segment lists ``node`` any more: it holds nothing the site needs and can be removed."""
    return all(node not in s.ensemble for s in segments)


def after_copy(segment: SegmentView, copy: CopySegment) -> SegmentView:
    """The segment once ``copy`` is done: ``copy.target`` takes the place of ``copy.replaces``, or joins the
    ensemble, last, when ``copy.replaces`` is None."""
    if copy.key != segment.key:
        raise InvalidRepairInput(f"{copy.message()} does not apply to {_name(*segment.key)}")
    lost = copy.replaces is not None and copy.replaces not in segment.ensemble
    if lost or copy.target in segment.ensemble:
        raise InvalidRepairInput(f"{copy.message()} does not apply: the ensemble is now {_nodes(segment.ensemble)}")
    if copy.replaces is None:
        return replace(segment, ensemble=(*segment.ensemble, copy.target))
    ensemble = tuple(copy.target if m == copy.replaces else m for m in segment.ensemble)
    return replace(segment, ensemble=ensemble)


@dataclass(frozen=True, slots=True)
class _Need:
    segment: SegmentView
    replaces: NodeId | None  # None: a member to add (the segment is below replication_factor)
    healthy: int  # alive, non-draining members
    alive: int

    def order(self) -> tuple[int, int, SegmentKey, bool, int]:
        """Closest to losing data first; in one segment, replacements before additions."""
        return (self.healthy, self.alive, self.segment.key, self.replaces is None, self.replaces or 0)


def plan_repair(
    segments: Iterable[SegmentView],
    nodes: Iterable[NodeLoad],
    *,
    down_since_ms: Mapping[NodeId, int],
    now_ms: int,
    repair_delay_ms: int,
    in_progress: Iterable[CopySegment | FillSegment] = (),
    max_concurrent_copies: int,
    replication_factor: int | None = None,
) -> RepairPlan:
    """Plan copies and rolls for the segments with dead or draining members or fewer than ``replication_factor``
    (None: none is short), and fills for short members (see the module docstring).

    Raises :class:`InvalidRepairInput` for an inconsistent snapshot (a member
    missing from ``nodes``, a dead node without ``down_since_ms``, ...) and
    ``InvalidPlacementRequest`` for a node table with duplicate ids or
    negative figures.
    """
    if repair_delay_ms < 0:
        raise InvalidRepairInput(f"repair_delay_ms={repair_delay_ms}: must be >= 0")
    if max_concurrent_copies < 0:
        raise InvalidRepairInput(f"max_concurrent_copies={max_concurrent_copies}: must be >= 0 (0 pauses repair)")
    _check_replication_factor(replication_factor)
    by_id = index_nodes(nodes)
    missing = [n for n in sorted(by_id) if not by_id[n].alive and n not in down_since_ms]
    if missing:
        raise InvalidRepairInput(
            f"{_nodes(missing)}: dead but no down_since_ms: record when each dead node was first seen dead"
        )
    ordered = _checked_segments(segments, by_id)
    running = list(in_progress)
    survey = _Survey(by_id, running)
    for s in ordered:
        survey.add(s, _rf(s, replication_factor), down_since_ms, now_ms, repair_delay_ms)
    budget = _Budget.of(by_id, running, max_concurrent_copies)
    copies, deferred = _place_copies(survey, budget)
    fills = _plan_fills(ordered, survey, budget, deferred)
    return RepairPlan(
        tuple(copies),
        tuple(survey.rolls),
        tuple(survey.unrepairable),
        tuple(survey.waiting),
        tuple(deferred),
        tuple(fills),
    )


@dataclass
class _Survey:
    """What each segment needs, before any copy is placed: rolls of open segments, copies to place (needs), and
    the segments that must wait for the repair delay or cannot be repaired."""

    by_id: dict[NodeId, NodeLoad]
    running: list[CopySegment | FillSegment]
    rolls: list[RollSegment] = field(default_factory=list)
    unrepairable: list[Unrepairable] = field(default_factory=list)
    waiting: list[AwaitingRepairDelay] = field(default_factory=list)
    needs: list[_Need] = field(default_factory=list)
    busy: set[tuple[SegmentKey, NodeId | None]] = field(default_factory=set)
    taken: dict[SegmentKey, set[NodeId]] = field(default_factory=dict)
    adding: dict[SegmentKey, int] = field(default_factory=dict)  # additions in progress, per segment

    def __post_init__(self) -> None:
        self.busy = {(c.key, c.replaces if isinstance(c, CopySegment) else c.target) for c in self.running}
        for c in self.running:
            if isinstance(c, CopySegment):
                self.taken.setdefault(c.key, set()).add(c.target)
                if c.replaces is None:
                    self.adding[c.key] = self.adding.get(c.key, 0) + 1

    def add(
        self,
        s: SegmentView,
        replication_factor: int | None,
        down_since_ms: Mapping[NodeId, int],
        now_ms: int,
        repair_delay_ms: int,
    ) -> None:
        by_id = self.by_id
        dead = sorted(m for m in s.ensemble if not by_id[m].alive)
        draining = sorted(m for m in s.ensemble if by_id[m].alive and by_id[m].draining)
        lacking = _missing(s, replication_factor)
        if not dead and not draining and not lacking:
            return
        alive = len(s.ensemble) - len(dead)
        if alive == 0:
            self.unrepairable.append(SegmentUnavailable(s.topic, s.partition, s.segment_id, s.ensemble))
            return
        if not s.sealed:
            if dead or draining:
                self.rolls.append(RollSegment(s.topic, s.partition, s.segment_id, (dead + draining)[0]))
            elif any(n.alive and not n.draining and n.node not in s.ensemble for n in by_id.values()):
                self.rolls.append(RollSegment(s.topic, s.partition, s.segment_id, None))
            return
        healthy = alive - len(draining)
        self.needs.extend(_Need(s, None, healthy, alive) for _ in range(lacking - self.adding.get(s.key, 0)))
        for m in sorted(s.ensemble):
            node = by_id[m]
            if (node.alive and not node.draining) or (s.key, m) in self.busy:
                continue
            if not node.alive and not node.draining:
                due_ms = down_since_ms[m] + repair_delay_ms
                if now_ms < due_ms:
                    self.waiting.append(AwaitingRepairDelay(s.topic, s.partition, s.segment_id, m, due_ms))
                    continue
            self.needs.append(_Need(s, m, healthy, alive))


@dataclass
class _Budget:
    """Free bytes, load and sends per node as copies are placed, and the copy slots left."""

    free_bytes: dict[NodeId, int]
    load: dict[NodeId, int]
    sends: dict[NodeId, int]
    slots: int

    @classmethod
    def of(
        cls, by_id: Mapping[NodeId, NodeLoad], running: list[CopySegment | FillSegment], max_concurrent_copies: int
    ) -> _Budget:
        sends = dict.fromkeys(by_id, 0)
        for c in running:
            if c.source in sends:
                sends[c.source] += 1
        return cls(
            {n: by_id[n].free_bytes for n in by_id},
            {n: by_id[n].load for n in by_id},
            sends,
            max(0, max_concurrent_copies - len(running)),
        )

    def source(self, complete: list[NodeLoad]) -> NodeId:
        """The member to copy from: not draining, then the fewest sends, the least load, the lowest id."""
        return min(complete, key=lambda n: (n.draining, self.sends[n.node], self.load[n.node], n.node)).node


def _place_copies(survey: _Survey, budget: _Budget) -> tuple[list[CopySegment], list[CopyDeferred]]:
    """A target and a source for each need, most urgent first, within the slots; unrepairable ones noted."""
    by_id = survey.by_id
    copies: list[CopySegment] = []
    deferred: list[CopyDeferred] = []
    for need in sorted(survey.needs, key=_Need.order):
        s = need.segment
        if budget.slots == 0:
            deferred.append(CopyDeferred(s.topic, s.partition, s.segment_id, need.replaces))
            continue
        complete = [by_id[m] for m in s.ensemble if by_id[m].alive and m not in s.short]
        if not complete:
            survey.unrepairable.append(
                NoRepairTarget(
                    s.topic,
                    s.partition,
                    s.segment_id,
                    need.replaces,
                    "no alive member holds the whole segment to copy it from: bring back a member that does",
                )
            )
            continue
        targets = survey.taken.setdefault(s.key, set())
        snapshot = [replace(by_id[n], free_bytes=budget.free_bytes[n], load=budget.load[n]) for n in sorted(by_id)]
        try:
            (target,) = choose_ensemble(
                snapshot,
                1,
                leader=None,
                exclude=set(s.ensemble) | targets,
                salt=_segment_salt(s),
                min_free_bytes=s.size_bytes,
            )
        except NotEnoughNodes as e:
            survey.unrepairable.append(NoRepairTarget(s.topic, s.partition, s.segment_id, need.replaces, str(e)))
            continue
        source = budget.source(complete)
        copies.append(CopySegment(s.topic, s.partition, s.segment_id, source, target, need.replaces))
        targets.add(target)
        budget.free_bytes[target] -= s.size_bytes
        budget.load[target] += 1
        budget.sends[source] += 1
        budget.slots -= 1
    return copies, deferred


def _plan_fills(
    ordered: list[SegmentView], survey: _Survey, budget: _Budget, deferred: list[CopyDeferred]
) -> list[FillSegment]:
    """Fills of the live, not draining short members of sealed segments, with the slots copies left."""
    by_id = survey.by_id
    fills: list[FillSegment] = []
    for s in ordered:
        for m in sorted(set(s.short)) if s.sealed else ():
            if m not in s.ensemble or not by_id[m].alive or by_id[m].draining or (s.key, m) in survey.busy:
                continue  # a dead or draining short member is replaced by a copy instead
            complete = [by_id[x] for x in s.ensemble if by_id[x].alive and x not in s.short]
            if not complete:
                continue  # filled once a member that holds it all is back
            if budget.slots == 0:
                deferred.append(CopyDeferred(s.topic, s.partition, s.segment_id, m))
                continue
            source = budget.source(complete)
            fills.append(FillSegment(s.topic, s.partition, s.segment_id, source, m))
            budget.sends[source] += 1
            budget.slots -= 1
    return fills


# -- decommissioning: leaderships off draining nodes, and how far a drain has got ---------------------------------


@dataclass(frozen=True, slots=True)
class LeaderView:
    """What :func:`plan_leader_moves` needs of one partition: its leader, epoch and open segment's ensemble."""

    topic: str
    partition: int
    leader: NodeId | None
    leader_epoch: int
    open_ensemble: tuple[NodeId, ...] | None  # None: no open segment


@dataclass(frozen=True, slots=True)
class MoveLeadership:
    """Effect: elect ``to`` leader of the partition in place of draining ``leader`` (compare-and-set on
    ``expected_epoch``, the metadata's ``ElectLeader``)."""

    topic: str
    partition: int
    leader: NodeId
    to: NodeId
    expected_epoch: int

    def message(self) -> str:
        return (
            f"move the leadership of {self.topic}/{self.partition} from node {self.leader}, which is draining, to "
            f"node {self.to}; its recovery seals the open segment and opens the next one without node {self.leader}"
        )


@dataclass(frozen=True, slots=True)
class LeadershipStuck:
    """A draining node leads a partition and no node can take the leadership over now."""

    topic: str
    partition: int
    leader: NodeId
    reason: str

    def message(self) -> str:
        return f"{self.topic}/{self.partition} stays led by draining node {self.leader}: {self.reason}"


def plan_leader_moves(
    partitions: Iterable[LeaderView], nodes: Iterable[NodeLoad]
) -> tuple[MoveLeadership | LeadershipStuck, ...]:
    """One :class:`MoveLeadership` per partition led by an alive, draining node, in topic and partition order
    (:class:`LeadershipStuck` where no node can take it).

    **Why move it at all.** A draining node takes no new segment
    (``cluster.placement``), and the leader is always the first member of the
    segment it opens, so a draining leader cannot open its partition's next
    segment: at its next roll the partition would stop taking writes. The
    repair planner cannot roll its open segment away either (the leader is
    the member it would roll away from). So the leadership moves first, as
    Kafka's controlled shutdown moves leaderships off a broker: the new
    leader's recovery fences the old one, seals the open segment at an end
    that keeps every acknowledged write, and opens the next one on eligible
    nodes; the sealed segment is then copied off the draining node like any
    other.

    **Who takes it.** A member of the open segment's ensemble, as for any
    election (``site_state.plan_leadership`` has the proof: only its members
    hold the segment, and the new leader recovers it); any node when nothing
    is open. Among those: alive, not draining, then the one leading the
    fewest partitions (moves planned earlier in this pass count), then the
    least loaded, then the lowest id, so that one drain spreads its
    leaderships. A dead or missing leader is ``plan_leadership``'s case, not
    this one.
    """
    by_id = index_nodes(nodes)
    views = sorted(partitions, key=lambda p: (p.topic, p.partition))
    leads: dict[NodeId, int] = {}
    for p in views:
        if p.leader is not None:
            leads[p.leader] = leads.get(p.leader, 0) + 1
    out: list[MoveLeadership | LeadershipStuck] = []
    for p in views:
        leader = by_id.get(p.leader) if p.leader is not None else None
        if p.leader is None or leader is None or not leader.alive or not leader.draining:
            continue
        pool = sorted(by_id) if p.open_ensemble is None else list(p.open_ensemble)
        candidates = [
            by_id[n] for n in pool if n in by_id and n != p.leader and by_id[n].alive and not by_id[n].draining
        ]
        if not candidates:
            where = "the open segment's other members" if p.open_ensemble is not None else "the other nodes"
            out.append(
                LeadershipStuck(
                    p.topic,
                    p.partition,
                    p.leader,
                    f"none of {where} is alive and not draining; bring one back, or stop draining another node",
                )
            )
            continue
        best = min(candidates, key=lambda n: (leads.get(n.node, 0), n.load, n.node))
        leads[best.node] = leads.get(best.node, 0) + 1
        leads[p.leader] -= 1
        out.append(MoveLeadership(p.topic, p.partition, p.leader, best.node, p.leader_epoch))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DrainStatus:
    """How far a node's decommission has got: what the metadata still puts on it."""

    node: NodeId
    draining: bool
    sealed_segments: int  # sealed segments whose ensemble lists it: repair copies them elsewhere
    open_segments: int  # open ones: repair rolls them
    leader_of: int  # partitions it leads: the controller moves them

    @property
    def drained(self) -> bool:
        """Draining, and nothing in the metadata names it any more: it can be stopped without losing a copy."""
        return self.draining and not (self.sealed_segments or self.open_segments or self.leader_of)

    def message(self) -> str:
        if not self.draining:
            return f"node {self.node} is not draining"
        if self.drained:
            return f"node {self.node} is drained: it holds no segment the site needs and leads no partition"
        return (
            f"node {self.node} is draining: it still holds {self.sealed_segments} sealed and {self.open_segments} "
            f"open segment(s) and leads {self.leader_of} partition(s)"
        )


def drain_status(
    node: NodeId, draining: bool, segments: Iterable[SegmentView], partitions: Iterable[LeaderView]
) -> DrainStatus:
    """What the metadata (``segments``, ``partitions``) still puts on ``node``."""
    held = [s for s in segments if node in s.ensemble]
    return DrainStatus(
        node,
        draining,
        sum(1 for s in held if s.sealed),
        sum(1 for s in held if not s.sealed),
        sum(1 for p in partitions if p.leader == node),
    )
