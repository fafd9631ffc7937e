"""The invariants of one site's segment cluster, checked by ``cluster.py`` after every event.

The checker sees the whole site at once (every node's disk, the committed metadata, every ack
released and every batch a reader was handed), like the Spark audit sees every site. It keeps
what it needs to check incrementally: each check runs when the event that could break it happens
(a write, an ack, a commit, a cut, a read), and the durability check C1 runs again, after the event,
on every segment whose copies or ensemble changed.

* **C1 durability** (I6 for ``acks=all``). Every batch released at the LAC is held fsynced by at
  least AQ members of its segment (the committed ensemble, repairs included): at the release, and
  after every cut, member replacement or crash that touches the segment. Disks survive a kill (it
  loses only what was not fsynced), so with a correct protocol this never fails; when it does after
  more than E - AQ of the segment's members crashed since the ack (E: the ensemble it opened on, RF
  or fewer), it is counted as "exceeded the fault budget" instead, except in single-node-loss runs,
  where it must always hold.
* **C2 chain.** After every committed metadata command: a partition's segments are numbered 0, 1, 2,
  ..., the first starts at 0 and each next one at the previous one's sealed end, at most one is open
  and it is the last, a sealed end never changes, an ensemble has AQ to RF distinct nodes, and
  leader epochs never go down.
* **C3 prefix.** Each segment has one writer stream (the batches its opener appended, in order), and
  every batch any node writes into its copy (an append, a recovery copy, a repair copy) must be the
  stream's batch at that offset, at the copy's end: every copy is a prefix of the stream, cuts
  included. Once a node knows a seal, its copy ends at or before the sealed end; a cut is at a batch
  boundary.
* **C4 visibility.** A reader reads any member up to the LAC its leader reports (an open segment) or
  the sealed end. What it is handed must be within that bound and held fsynced by AQ members at that
  moment (budget as C1); a later read at the same offset must give the same batch; after a seal, what
  was read of the segment is below the sealed end; at the end, everything read is in the chain.
* **C5 one writer per epoch.** A member accepts appends of one partition in non-decreasing epochs,
  never under an epoch older than the fence it persisted, and in one epoch from one leader (node and
  incarnation) only; its fence never goes back, across restarts too; an epoch names one leader; and
  an ``ElectLeader`` applies only at the epoch it expected (the compare-and-set that keeps two
  controllers from both winning).
* **C6 placement and repair effects.** The planners' effects are checked against the ground truth
  before they are carried out: no member of a new ensemble, and no source or target of a repair copy,
  had been silent (no heartbeat sent) for the whole session timeout, so no metadata view could show it
  alive; a new ensemble has RF members, or every node eligible in its leader's view when fewer are
  (never fewer than AQ); a repair copy is of a sealed segment, to a node outside its ensemble, and
  one that adds a member is of a segment below RF. An expansion node is in the first ensemble placed
  after it is eligible, and holds no copy of an older segment except through repair.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster.site_state import Applied, Command, ElectLeader, PartitionInfo, Result, SiteState
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_model import Batch, ClusterCounts, PartKey, SegCopy, SegKey
from topology.ids import LeaderEpoch, NodeId, SegmentId

ALL_CHECKS = frozenset({"C1", "C2", "C3", "C4", "C5", "C6"})


@dataclass(frozen=True, slots=True)
class AckedBatch:
    """A batch released at the LAC (``acks=all``): the promise C1 holds the site to."""

    key: PartKey
    segment_id: SegmentId
    batch: Batch
    released_ms: int
    leader: NodeId
    epoch: LeaderEpoch


def _seg(key: SegKey) -> str:
    return f"{key[0]}/{key[1]} segment {key[2]}"


class ClusterChecker:
    def __init__(
        self,
        *,
        rf: int,
        aq: int,
        single_loss: bool,
        session_timeout_ms: int,
        copies_of: Callable[[NodeId], Mapping[SegKey, SegCopy]],
        counts: ClusterCounts,
        enabled: frozenset[str] = ALL_CHECKS,
    ) -> None:
        self.rf = rf
        self.aq = aq
        self.single_loss = single_loss
        self.session_timeout_ms = session_timeout_ms
        self._copies_of = copies_of
        self.counts = counts
        self.enabled = enabled
        self.streams: dict[SegKey, list[Batch]] = {}  # the writer stream of each segment
        self.writers: dict[SegKey, tuple[NodeId, int, LeaderEpoch]] = {}  # (node, incarnation, epoch)
        self.acked: dict[PartKey, dict[int, AckedBatch]] = {}  # payload -> where it was acked
        self._acked_max: dict[SegKey, AckedBatch] = {}  # per segment, the acked batch with the largest end
        self._excused: dict[SegKey, int] = {}  # segment -> the acked end already counted as over budget
        self.members_ever: dict[SegKey, list[NodeId]] = {}
        self.opened_size: dict[SegKey, int] = {}  # the ensemble size a segment opened with
        self.opened_aq: dict[SegKey, int] = {}  # the ack quorum a segment opened with (its topic's then)
        self.opened_ms: dict[SegKey, int] = {}
        self.crash_times: dict[NodeId, list[int]] = {}
        self.sealed_ends: dict[SegKey, int] = {}
        self.seen: dict[PartKey, dict[int, tuple[SegmentId, Batch]]] = {}
        self._accepted: dict[tuple[NodeId, PartKey, LeaderEpoch], tuple[NodeId, int]] = {}
        self._max_accepted: dict[tuple[NodeId, PartKey], LeaderEpoch] = {}
        self._fence: dict[tuple[NodeId, PartKey], LeaderEpoch] = {}
        self._epoch_leader: dict[tuple[PartKey, LeaderEpoch], NodeId] = {}
        self._epochs: dict[PartKey, LeaderEpoch] = {}
        self._dirty: set[SegKey] = set()
        self._seal_checked: set[SegKey] = set()

    def _fail(self, check: str, message: str) -> None:
        if check in self.enabled:
            raise InvariantViolation(f"{check} {message}")

    # -- C3 / C5: writes --------------------------------------------------------------------------------

    def writer_append(self, seg: SegKey, writer: tuple[NodeId, int, LeaderEpoch], batch: Batch) -> None:
        """The segment's writer appended ``batch`` to its stream (its own copy)."""
        first = self.writers.setdefault(seg, writer)
        if first != writer:
            self._fail(
                "C5",
                f"one writer per segment: {_seg(seg)} was opened by node {first[0]} (incarnation "
                f"{first[1]}, epoch {first[2]}), but node {writer[0]} (incarnation {writer[1]}, epoch "
                f"{writer[2]}) appends {batch} to it",
            )
        stream = self.streams.setdefault(seg, [])
        end = stream[-1].end if stream else None
        if end is not None and batch.offset != end:
            self._fail(
                "C3",
                f"prefix: the writer of {_seg(seg)} appends {batch} after its stream's end {end}: "
                "two different batches at one offset, or a hole",
            )
        stream.append(batch)

    def segment_opened(self, seg: SegKey, now_ms: int) -> None:
        self.streams.setdefault(seg, [])
        self.opened_ms.setdefault(seg, now_ms)

    def copy_write(self, node: NodeId, seg: SegKey, copy: SegCopy, batch: Batch, how: str) -> None:
        """``node`` writes ``batch`` at the end of its copy of ``seg`` (``how``: append, recovery, repair)."""
        if batch.offset != copy.end:
            self._fail(
                "C3",
                f"prefix: node {node} writes {batch} ({how}) into its copy of {_seg(seg)}, whose end "
                f"is {copy.end}: a copy must stay contiguous",
            )
        self.check_held(node, seg, batch, how)
        sealed = self.sealed_ends.get(seg)
        if sealed is not None and batch.end > sealed and how == "repair":
            self._fail("C3", f"prefix: node {node} got {batch} of {_seg(seg)} by repair, past its sealed end {sealed}")

    def check_held(self, node: NodeId, seg: SegKey, batch: Batch, how: str) -> None:
        """``batch`` (which ``node`` holds or is about to hold at its offset) is the writer stream's batch there."""
        stream = self.streams.get(seg, [])
        i = _index(stream, batch.offset)
        if i < 0 or stream[i] != batch:
            theirs = stream[i] if i >= 0 else None
            self._fail(
                "C3",
                f"prefix: node {node} holds {batch} ({how}) in {_seg(seg)}, but the writer's stream "
                f"has {theirs} at offset {batch.offset}: two different batches at one offset",
            )

    def accepted(self, node: NodeId, key: PartKey, epoch: LeaderEpoch, sender: tuple[NodeId, int]) -> None:
        """``node`` accepted an append of ``key`` from ``sender`` (node, incarnation) under ``epoch``."""
        first = self._accepted.setdefault((node, key, epoch), sender)
        if first != sender:
            self._fail(
                "C5",
                f"one writer per epoch: node {node} accepted appends of {key[0]}/{key[1]} under epoch "
                f"{epoch} from node {first[0]} (incarnation {first[1]}) and from node {sender[0]} "
                f"(incarnation {sender[1]})",
            )
        fence = self._fence.get((node, key), LeaderEpoch(0))
        if epoch < fence:
            self._fail(
                "C5",
                f"one writer per epoch: node {node} accepted an append of {key[0]}/{key[1]} under epoch "
                f"{epoch} while fenced at epoch {fence}: a deposed leader got past the fence",
            )
        top = self._max_accepted.get((node, key), LeaderEpoch(0))
        if epoch < top:
            self._fail(
                "C5",
                f"epochs only increase: node {node} accepted an append of {key[0]}/{key[1]} under epoch "
                f"{epoch} after one under epoch {top}: a deposed leader got past the fence",
            )
        self._max_accepted[(node, key)] = max(top, epoch)

    def fence_state(self, node: NodeId, key: PartKey, epoch: LeaderEpoch) -> None:
        """``node``'s persisted fence for ``key`` is now ``epoch``."""
        before = self._fence.get((node, key), LeaderEpoch(0))
        if epoch < before:
            self._fail(
                "C5",
                f"epochs only increase: node {node}'s fence for {key[0]}/{key[1]} went back from {before} to {epoch}",
            )
        self._fence[(node, key)] = max(before, epoch)

    # -- C1: durability ---------------------------------------------------------------------------------------

    def released(self, ack: AckedBatch, meta: SiteState, now_ms: int) -> None:
        """An ack went out at the LAC: record it, check exactly-once and C1 at once."""
        table = self.acked.setdefault(ack.key, {})
        before = table.get(ack.batch.payload)
        if before is not None and before.batch != ack.batch:
            self._fail(
                "C1",
                f"exactly once: batch {ack.batch.payload} of {ack.key[0]}/{ack.key[1]} was acked at "
                f"offset {before.batch.offset} (segment {before.segment_id}) and again at offset "
                f"{ack.batch.offset} (segment {ack.segment_id}): stored twice",
            )
        if before is None:
            table[ack.batch.payload] = ack
            self.counts.acked += 1
        seg = (ack.key[0], ack.key[1], ack.segment_id)
        top = self._acked_max.get(seg)
        if top is None or ack.batch.end > top.batch.end:
            self._acked_max[seg] = ack
        self._check_durable(seg, meta, now_ms)

    def acked_end(self, seg: SegKey) -> int:
        """The largest end of a batch acked in ``seg`` (0 if none)."""
        top = self._acked_max.get(seg)
        return top.batch.end if top is not None else 0

    def touched(self, seg: SegKey) -> None:
        """Something removed data from, or changed the members of, ``seg``: check C1 after the event."""
        self._dirty.add(seg)

    def crashed(self, node: NodeId, now_ms: int, copies: Mapping[SegKey, SegCopy]) -> None:
        self.crash_times.setdefault(node, []).append(now_ms)
        for seg in sorted(copies):
            self._dirty.add(seg)

    def after_event(self, meta: SiteState, now_ms: int) -> None:
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for seg in sorted(dirty):
            self._check_durable(seg, meta, now_ms)

    def holders(self, seg: SegKey, end: int, meta: SiteState) -> list[NodeId]:
        """Members of ``seg`` (the committed ensemble) whose disk holds ``[base, end)`` fsynced."""
        info = meta.partition(seg[0], seg[1])
        segment = info.segment(seg[2]) if info is not None else None
        if segment is None:
            return []
        out = []
        for member in segment.ensemble:
            copy = self._copies_of(member).get(seg)
            if copy is not None and copy.fsynced_end >= end:
                out.append(member)
        return out

    def crashes_since(self, seg: SegKey, since_ms: int) -> list[NodeId]:
        """Members (ever) of ``seg`` that crashed at or after ``since_ms``."""
        return [n for n in self.members_ever.get(seg, []) if any(t >= since_ms for t in self.crash_times.get(n, []))]

    def aq_of(self, seg: SegKey) -> int:
        """The quorum ``seg``'s writes are acked under: the one it opened with (its topic's then), else the site's."""
        return self.opened_aq.get(seg, self.aq)

    def _over_budget(self, seg: SegKey, since_ms: int) -> bool:
        budget = self.opened_size.get(seg, self.rf) - self.aq_of(seg)  # member losses the segment's writes survive
        return not self.single_loss and len(self.crashes_since(seg, since_ms)) > budget

    def _check_durable(self, seg: SegKey, meta: SiteState, now_ms: int) -> None:
        top = self._acked_max.get(seg)
        if top is None:
            return
        holders = self.holders(seg, top.batch.end, meta)
        if len(holders) >= self.aq_of(seg):
            return
        if self._over_budget(seg, top.released_ms):
            if self._excused.get(seg) != top.batch.end:
                self._excused[seg] = top.batch.end
                self.counts.budget_exceeded += 1
            return
        crashed = self.crashes_since(seg, top.released_ms)
        self._fail(
            "C1",
            f"durability: {top.batch} of {_seg(seg)}, acked at the LAC by node {top.leader} (epoch "
            f"{top.epoch}) {now_ms - top.released_ms} ms ago, is held fsynced by {len(holders)} member(s) "
            f"{holders} of the ensemble, fewer than min_insync_replicas={self.aq_of(seg)} (members crashed "
            f"since: {crashed})",
        )

    # -- C2 / C5: metadata ------------------------------------------------------------------------------------

    def committed(
        self, cmd: Command, result: Result, before: PartitionInfo | None, meta: SiteState, now_ms: int
    ) -> None:
        """A metadata command was applied at log position ``len(log)``; ``before`` is its partition before."""
        topic = getattr(cmd, "topic", None)
        partition = getattr(cmd, "partition", None)
        if (
            isinstance(cmd, ElectLeader)
            and isinstance(result, Applied)
            and before is not None
            and before.leader_epoch != cmd.expected_epoch
        ):
            self._fail(
                "C5",
                f"compare-and-set: ElectLeader of {cmd.topic}/{cmd.partition} for node {cmd.node} "
                f"expected epoch {cmd.expected_epoch} but applied at epoch {before.leader_epoch}: two "
                "plans from the same state both won",
            )
        if not isinstance(topic, str) or not isinstance(partition, int):
            return
        info = meta.partition(topic, partition)
        if info is None:
            return
        key = (topic, partition)
        previous = self._epochs.get(key, LeaderEpoch(0))
        if info.leader_epoch < previous:
            self._fail(
                "C2",
                f"epochs only increase: {topic}/{partition}'s leader epoch went from {previous} to {info.leader_epoch}",
            )
        self._epochs[key] = info.leader_epoch
        if info.leader is not None:
            named = self._epoch_leader.setdefault((key, info.leader_epoch), info.leader)
            if named != info.leader:
                self._fail(
                    "C5",
                    f"one leader per epoch: epoch {info.leader_epoch} of {topic}/{partition} named node "
                    f"{named} and now node {info.leader}",
                )
        self._check_chain(info, now_ms)

    def _check_chain(self, info: PartitionInfo, now_ms: int) -> None:
        where = f"{info.topic}/{info.partition}"
        next_base = 0
        for i, s in enumerate(info.segments):
            seg = (info.topic, info.partition, s.segment_id)
            if s.segment_id != i:
                self._fail("C2", f"chain: {where}'s segment #{i} has id {s.segment_id}")
            if s.base_offset != next_base:
                self._fail(
                    "C2",
                    f"chain: {where} segment {s.segment_id} starts at {s.base_offset}, not at "
                    f"{next_base} where the previous one was sealed",
                )
            aq = s.quorum(self.aq)
            if not aq <= len(s.ensemble) <= self.rf or len(set(s.ensemble)) != len(s.ensemble):
                self._fail(
                    "C2",
                    f"chain: {where} segment {s.segment_id} has ensemble {list(s.ensemble)}, not "
                    f"{aq} (its min_insync_replicas) to {self.rf} distinct nodes",
                )
            self.opened_size.setdefault(seg, len(s.ensemble))
            self.opened_aq.setdefault(seg, aq)
            if s.opened_epoch > info.leader_epoch:
                self._fail(
                    "C2",
                    f"chain: {where} segment {s.segment_id} was opened under epoch {s.opened_epoch}, "
                    f"after the partition's epoch {info.leader_epoch}",
                )
            members = self.members_ever.setdefault(seg, [])
            for m in s.ensemble:
                if m not in members:
                    members.append(m)
                    self._dirty.add(seg)
            self.opened_ms.setdefault(seg, now_ms)
            if not s.sealed:
                if i != len(info.segments) - 1:
                    self._fail("C2", f"chain: {where} segment {s.segment_id} is open but not the last")
                continue
            assert s.end_offset is not None
            if s.end_offset < s.base_offset:
                self._fail(
                    "C2",
                    f"chain: {where} segment {s.segment_id} ends at {s.end_offset}, before its base {s.base_offset}",
                )
            known = self.sealed_ends.setdefault(seg, int(s.end_offset))
            if known != s.end_offset:
                self._fail(
                    "C2",
                    f"chain: {where} segment {s.segment_id} was sealed at {known} and is now sealed at "
                    f"{s.end_offset}: a sealed end never changes",
                )
            if known == s.end_offset and seg not in self._seal_checked:
                self._seal_checked.add(seg)
                self._check_seen_after_seal(seg, int(s.end_offset))
            next_base = int(s.end_offset)

    # -- C4: readers ------------------------------------------------------------------------------------------

    def read(
        self, key: PartKey, seg: SegKey, node: NodeId, batch: Batch, bound: int, meta: SiteState, now_ms: int
    ) -> None:
        """A reader was handed ``batch`` of ``seg`` from ``node``'s copy, reading up to ``bound``."""
        self.counts.read_batches += 1
        if batch.end > bound:
            self._fail(
                "C4",
                f"visibility: node {node} handed a reader {batch} of {_seg(seg)}, past the bound "
                f"{bound} (the LAC or the sealed end)",
            )
        seen = self.seen.setdefault(key, {})
        before = seen.get(batch.offset)
        if before is not None and before[1] != batch:
            self._fail(
                "C4",
                f"visibility: a reader read {before[1]} at offset {batch.offset} of {key[0]}/{key[1]} "
                f"(segment {before[0]}) and now reads {batch} there (segment {seg[2]}): what a reader "
                "saw did not survive",
            )
        if before is None:
            seen[batch.offset] = (seg[2], batch)
        sealed = self.sealed_ends.get(seg)
        if sealed is not None and batch.end > sealed:
            self._fail("C4", f"visibility: a reader read {batch} of {_seg(seg)}, past its sealed end {sealed}")
        holders = self.holders(seg, batch.end, meta)
        if len(holders) < self.aq_of(seg) and not self._over_budget(seg, self.opened_ms.get(seg, 0)):
            self._fail(
                "C4",
                f"visibility: a reader read {batch} of {_seg(seg)} below bound {bound}, but only "
                f"{holders} hold it fsynced, fewer than min_insync_replicas={self.aq_of(seg)}: a crash could take "
                "back what it saw",
            )

    def _check_seen_after_seal(self, seg: SegKey, end: int) -> None:
        seen = self.seen.get((seg[0], seg[1]), {})
        for offset in sorted(seen):
            segment_id, batch = seen[offset]
            if segment_id == seg[2] and batch.end > end:
                self._fail(
                    "C4",
                    f"visibility: a reader read {batch} of {_seg(seg)}, but the segment was sealed at "
                    f"{end}: recovery cut what a reader saw",
                )

    # -- C6: effects of the planners --------------------------------------------------------------------------

    def placed(
        self, what: str, nodes: tuple[NodeId, ...], last_heartbeat_sent: Mapping[NodeId, int | None], now_ms: int
    ) -> None:
        """``nodes`` were chosen by a planner (``what``): none of them may have been silent for a session."""
        for n in nodes:
            sent = last_heartbeat_sent.get(n)
            if sent is None or now_ms - sent >= self.session_timeout_ms:
                silent = "never heartbeated" if sent is None else f"sent no heartbeat for {now_ms - sent} ms"
                self._fail(
                    "C6",
                    f"{what} chose node {n}, which {silent} (session timeout "
                    f"{self.session_timeout_ms} ms): no metadata view could show it alive",
                )

    def placed_size(self, what: str, ensemble: tuple[NodeId, ...], eligible: int, aq: int | None = None) -> None:
        """A new ensemble, placed when ``eligible`` nodes were alive and not draining in the leader's view, has RF
        members, or all of those when fewer (a segment opens short only when no other node could take it); never
        fewer than ``aq``, the quorum it opens with (None: the site's)."""
        aq = self.aq if aq is None else aq
        if len(ensemble) < min(self.rf, eligible) or len(ensemble) < aq:
            self._fail(
                "C6",
                f"{what} chose {len(ensemble)} node(s) {list(ensemble)} while {eligible} were eligible "
                f"(replication_factor {self.rf}, min_insync_replicas {aq}): a segment opens on "
                "fewer than RF nodes only when no other node can take it, and never on fewer than "
                "AQ",
            )

    def repair_planned(
        self, seg: SegKey, source: NodeId, target: NodeId, meta: SiteState, *, fill: bool = False, adds: bool = False
    ) -> None:
        """A repair copy (or a fill of a short member) planned: of a sealed segment, to a non-member (a member);
        one that adds a member (``adds``), of a segment below RF."""
        info = meta.partition(seg[0], seg[1])
        segment = info.segment(seg[2]) if info is not None else None
        if segment is None or not segment.sealed:
            self._fail(
                "C6",
                f"repair: a copy of {_seg(seg)} from node {source} to node {target} was planned while "
                "the segment is open (not sealed): a copy would chase a moving tail",
            )
        elif fill and target not in segment.ensemble:
            self._fail(
                "C6", f"repair: a fill of {_seg(seg)} targets node {target}, not a member {list(segment.ensemble)}"
            )
        elif not fill and target in segment.ensemble:
            self._fail(
                "C6", f"repair: a copy of {_seg(seg)} targets node {target}, already a member {list(segment.ensemble)}"
            )
        elif adds and len(segment.ensemble) >= self.rf:
            self._fail(
                "C6",
                f"repair: a copy of {_seg(seg)} to node {target} would add a member to "
                f"{list(segment.ensemble)}, which already has replication_factor {self.rf}",
            )

    def fail(self, check: str, message: str) -> None:
        """A violation found by the simulator itself (expansion, cuts, the pure core refusing an event)."""
        self._fail(check, message)


def _index(stream: list[Batch], offset: int) -> int:
    lo, hi = 0, len(stream)
    while lo < hi:
        mid = (lo + hi) // 2
        if stream[mid].offset < offset:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(stream) and stream[lo].offset == offset else -1
