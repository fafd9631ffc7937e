"""Recovery of a partition's open segment after its leader dies. Pure.

A partition is a chain of segments (ARCHITECTURE.md, "Inside a site"). The
open segment has one *writer*: the leader that opened it. It appends every
batch locally and streams it, in offset order, to every other member of the
segment's ensemble of ``E`` nodes; a batch is *acked* once ``AQ``
(``min_insync_replicas``) members hold it fsynced, the LAC is the highest such
end, and nobody reads beyond the LAC. When the writer dies, the metadata bumps
the partition's leader epoch and names a new leader from the ensemble. That
leader runs one :class:`SegmentRecovery` for the open segment, like
BookKeeper's ledger recovery, and :func:`cut_after_seal` tells each member what
to drop once the segment is sealed.

The rules (``need = E - AQ + 1``, offsets are local offsets, an *end* is
exclusive: a member whose end is ``x`` holds ``[base_offset, x)``):

1. **Fence.** :meth:`SegmentRecovery.start` fences every member, this node
   included. A member answers :meth:`~SegmentRecovery.fenced` with its end
   (an end below ``base_offset`` is refused with :class:`InvalidRecoveryEvent`:
   that member answered for another segment). A member fenced by a newer
   epoch answers :meth:`~SegmentRecovery.fence_refused`: a newer leader
   exists, the recovery stops with :class:`Superseded`.
2. **Decide** once ``need`` members answered, this node among them: the
   *recovered end* is the MAX end among the answers (the *fence quorum*). A
   member that answers later with less gets a copy; one that answers later
   with more holds the recovered end as a prefix (it counts as a holder, and
   cuts its tail after the seal). If fewer than ``need`` members can still
   answer, the recovery stops with :class:`Failed`: the segment cannot be
   recovered safely until a member comes back. So does it when this node is
   reported unreachable before the seal: it cannot lead without its copy.
3. **Copy** the missing tail ``[member end, recovered end)`` to every
   answering member that lacks it, from a member that holds it (this node
   first: a local read; then the lowest node id). A failed copy is tried
   again from another holder, each holder at most once per target. A member
   reported :meth:`~SegmentRecovery.unreachable` is neither a source nor a
   target from then on (what it answered still counts: its disk keeps it).
4. **Seal** once at least ``AQ`` members hold the recovered end, this node
   among them: one :class:`Seal` (a Raft command). Copies still in flight are
   harmless. If fewer than ``AQ`` members can ever hold it, or this node
   cannot, :class:`Failed`.
5. **Done** when the seal is committed; :class:`Superseded` when it is
   refused (the metadata changed under us: a newer epoch, or already sealed).
   Each recovery ends with exactly one of :class:`Done`, :class:`Failed` and
   :class:`Superseded`; answers that arrive after it are ignored.
6. **Cut** only after the seal is committed: a member holding more than the
   sealed end truncates to it (:func:`cut_after_seal`).

What the shell guarantees (the node and the simulator do the I/O):

* ``Fence(node, epoch)``: the member durably records ``epoch`` if it is newer
  than its own, fsyncs what it holds, refuses from then on any append of an
  older epoch, and answers ``fenced(node, its end)``. A member fenced by a
  newer epoch answers ``fence_refused(node, that epoch)``. No answer:
  ``unreachable(node)``.
* ``Copy(source, target, start, end)``: ``target`` accepts it only from an
  epoch at least its own (else ``fence_refused``), appends ``source``'s
  bytes from its own end to ``end`` (``start`` is its end as last reported; a
  target that already holds more, from an earlier copy that got partway,
  skips those bytes: they are the same, by (P) below), fsyncs, and answers
  ``copied(target, end)``; any failure answers ``copy_failed(target, why)``.
  Every ``Copy`` gets exactly one answer.
* ``Seal(segment, end)``: one Raft command that commits only if the
  partition's leader epoch is still this recovery's and the segment is still
  open; ``seal_committed(end)`` or ``seal_refused(why)``.
* A new leader reads the segment's state from the metadata that names it
  leader. If the segment is already sealed, it runs no recovery: the members
  only cut. After ``Done(end)`` the shell tells the members (they cut), opens
  the next segment at base ``end`` with a new ensemble, and continues the
  partition's origin seqs after the last batch below ``end``. A member that
  has learned the seal refuses every later append or copy to the segment (a
  copy of an older, aborted recovery may still be on its way).

Why this is safe. Let ``W`` be the writer's stream: the batches it appended,
in offset order. Only the writer creates bytes; it writes only under its
epoch, lower than every recovery's.

(P) *Every member's copy is a prefix of W, at all times.* The writer
appends to a member only contiguously. A copy makes the target hold a
prefix of the source's copy, and both are prefixes of ``W``. A cut shortens
a prefix. So two members never hold different bytes at the same offset, and
copies, retries and partial copies, of any recovery, change nothing but how
long a member's prefix is.

(A) *Every acked batch is below the recovered end.* A batch ending at ``o``
is acked only once ``AQ`` members held ``[base, o)`` fsynced, each before it
was fenced (a fenced member refuses the writer). Nothing is cut before the
seal, so each of them answers any fence with an end ``>= o``. The fence
quorum has ``need = E - AQ + 1`` members, and ``need + AQ = E + 1 > E``: by
pigeonhole one of them acked ``o``, and the max is ``>= o``. No batch
becomes acked after the decision either: the fence quorum refuses the
writer, which can reach at most ``E - need = AQ - 1`` members, one short of
an ack. So the recovered end is at or above every ack, past and future.

(V) *Visible data survives.* Readers, consumers, cross-site pulls and
``acks=all`` releases see only offsets below the LAC, an acked end, so
below the recovered end, which is the sealed end. Bytes are only ever
removed above the sealed end. Nothing anyone saw is lost or changed.

(B) *The seal invents nothing.* The recovered end is the end one member
reported holding, and copies only spread what a holder has.

(S) *Sealed only once AQ members and this node hold the end.* Once sealed,
the segment is readable to its end: the seal acks everything in it, so it
must survive what ``acks=all`` survives (I6), which takes ``AQ`` fsynced
copies. This node must hold it because it continues the origin seqs from
there (I1, I3: no gap, no reuse). Sealing before would expose offsets that
one lost disk could take away, and hand out origin seqs after a gap.

(I) *Interrupted recoveries compose.* A recovery acts on the world only by
fencing (members refuse the writer sooner), copying (by (P), it only
lengthens prefixes of ``W``, so the premises of (A) hold for any later
recovery), and one conditional seal. Raft orders each seal against the epoch
bumps: a seal committed before the bump to a newer epoch is seen by that
epoch's leader, which then does not recover; a seal asked after the bump is
refused. So at most one seal ever commits. The recovery that asked for it
had ``AQ`` holders, and they still hold it at commit, since nothing is cut
before a commit. A later recovery may choose a larger end than an aborted
one (it heard a member the first did not): nothing was sealed, and any end
between every ack and ``len(W)`` is a valid end. The same epoch may start
over after :class:`Failed`.

(C) *Why a member cuts only after the seal commits.* Until then the end is
not final: a newer recovery may choose a larger end and count this member's
tail as one of its ``AQ`` copies. A member that cut to an end some aborted
recovery chose would break (S) for the seal that does commit. Once a seal
is committed it is final (I); every byte above it was never acked (A) nor
seen (V); and it must go, because the next segment starts at the sealed end
and gives those offsets new, different batches. Only a member outside the
fence quorum can hold more than the sealed end: the quorum's ends are at
most their max.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from offsets.coordinates import LocalOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId, node_id


class InvalidRecovery(ValueError):
    """The parameters of a recovery (or of a cut) cannot describe a real segment."""


class InvalidRecoveryEvent(ValueError):
    """An event that no correct member or shell sends. The recovery's state is unchanged.

    The shell logs it and may go on, for example by reporting the member
    :meth:`SegmentRecovery.unreachable`.
    """


# --- effects -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fence:
    """Fence ``node``'s copy of the segment with ``epoch``; it answers with its end."""

    node: NodeId
    epoch: LeaderEpoch


@dataclass(frozen=True, slots=True)
class Copy:
    """Make ``target`` hold ``[base, end_offset)`` by appending ``source``'s bytes from ``start_offset``."""

    source: NodeId
    target: NodeId
    start_offset: LocalOffset
    end_offset: LocalOffset


@dataclass(frozen=True, slots=True)
class Seal:
    """Seal the segment at ``end_offset`` in the metadata (one conditional Raft command)."""

    segment_id: SegmentId
    end_offset: LocalOffset


@dataclass(frozen=True, slots=True)
class Done:
    """The seal is committed: open the next segment at ``end_offset``."""

    end_offset: LocalOffset


@dataclass(frozen=True, slots=True)
class Failed:
    """The segment cannot be recovered safely now; ``reason`` says what to bring back."""

    reason: str


@dataclass(frozen=True, slots=True)
class Superseded:
    """A newer leader exists (``their_epoch``), or the metadata changed under us: step down."""

    reason: str
    their_epoch: LeaderEpoch | None = None


Effect = Fence | Copy | Seal | Done | Failed | Superseded


class Phase(Enum):
    """Where a recovery is; the last three are final."""

    NEW = "new"  # start() not called yet
    FENCING = "fencing"  # waiting for E - AQ + 1 answers, this node's among them
    COPYING = "copying"  # the end is decided; waiting for AQ holders, this node among them
    SEALING = "sealing"  # Seal asked; waiting for the metadata
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"


TERMINAL = frozenset({Phase.DONE, Phase.FAILED, Phase.SUPERSEDED})


@dataclass(slots=True)
class _Member:
    end: int | None = None  # known fsynced end: the fence answer, raised by copies; None before the answer
    answered_end: int | None = None  # the fence answer itself, to tell a repeat from a contradiction
    reachable: bool = True  # False once reported unreachable (until it answers a fence after all)
    copy: Copy | None = None  # the copy in flight to this member
    tried: set[NodeId] = field(default_factory=set)  # sources already tried for copies to this member


def cut_after_seal(local_end: int, sealed_end: int) -> LocalOffset | None:
    """The end a member must truncate its copy to once the seal at ``sealed_end`` is committed, or None.

    Only a member holding more than the sealed end cuts. One that holds less
    keeps its prefix (the repair planner re-replicates the sealed segment).
    Call it only with a *committed* seal: see (C) in the module docstring.
    """
    if local_end < 0 or sealed_end < 0:
        raise InvalidRecovery(f"offsets are never negative: local end {local_end}, sealed end {sealed_end}")
    return LocalOffset(sealed_end) if local_end > sealed_end else None


def recovered_end(fenced_ends: Sequence[int]) -> int:
    """Where the segment is sealed: the largest end among the fence quorum's answers (see the module docstring:
    E - AQ + 1 answers include a holder of every acked batch, and the max invents nothing)."""
    return max(fenced_ends)


class SegmentRecovery:
    """The new leader's recovery of one open segment; see the module docstring for the rules."""

    def __init__(
        self,
        segment_id: SegmentId,
        base_offset: int,
        ensemble: Sequence[NodeId],
        ack_quorum: int,
        epoch: LeaderEpoch,
        self_node: NodeId,
    ) -> None:
        if segment_id < 0:
            raise InvalidRecovery(f"invalid segment id {segment_id}: segments are numbered 0, 1, 2, ...")
        if base_offset < 0:
            raise InvalidRecovery(f"invalid base offset {base_offset} of segment {segment_id}: offsets start at 0")
        if not ensemble:
            raise InvalidRecovery(f"segment {segment_id} has an empty ensemble: read it again from the metadata")
        nodes = [node_id(n) for n in ensemble]
        if len(set(nodes)) != len(nodes):
            raise InvalidRecovery(f"segment {segment_id}'s ensemble {nodes} names a node twice")
        if not 1 <= ack_quorum <= len(nodes):
            raise InvalidRecovery(
                f"ack quorum {ack_quorum} of segment {segment_id} must be 1 to {len(nodes)} (its ensemble's size): "
                "check min_insync_replicas against replication_factor"
            )
        if epoch < 1:
            raise InvalidRecovery(f"recovery epoch {epoch} must be at least 1: a recovery follows an epoch bump")
        if self_node not in nodes:
            raise InvalidRecovery(
                f"node {self_node} is not in segment {segment_id}'s ensemble {nodes}: "
                "only a member can recover it (the metadata names the new leader from the ensemble)"
            )
        self.segment_id = segment_id
        self.base_offset = base_offset
        self.ensemble: tuple[NodeId, ...] = tuple(nodes)
        self.ack_quorum = ack_quorum
        self.epoch = epoch
        self.self_node = self_node
        self.need = len(nodes) - ack_quorum + 1  # fence answers that must be in before the end is decided
        self._phase = Phase.NEW
        self._members: dict[NodeId, _Member] = {n: _Member() for n in nodes}
        self._end: int | None = None
        self._quorum: tuple[NodeId, ...] = ()

    # -- queries ------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def recovered_end(self) -> LocalOffset | None:
        """The end the segment will be sealed at; None until decided."""
        return None if self._end is None else LocalOffset(self._end)

    @property
    def fence_quorum(self) -> tuple[NodeId, ...]:
        """The members whose answers decided the recovered end, sorted; empty until decided."""
        return self._quorum

    def holders(self) -> tuple[NodeId, ...]:
        """The members known to hold the recovered end fsynced, sorted; empty until decided."""
        end = self._end
        if end is None:
            return ()
        return tuple(n for n in sorted(self._members) if (e := self._members[n].end) is not None and e >= end)

    # -- events -------------------------------------------------------------------

    def start(self) -> list[Effect]:
        """Fence every member, this node included."""
        if self._phase is not Phase.NEW:
            raise InvalidRecoveryEvent(f"recovery of segment {self.segment_id} was already started")
        self._phase = Phase.FENCING
        return [Fence(n, self.epoch) for n in self.ensemble]

    def fenced(self, node: NodeId, end_offset: int) -> list[Effect]:
        """``node`` is fenced with this epoch and holds ``[base_offset, end_offset)`` fsynced."""
        m = self._member(node, "fenced")
        if end_offset < self.base_offset:
            raise InvalidRecoveryEvent(
                f"node {node} answered the fence of segment {self.segment_id} with end {end_offset}, below the "
                f"segment's base offset {self.base_offset}: it answered for another segment. Report it unreachable "
                "and check its copy of the segment"
            )
        if m.answered_end is not None:
            # A repeated answer (the shell retried the fence): the end may only have grown by our copies since.
            grown_to = m.answered_end if self._end is None else max(self._end, m.answered_end)
            if m.answered_end <= end_offset <= grown_to:
                return []
            raise InvalidRecoveryEvent(
                f"node {node} answered the fence of segment {self.segment_id} twice, with ends {m.answered_end} "
                f"and {end_offset}: a fenced member's end moves only by this recovery's copies. Did it lose "
                "fsynced data, or is another writer appending to it?"
            )
        if self._phase in TERMINAL:
            return []
        m.answered_end = m.end = end_offset
        m.reachable = True
        if self._phase is Phase.FENCING:
            return self._fencing_progress()
        if self._phase is Phase.COPYING:
            assert self._end is not None
            out: list[Effect] = []
            if end_offset < self._end:
                copy = self._plan_copy(node)
                if copy is not None:
                    out.append(copy)
            return out + self._copying_progress()
        return []  # sealing: enough members hold the end already

    def fence_refused(self, node: NodeId, their_epoch: int) -> list[Effect]:
        """``node`` is fenced by a newer epoch (answering a fence or a copy): a newer leader exists."""
        self._member(node, "fence_refused")
        if their_epoch <= self.epoch:
            raise InvalidRecoveryEvent(
                f"node {node} refused epoch {self.epoch} for epoch {their_epoch}: a member refuses only older "
                "epochs than its own"
            )
        if self._phase in TERMINAL:
            return []
        self._phase = Phase.SUPERSEDED
        return [
            Superseded(
                f"node {node} of segment {self.segment_id} is fenced by epoch {their_epoch}, newer than this "
                f"recovery's {self.epoch}: a newer leader recovers the partition; step down",
                LeaderEpoch(their_epoch),
            )
        ]

    def unreachable(self, node: NodeId) -> list[Effect]:
        """The shell gave up on ``node`` for this recovery: it is neither a source nor a target from now on."""
        m = self._member(node, "unreachable")
        if self._phase in TERMINAL:
            return []
        m.reachable = False
        if node == self.self_node and self._phase in (Phase.FENCING, Phase.COPYING):
            return self._self_lost()
        if self._phase is Phase.FENCING:
            return self._fencing_progress()
        if self._phase is Phase.COPYING:
            return self._copying_progress()
        return []  # sealing: the metadata decides now

    def copied(self, node: NodeId, end_offset: int) -> list[Effect]:
        """The copy to ``node`` is fsynced: it holds ``[base_offset, end_offset)``."""
        m = self._member(node, "copied")
        if m.copy is None:
            if self._phase in TERMINAL:
                return []
            raise InvalidRecoveryEvent(f"node {node} reported a copy, but no copy to it is in flight")
        if end_offset != m.copy.end_offset:
            raise InvalidRecoveryEvent(
                f"node {node} reported a copy to {end_offset}, but the copy in flight ends at {m.copy.end_offset}"
            )
        m.copy = None
        m.end = max(m.end or 0, end_offset)
        return self._copying_progress() if self._phase is Phase.COPYING else []

    def copy_failed(self, node: NodeId, reason: str) -> list[Effect]:
        """The copy to ``node`` failed (its source or itself): try another source, or give it up."""
        m = self._member(node, "copy_failed")
        if m.copy is None:
            if self._phase in TERMINAL:
                return []
            raise InvalidRecoveryEvent(f"a copy to node {node} failed ({reason}), but no copy to it is in flight")
        m.copy = None
        if self._phase is not Phase.COPYING:
            return []
        out: list[Effect] = []
        copy = self._plan_copy(node)
        if copy is not None:
            out.append(copy)
        return out + self._copying_progress()

    def seal_committed(self, end_offset: int) -> list[Effect]:
        """The metadata sealed the segment at ``end_offset``."""
        if self._phase in TERMINAL:
            return []
        if self._phase is not Phase.SEALING:
            raise InvalidRecoveryEvent(f"segment {self.segment_id} was sealed, but this recovery asked no seal")
        if end_offset != self._end:
            raise InvalidRecoveryEvent(
                f"segment {self.segment_id} was sealed at {end_offset}, but this recovery asked {self._end}"
            )
        self._phase = Phase.DONE
        return [Done(LocalOffset(end_offset))]

    def seal_refused(self, reason: str) -> list[Effect]:
        """The metadata refused the seal: a newer epoch, or the segment is no longer open."""
        if self._phase in TERMINAL:
            return []
        if self._phase is not Phase.SEALING:
            raise InvalidRecoveryEvent(f"a seal of segment {self.segment_id} was refused, but none was asked")
        self._phase = Phase.SUPERSEDED
        return [
            Superseded(
                f"the metadata refused to seal segment {self.segment_id} at {self._end} ({reason}): re-read the "
                "partition's metadata; if this node still leads and the segment is open, recover it again"
            )
        ]

    # -- internals ------------------------------------------------------------------

    def _member(self, node: NodeId, event: str) -> _Member:
        if self._phase is Phase.NEW:
            raise InvalidRecoveryEvent(f"{event}({node}) before start(): call start() and carry out its fences")
        m = self._members.get(node)
        if m is None:
            raise InvalidRecoveryEvent(
                f"{event}: node {node} is not in segment {self.segment_id}'s ensemble {list(self.ensemble)}"
            )
        return m

    def _fail(self, reason: str) -> list[Effect]:
        self._phase = Phase.FAILED
        return [Failed(reason)]

    def _unreachable_names(self) -> str:
        lost = [n for n in self.ensemble if not self._members[n].reachable]
        return ", ".join(str(n) for n in lost) if lost else "none reported yet"

    def _self_lost(self) -> list[Effect]:
        return self._fail(
            f"this node ({self.self_node}) cannot use its own copy of segment {self.segment_id}: it cannot "
            "lead the partition; let another member of the ensemble lead"
        )

    def _fencing_progress(self) -> list[Effect]:
        members = self._members
        me = members[self.self_node]
        answered = [n for n in self.ensemble if members[n].end is not None]
        if len(answered) >= self.need and me.end is not None:
            return self._decide(answered)
        pending = [n for n in self.ensemble if members[n].end is None and members[n].reachable]
        if len(answered) + len(pending) < self.need:
            return self._fail(
                f"segment {self.segment_id} cannot be recovered safely: {len(answered) + len(pending)} of "
                f"{len(self.ensemble)} members can answer its fence, and {self.need} must (replication_factor - "
                f"min_insync_replicas + 1), or a batch acked by {self.ack_quorum} members could be lost. Bring a "
                f"member back (unreachable: {self._unreachable_names()}) and recover again"
            )
        return []

    def _decide(self, answered: list[NodeId]) -> list[Effect]:
        members = self._members
        end = recovered_end([e for n in answered if (e := members[n].end) is not None])
        self._end = end
        self._quorum = tuple(sorted(answered))
        self._phase = Phase.COPYING
        out: list[Effect] = []
        for n in self.ensemble:
            e = members[n].end
            if e is not None and e < end and members[n].reachable:
                copy = self._plan_copy(n)
                if copy is not None:
                    out.append(copy)
        return out + self._copying_progress()

    def _plan_copy(self, target: NodeId) -> Copy | None:
        """A copy of the missing tail to ``target`` from a holder not tried for it yet; None gives it up."""
        end = self._end
        m = self._members[target]
        assert end is not None and m.end is not None and m.copy is None
        if m.reachable:
            sources = [
                n
                for n in sorted(self._members, key=lambda n: (n != self.self_node, n))
                if n != target
                and n not in m.tried
                and self._members[n].reachable
                and (e := self._members[n].end) is not None
                and e >= end
            ]
            if sources:
                m.tried.add(sources[0])
                m.copy = Copy(sources[0], target, LocalOffset(m.end), LocalOffset(end))
                return m.copy
        return None

    def _copying_progress(self) -> list[Effect]:
        end = self._end
        assert end is not None
        members = self._members
        holders = self.holders()
        if self.self_node in holders and len(holders) >= self.ack_quorum:
            self._phase = Phase.SEALING
            return [Seal(self.segment_id, LocalOffset(end))]
        # Who may still come to hold the end: holders, copies in flight, members yet to answer the fence.
        able = [
            n
            for n in self.ensemble
            if n in holders or members[n].copy is not None or (members[n].end is None and members[n].reachable)
        ]
        if self.self_node not in able:
            return self._fail(
                f"this node ({self.self_node}) cannot get the recovered end {end} of segment {self.segment_id}: "
                f"no reachable member that holds it could copy it here. Bring a member back (unreachable: "
                f"{self._unreachable_names()}) and recover again, or let a member that holds it lead"
            )
        if len(able) < self.ack_quorum:
            return self._fail(
                f"segment {self.segment_id} cannot be sealed safely at {end}: only {len(able)} members can hold it, "
                f"and {self.ack_quorum} (min_insync_replicas) must. Bring a member back (unreachable: "
                f"{self._unreachable_names()}) and recover again"
            )
        return []
