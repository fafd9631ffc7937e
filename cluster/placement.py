"""Segment placement: which nodes form a new segment's ensemble. Pure.

A partition is a chain of segments, and each segment has an *ensemble* of
``replication_factor`` nodes, chosen when the segment opens (ARCHITECTURE.md,
"Inside a site"), or of fewer while fewer nodes are eligible, down to a floor
the caller names (``min_size``: the leader passes ``min_insync_replicas``;
``cluster/leadership.py`` says why that is safe). :func:`choose_ensemble`
makes that choice from a snapshot of the nodes (:class:`NodeLoad`), without
I/O, clocks or randomness: the node that opens the segment and the simulator
compute the same ensemble from the same input. The repair planner
(``cluster/repair.py``) uses the same preference to choose the target of a
copy.

The rules:

* **Eligible** nodes are alive, not draining (being decommissioned), not in
  ``exclude`` and hold at least ``min_free_bytes``.
* **Size.** ``size`` members when that many nodes are eligible; otherwise
  every eligible node, if they are at least ``min_size`` (``None``: ``size``,
  a whole ensemble or nothing). Fewer than ``min_size``:
  :class:`NotEnoughNodes`, which names each node left out and why. An
  ensemble is never smaller than it could be: each member beyond the floor
  is a copy that repair need not make later, and one more member that can
  be lost while the segment is written without its writes stopping.
* **The leader is a member, first.** The leader appends locally and streams to
  the others, so it must hold the segment. It must itself be eligible: a dead
  leader cannot open a segment, and a draining one would put new data on a
  node that is leaving (:class:`LeaderNotEligible`: move the leadership first).
* **Preference** among the other eligible nodes, best first:

  1. not overloaded: a node whose load is above 1.5 times the candidates'
     mean load plus one ranks after every other (below, why);
  2. most free bytes, compared in coarse buckets (below);
  3. least :attr:`NodeLoad.load`;
  4. a hash of ``(salt, node)``: crc32c, then murmur3's 32-bit finalizer.
     Python's ``hash()`` is salted per process, so two nodes would disagree;
     crc32c alone is linear, so the orders it gives for different salts are
     XOR-translates of one another and some nodes win far more ties than
     others; the finalizer makes every node about equally likely to win.
     Pass a salt per partition (:func:`partition_salt`) so that partitions
     placed from one snapshot (a topic created with many partitions) spread
     instead of all picking the same nodes;
  5. the node id, so that even a hash collision leaves one order.

  The non-leader members come in that order after the leader.
* **Not the previous ensemble only.** When an eligible non-leader node outside
  ``previous`` exists and the preference picked every non-leader member from
  ``previous``, the lowest-ranked pick is swapped for the best-ranked node
  outside ``previous``. So a node that has just joined holds no segment and
  appears in no ``previous``; at the next roll of any partition where it is
  the only eligible node outside ``previous``, it is chosen; where there are
  others, it ranks first among them whenever its disk is the emptiest (the
  common case for a new node) and otherwise wins the hash tie for a share of
  the partitions. It takes new segments at once, with zero bytes of old data
  moved. (With ``size == 1`` and a leader there is no non-leader member, and
  the rule has nothing to act on.) Only one member is swapped, because a
  segment's data starts empty: keeping the other members costs nothing, and
  the preference already spreads them.

Why free bytes are compared in buckets: free bytes change with every write,
so an exact comparison would reorder nodes (and reshuffle ensembles) at
nearly every roll, and the load and the hash, which are what spread segments
over nodes with similar disks, would never be consulted. A node's bucket is
how far its free space is behind the emptiest candidate's, in steps of an
eighth of the emptiest candidate's free space, and at least 1 GiB
(:data:`FREE_BUCKETS`, :data:`FREE_BUCKET_BYTES_MIN`):
``(largest - free_bytes) // width``. A fraction scales with the disks: on
10 TB disks a fixed 1 GiB would be ten thousand buckets, crossed every few
seconds of writes, while an eighth lets disks within about 12% of each other
compare equal and still tells apart a node that is markedly fuller (or a new,
empty one). Counting from the emptiest node rather than from zero matters:
with the width an eighth of the largest free space, a grid from zero has a
line right at the emptiest node, which would sit alone in the top bucket
(``800 // 100 = 8``, ``799 // 100 = 7``) and draw every new segment until
some other node became the emptiest. Counted from the emptiest node, nodes
with similar free space all sit in bucket 0, and a node changes bucket only
when it falls an eighth of a disk behind. The 1 GiB floor keeps small (test, development) disks from being
split into byte-sized buckets.

Why the overload guard: free bytes come first, so without it a node much
emptier than the rest (a node that has just joined) would be in every new
ensemble until it had caught up, taking all of the site's write traffic.
With it, such a node holds at most about 1.5 times its share of the open
segments: it still fills faster than the others, in proportion to its free
space, but no node is a hot spot. The guard uses the mean over the
candidates, so it needs no configuration.

Why the result has ``min(size, eligible)`` distinct eligible nodes, at least
``min_size``, with the leader first: node ids are checked unique; the leader
is taken out of the candidates before they are ranked; the non-leader members
are the first ``need = min(size, eligible) - 1`` (or ``min(size, eligible)``
without a leader) ranked candidates, and the swap above replaces one of them
with a candidate from beyond that prefix, so no node appears twice (when every
candidate is chosen there is nothing beyond the prefix, and no swap). Every
candidate passed the eligibility filter, and ``eligible >= min_size`` was
checked before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import crc32c

from topology.ids import NodeId

FREE_BUCKETS = 8  # free bytes are compared in steps of 1/8 of the largest free space
FREE_BUCKET_BYTES_MIN = 1 << 30  # ... and never in steps below 1 GiB


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What placement knows of one node, from the site's metadata.

    ``load`` is a count of the streams being written to the node: the open
    segments whose ensemble it is in, plus the repair copies it is receiving.
    Both are in the replicated metadata, so every node computes the same
    value and the same placement. A bytes/s figure is left out on purpose: it
    changes with every sample, like free bytes, and would reshuffle ensembles;
    the open segments are where the bytes/s come from anyway.
    """

    node: NodeId
    free_bytes: int
    load: int
    alive: bool
    draining: bool  # being decommissioned: keeps serving what it holds, takes nothing new


class PlacementError(Exception):
    """Base of the errors :func:`choose_ensemble` raises; each message says what to do."""


class InvalidPlacementRequest(PlacementError, ValueError):
    """The request makes no sense (a caller bug): bad size, duplicate or negative figures, unknown leader."""


class LeaderNotEligible(PlacementError):
    """The leader is dead, draining or out of space, so it cannot be a member of a new segment."""

    def __init__(self, leader: NodeId, why: str) -> None:
        self.leader = leader
        super().__init__(
            f"leader node {leader} is {why} and cannot open a segment: move the partition's leadership to an "
            "alive node that is not draining and has space, then roll"
        )


class NotEnoughNodes(PlacementError):
    """Fewer eligible nodes than the ensemble needs (``needed``: its floor; ``wanted``: its full size)."""

    def __init__(
        self,
        needed: int,
        eligible: Sequence[NodeId],
        dead: Sequence[NodeId],
        draining: Sequence[NodeId],
        excluded: Sequence[NodeId],
        full: Sequence[NodeId],
        min_free_bytes: int,
        wanted: int | None = None,
        by_quorum: bool = False,  # ``needed`` is the ack quorum (``min_size``), not the whole ensemble
    ) -> None:
        self.needed = needed
        self.wanted = needed if wanted is None else wanted
        self.eligible = tuple(eligible)
        self.dead = tuple(dead)
        self.draining = tuple(draining)
        self.excluded = tuple(excluded)
        self.full = tuple(full)
        reasons = [
            f"{_nodes(nodes)} {what}"
            for nodes, what in (
                (self.dead, "dead"),
                (self.draining, "draining"),
                (self.excluded, "excluded"),
                (self.full, f"below {min_free_bytes} free bytes"),
            )
            if nodes
        ]
        why = "; not eligible: " + ", ".join(reasons) if reasons else ""
        if self.wanted > needed:
            need = f"need at least {needed} eligible node(s) (an ensemble of {needed} to {self.wanted})"
        else:
            need = f"need {needed} eligible node(s)"
        lower = "the topic's replication_factor"
        if self.wanted > needed or by_quorum:
            lower = "min_insync_replicas (the topic's, else the site's: the smallest ensemble a segment opens on)"
        super().__init__(
            f"{need}, have {len(self.eligible)} ({_nodes(self.eligible) or 'none'}){why}. "
            f"Add nodes (or bring the dead ones back, or free disk space), or lower {lower}"
        )


def _nodes(nodes: Sequence[NodeId]) -> str:
    return ", ".join(f"node {n}" for n in nodes)


def _fmix32(h: int) -> int:
    """murmur3's finalizer: every input bit affects every output bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def tiebreak(salt: int, node: NodeId) -> int:
    """The last preference before the node id: the same on every process, different per salt."""
    return _fmix32(int(crc32c.crc32c(f"{salt}/{node}".encode())))


def partition_salt(topic: str, partition: int) -> int:
    """The salt to pass for a partition's segments: stable across processes and releases."""
    return int(crc32c.crc32c(f"{topic}/{partition}".encode()))


def rank(nodes: Iterable[NodeLoad], salt: int) -> list[NodeLoad]:
    """``nodes`` best first by the placement preference (overload, free bytes bucket, load, hash, id)."""
    candidates = list(nodes)
    if not candidates:
        return []
    largest = max(n.free_bytes for n in candidates)
    width = max(FREE_BUCKET_BYTES_MIN, largest // FREE_BUCKETS)
    count = len(candidates)
    total_load = sum(n.load for n in candidates)

    def key(n: NodeLoad) -> tuple[bool, int, int, int, NodeId]:
        overloaded = 2 * count * n.load > 3 * total_load + 2 * count  # load > 1.5 * mean + 1
        return (overloaded, (largest - n.free_bytes) // width, n.load, tiebreak(salt, n.node), n.node)

    return sorted(candidates, key=key)


def index_nodes(nodes: Iterable[NodeLoad]) -> dict[NodeId, NodeLoad]:
    """The nodes by id, refusing duplicate ids and negative figures."""
    by_id: dict[NodeId, NodeLoad] = {}
    for n in nodes:
        if n.node in by_id:
            raise InvalidPlacementRequest(f"node {n.node} appears twice in the node table: pass each node once")
        if n.free_bytes < 0 or n.load < 0:
            raise InvalidPlacementRequest(
                f"node {n.node} reports free_bytes={n.free_bytes} load={n.load}: both must be >= 0"
            )
        by_id[n.node] = n
    return by_id


def choose_ensemble(
    nodes: Iterable[NodeLoad],
    size: int,
    *,
    leader: NodeId | None,
    previous: Sequence[NodeId] = (),
    exclude: Iterable[NodeId] = (),
    salt: int = 0,
    min_free_bytes: int = 0,
    min_size: int | None = None,
) -> tuple[NodeId, ...]:
    """``size`` distinct eligible nodes (or every eligible node, if fewer but at least ``min_size``), ``leader``
    first when given; see the module docstring for the rules.

    ``previous`` is the ensemble of the segment this one follows (empty for a
    partition's first segment). ``exclude`` lists nodes that must not be
    chosen. ``min_free_bytes`` is the space a member needs (the segment size
    limit when opening, the segment's size when copying). ``min_size`` is the
    smallest ensemble the caller accepts (None: ``size``).
    """
    if size < 1:
        raise InvalidPlacementRequest(
            f"ensemble size {size}: a segment needs at least one node (replication_factor >= 1)"
        )
    floor = size if min_size is None else min_size
    if not 1 <= floor <= size:
        raise InvalidPlacementRequest(
            f"min_size {min_size} is not between 1 and the ensemble size {size}: set min_insync_replicas to at "
            "least 1 and at most replication_factor"
        )
    if min_free_bytes < 0:
        raise InvalidPlacementRequest(f"min_free_bytes={min_free_bytes}: must be >= 0")
    by_id = index_nodes(nodes)
    excluded = set(exclude)
    fixed: tuple[NodeId, ...] = ()
    if leader is not None:
        if leader not in by_id:
            raise InvalidPlacementRequest(f"leader node {leader} is not in the node table: pass every node of the site")
        if leader in excluded:
            raise InvalidPlacementRequest(f"leader node {leader} is excluded, but the leader must be a member")
        n = by_id[leader]
        if not n.alive:
            raise LeaderNotEligible(leader, "dead")
        if n.draining:
            raise LeaderNotEligible(leader, "draining")
        if n.free_bytes < min_free_bytes:
            raise LeaderNotEligible(leader, f"short of space ({n.free_bytes} free bytes, {min_free_bytes} needed)")
        fixed = (leader,)
    dead: list[NodeId] = []
    draining: list[NodeId] = []
    out: list[NodeId] = []
    full: list[NodeId] = []
    candidates: list[NodeLoad] = []
    for node_id in sorted(by_id):
        n = by_id[node_id]
        if node_id == leader:
            continue
        if not n.alive:
            dead.append(node_id)
        elif n.draining:
            draining.append(node_id)
        elif node_id in excluded:
            out.append(node_id)
        elif n.free_bytes < min_free_bytes:
            full.append(node_id)
        else:
            candidates.append(n)
    if len(fixed) + len(candidates) < floor:
        eligible = list(fixed) + [c.node for c in candidates]
        raise NotEnoughNodes(floor, eligible, dead, draining, out, full, min_free_bytes, size, min_size is not None)
    need = min(size, len(fixed) + len(candidates)) - len(fixed)
    ranked = rank(candidates, salt)
    chosen = ranked[:need]
    before = set(previous)
    if chosen and all(c.node in before for c in chosen):
        outsider = next((c for c in ranked[need:] if c.node not in before), None)
        if outsider is not None:
            chosen[-1] = outsider
    return fixed + tuple(c.node for c in chosen)
