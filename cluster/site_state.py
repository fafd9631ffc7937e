"""The site's metadata as a replicated state machine. Pure.

Every node of a site (ARCHITECTURE.md, "Inside a site: the segment cluster")
keeps a copy of :class:`SiteState`, and Raft (``georep/raft/store.py``) hands
every copy the same commands in the same order. The state holds:

* the topics (:class:`~georep.metadata.topics.TopicSpec`);
* per partition (:class:`PartitionInfo`): the leader node, the leader epoch,
  and the chain of segments (:class:`SegmentInfo`: id, base offset, ensemble,
  the epoch that opened it, open or sealed, and once sealed its end offset and
  end vector);
* the nodes (:class:`NodeInfo`): address, last heartbeat, free bytes, load,
  draining flag;
* the ACL records (:class:`~georep.metadata.store.AclRecord`, ``georep/auth/acl.py``): :class:`PutAcl` keeps a
  record only if it is newer than the one held for its entry (last-writer-wins, ``georep/auth/acl_sync.py``),
  so an operator's change and the same change replicated from another site commute.

It changes per segment roll, per leader change and per node heartbeat, never
per write, so Raft's latency stays off the data path.

**Commands** are frozen dataclasses. They travel through the Raft log as
JSON-shaped dicts, ``{"v": 1, "kind": "open_segment", ...}``
(``to_dict`` / :func:`command_from_dict`), never as pickled classes, so the
log does not depend on this module's class layout. A command whose fields
make no sense whatever the state (an empty ensemble, a negative offset) cannot
be built: its constructor raises :class:`InvalidCommand` (or
:class:`~georep.metadata.topics.InvalidTopic`), so it is never proposed.

**Results are values.** :meth:`SiteState.apply` never raises. A command the
current state does not allow (an epoch that is no longer current, a topic that
exists) returns :class:`Refused`, with a :class:`RefusalCode` and a message
that says what to do, and changes nothing; otherwise it returns
:class:`Applied`. An exception would be fatal twice over: replay must reach the
same state on every node, and pysyncobj retries an entry whose apply raised on
every tick, so the replica would stop at that entry for good.

**Determinism.** No clock, no randomness, no iteration over sets or over
unsorted keys where order shows: time enters only as ``now_ms`` inside
commands (the proposer's clock), so replaying one log gives one state, on any
node, at any time. :meth:`SiteState.snapshot` is a plain, sorted dict;
:meth:`SiteState.restore` reads it back.

**The rules**, each enforced by :meth:`SiteState.apply`:

* Leader epochs are a compare-and-set. :class:`ElectLeader` applies only if
  its ``expected_epoch`` is the partition's current epoch, and bumps it by
  one. So two controllers that plan from the same state cannot both win, each
  epoch has at most one leader, and epochs only increase. Re-electing the same
  node also bumps the epoch (a restarted leader must fence its old self).
* :class:`FailOver` moves every partition a dead node leads at once, by the
  plan of ``cluster/failover.py`` that each replica runs as it applies it
  (deterministic: the state and the command's ``now_ms`` only), if the node's
  last heartbeat is still the one the controller saw and it is not live at
  ``now_ms``; each moved partition's epoch goes up by one, as an election's.
* While a segment is open, the leader comes from its ensemble (see
  :func:`plan_leadership` for why). A segment is opened by the leader of the
  current epoch, with itself first in the ensemble (it appends locally and
  streams to the others; ``cluster/placement.py`` puts it first).
* The chain is contiguous: at most one segment is open, and it is the last;
  a new segment opens only when there is none or the last one is sealed, at
  the sealed end (the first at offset 0); ids go 0, 1, 2, ...
* Sealing is for the current epoch only (the new leader seals its
  predecessor's segment after recovery; a deposed leader is refused). Sealing
  again at the same end is a no-op, so a retry is safe; at another end it is
  refused: a sealed segment never changes its end. End offsets are exclusive
  (the next segment's base), and a segment's end vector covers at least what
  the previous one's does: origin seqs never go back.
* :class:`ReplaceMember` repairs sealed segments only (an open segment is
  rolled by its leader instead), and is a compare-and-set on the old member.
* :class:`TrimChain` (retention, ``cluster/retention.py``) drops a prefix of sealed segments: the chain's start
  only moves forward, its last segment always stays, and the dropped segments' end vector becomes the chain's
  ``start_vector``.
* :class:`AddMember` widens a sealed segment that opened on fewer than
  ``replication_factor`` live nodes (``cluster/leadership.py``), once a repair
  copied it to one more: sealed segments only, like a replacement, and only
  while the ensemble is below the replication factor the command names, so
  two repairs planned from one view cannot push it past that.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self, TypeVar

from cluster.failover import failover_blocker, plan_failover
from cluster.producer_snapshot import InvalidSnapshot as InvalidProducerSnapshot
from cluster.producer_snapshot import ProducerSnapshot
from georep.metadata.store import AclRecord, acl_newer
from georep.metadata.topic_entry import TopicEntry, merge
from georep.metadata.topic_entry_codec import entry_from_dict, entry_to_dict, legacy_entry, spec_of
from georep.metadata.topics import InvalidTopic, TopicSpec, parse_topic_config, validate_partitions, validate_topic_name
from offsets.coordinates import LocalOffset, Origin
from offsets.vector import VectorOffset
from topology.filters import is_internal
from topology.ids import LeaderEpoch, NodeId, SegmentId, node_id

COMMAND_FORMAT_VERSION = 1
# SiteState.version: one sequence for every state of the process (the simulators run many), so that two states
# built apart (a restore, a dump received) never share a version by chance.
_VERSIONS = itertools.count(1)
_T = TypeVar("_T")
BATCH_OVERHEAD_BYTES = 64  # a CommandBatch's own keys, pickled
BATCH_ENTRY_OVERHEAD_BYTES = 16  # what one more command adds to a batch's pickle beyond its own
SNAPSHOT_FORMAT_VERSION = 1
PORT_MAX = 65535


class InvalidCommand(ValueError):
    """A command that cannot be built or decoded, whatever the state; the message says which field and why."""


class InvalidSnapshot(ValueError):
    """A snapshot dict that :meth:`SiteState.restore` cannot read."""


class SegmentState(enum.StrEnum):
    OPEN = "open"
    SEALED = "sealed"


# -- what the state holds ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of the site, as it registered and last reported."""

    node: NodeId
    address: str  # host:port of its gRPC service
    last_heartbeat_ms: int | None = None  # the node's clock at its last heartbeat; None: none since it registered
    free_bytes: int = 0
    load: int = 0  # streams being written to the node (see cluster.placement.NodeLoad.load), as it last reported
    draining: bool = False  # being decommissioned: keeps serving what it holds, takes nothing new
    # Bytes repair copies wrote to its disk from other nodes (copies, fills, widenings, decommissions), as it last
    # reported: its own count, kept on its disk across restarts (georep/storage/moved_bytes.py).
    bytes_moved: int = 0

    def is_live(self, now_ms: int, session_timeout_ms: int) -> bool:
        """Heartbeated less than ``session_timeout_ms`` before ``now_ms``.

        ``now_ms`` is the caller's clock and the heartbeat time the node's, so the timeout must exceed the clock
        skew between nodes (plus the heartbeat interval and the Raft commit latency).
        """
        return self.last_heartbeat_ms is not None and now_ms - self.last_heartbeat_ms < session_timeout_ms


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment of a partition's chain."""

    segment_id: SegmentId
    base_offset: LocalOffset
    ensemble: tuple[NodeId, ...]  # ensemble[0] is the leader that opened it (until a repair replaces it)
    opened_epoch: LeaderEpoch
    state: SegmentState = SegmentState.OPEN
    end_offset: LocalOffset | None = None  # exclusive (the next segment's base); set when sealed
    end_vector: VectorOffset | None = None  # the partition's vector at end_offset; set when sealed
    # What the sealing leader's copy held below end_offset, for retention (cluster/retention.py): its bytes and its
    # newest producer timestamp (None: no batch). Unknown (None) for segments sealed before seals carried them.
    size_bytes: int | None = None
    max_timestamp_ms: int | None = None
    # The ack quorum (min_insync_replicas) its writes are acked under, which its recovery needs E - AQ + 1 fence
    # answers for: its topic's when it opened. None: opened before segments recorded it, the site's configured one.
    ack_quorum: int | None = None

    @property
    def sealed(self) -> bool:
        return self.state is SegmentState.SEALED

    def quorum(self, site_ack_quorum: int) -> int:
        """The ack quorum of this segment: its own, or ``site_ack_quorum`` for one opened before segments had one."""
        return site_ack_quorum if self.ack_quorum is None else self.ack_quorum


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition: its leader, leader epoch and chain of segments (oldest first)."""

    topic: str
    partition: int
    leader: NodeId | None = None
    leader_epoch: LeaderEpoch = LeaderEpoch(0)  # 0: never had a leader; every ElectLeader adds one
    segments: tuple[SegmentInfo, ...] = ()
    # The vector at the chain's start: the end vector of the last segment retention trimmed (TrimChain), empty
    # while nothing was trimmed. The log start offset is segments[0].base_offset.
    start_vector: VectorOffset = VectorOffset()
    # The idempotent producers' table at the last seal (cluster/producer_snapshot.py); None while no seal carried
    # one: nothing was sealed yet, or the last seal came from a node from before seals carried it.
    producers: ProducerSnapshot | None = None

    @property
    def open_segment(self) -> SegmentInfo | None:
        """The last segment if it is open (only the last one can be)."""
        if self.segments and not self.segments[-1].sealed:
            return self.segments[-1]
        return None

    @property
    def next_base_offset(self) -> LocalOffset | None:
        """Where the next segment must start: the sealed end of the last one, 0 for the first; None while open."""
        if not self.segments:
            return LocalOffset(0)
        return self.segments[-1].end_offset

    def segment(self, segment_id: SegmentId) -> SegmentInfo | None:
        for segment in self.segments:
            if segment.segment_id == segment_id:
                return segment
        return None

    def sealed_vector_before(self, segment_id: SegmentId) -> VectorOffset:
        """The end vector of the sealed segment before ``segment_id`` (the chain's start vector for the first)."""
        before = self.start_vector
        for segment in self.segments:
            if segment.segment_id >= segment_id:
                break
            if segment.end_vector is not None:
                before = segment.end_vector
        return before

    def sealed_producers(self, origin: Origin) -> ProducerSnapshot | None:
        """The producer table at the chain's last seal (what a leader starts from, and a seal folds onto): empty
        while no segment was ever sealed; None when the last seal carried none (``history_at_open`` falls back)."""
        if self.producers is not None:
            return self.producers
        if not self.segments or (self.segments[0].segment_id == 0 and not self.segments[0].sealed):
            return ProducerSnapshot(origin)
        return None


# -- results ---------------------------------------------------------------------------------------------


class RefusalCode(enum.StrEnum):
    TOPIC_EXISTS = "topic_exists"
    INVALID_TOPIC = "invalid_topic"
    UNKNOWN_TOPIC = "unknown_topic"
    UNKNOWN_PARTITION = "unknown_partition"
    UNKNOWN_NODE = "unknown_node"
    ADDRESS_IN_USE = "address_in_use"
    NODE_IN_USE = "node_in_use"
    STALE_EPOCH = "stale_epoch"
    NOT_IN_ENSEMBLE = "not_in_ensemble"
    NODE_NOT_DEAD = "node_not_dead"
    INVALID_ENSEMBLE = "invalid_ensemble"
    SEGMENT_OPEN = "segment_open"
    BASE_OFFSET_MISMATCH = "base_offset_mismatch"
    UNKNOWN_SEGMENT = "unknown_segment"
    NOT_SEALED = "not_sealed"
    END_MISMATCH = "end_mismatch"
    END_BEFORE_BASE = "end_before_base"
    VECTOR_WENT_BACK = "vector_went_back"
    NOT_A_MEMBER = "not_a_member"
    ENSEMBLE_FULL = "ensemble_full"
    LAST_SEGMENT = "last_segment"
    INVALID_COMMAND = "invalid_command"  # an entry this node cannot decode (see command_from_dict)


@dataclass(frozen=True, slots=True)
class Applied:
    """The command was applied. ``changed`` is False for an idempotent repeat (nothing to do)."""

    changed: bool = True
    leader_epoch: LeaderEpoch | None = None  # ElectLeader: the new epoch
    segment_id: SegmentId | None = None  # OpenSegment, SealSegment: the segment
    results: tuple[Applied | Refused, ...] = ()  # CommandBatch: each command's result, in order
    moved: int = 0  # FailOver: the partitions that got a new leader


@dataclass(frozen=True, slots=True)
class Refused:
    """The state does not allow the command; nothing changed. ``reason`` says what to do."""

    code: RefusalCode
    reason: str


Result = Applied | Refused


# -- field checks shared by the commands and the snapshot ------------------------------------------------


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r} must be an integer, got {value!r}")
    return value


def _optional_int(raw: Mapping[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _int(raw, key)


def _str(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} must be a string, got {value!r}")
    return value


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"field {key!r} must be true or false, got {value!r}")
    return value


def _mapping(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if not isinstance(value, Mapping):
        raise ValueError(f"field {key!r} must be an object, got {value!r}")
    return value


def _list(raw: Mapping[str, Any], key: str) -> list[Any]:
    value = raw.get(key)
    if not isinstance(value, list | tuple):
        raise ValueError(f"field {key!r} must be a list, got {value!r}")
    return list(value)


def _node(raw: Mapping[str, Any], key: str) -> NodeId:
    return node_id(_int(raw, key))


def _ensemble(raw: Mapping[str, Any], key: str) -> tuple[NodeId, ...]:
    members = _list(raw, key)
    return tuple(_node({key: member}, key) for member in members)


def _vector_to_dict(vector: VectorOffset) -> dict[str, int]:
    return {str(origin): seq for origin, seq in vector.items()}


def _vector(raw: Mapping[str, Any], key: str) -> VectorOffset:
    entries = _mapping(raw, key)
    return VectorOffset({Origin.parse(text): _int(entries, text) for text in sorted(entries)})


def _producers(raw: Mapping[str, Any], key: str) -> ProducerSnapshot | None:
    if raw.get(key) is None:
        return None
    try:
        return ProducerSnapshot.decode(_mapping(raw, key))
    except InvalidProducerSnapshot as e:
        raise ValueError(f"field {key!r}: {e}") from None


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= PORT_MAX:
        raise InvalidCommand(f"invalid node address {address!r}: use host:port, for example 10.0.0.7:9092")


def _check_non_negative(what: str, value: int) -> None:
    if value < 0:
        raise InvalidCommand(f"{what} is {value}; it cannot be negative")


def _check_ensemble(ensemble: tuple[NodeId, ...]) -> None:
    if not ensemble:
        raise InvalidCommand("an ensemble needs at least one node (replication_factor >= 1)")
    for member in ensemble:
        node_id(member)
    if len(set(ensemble)) != len(ensemble):
        raise InvalidCommand(f"ensemble {list(ensemble)} names a node twice: each member must be a different node")


# -- commands ----------------------------------------------------------------------------------------------


class _CommandBase:
    """``to_dict`` and ``from_dict`` for the commands; each subclass lists its fields in ``_encode``/``_decode``."""

    __slots__ = ()
    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-shaped form that goes into the Raft log."""
        return {"v": COMMAND_FORMAT_VERSION, "kind": self.KIND, **self._encode()}

    def _encode(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        """Decode :meth:`to_dict`'s form; raises :class:`InvalidCommand`."""
        if raw.get("kind") != cls.KIND:
            raise InvalidCommand(f"expected a {cls.KIND!r} command, got kind {raw.get('kind')!r}")
        try:
            return cls._decode(raw)
        except InvalidCommand:
            raise
        except ValueError as e:  # also InvalidTopic, InvalidNodeId, InvalidOrigin, InvalidVectorOffset
            raise InvalidCommand(f"invalid {cls.KIND!r} command: {e}") from None

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class RegisterNode(_CommandBase):
    """A node joins the site (or moves to a new address). Registering again at the same address is a no-op."""

    KIND: ClassVar[str] = "register_node"
    node: NodeId
    address: str

    def __post_init__(self) -> None:
        node_id(self.node)
        _check_address(self.address)

    def _encode(self) -> dict[str, Any]:
        return {"node": self.node, "address": self.address}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(_node(raw, "node"), _str(raw, "address"))


@dataclass(frozen=True, slots=True)
class NodeHeartbeat(_CommandBase):
    """A node is alive at ``now_ms`` (its clock) with this much free disk and load, and has had this many bytes
    copied to it by repairs so far.

    A heartbeat older than the last one recorded (delayed in flight) is ignored.
    """

    KIND: ClassVar[str] = "node_heartbeat"
    node: NodeId
    now_ms: int
    free_bytes: int
    load: int
    bytes_moved: int = 0

    def __post_init__(self) -> None:
        node_id(self.node)
        _check_non_negative("now_ms", self.now_ms)
        _check_non_negative("free_bytes", self.free_bytes)
        _check_non_negative("load", self.load)
        _check_non_negative("bytes_moved", self.bytes_moved)

    def _encode(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "now_ms": self.now_ms,
            "free_bytes": self.free_bytes,
            "load": self.load,
            "bytes_moved": self.bytes_moved,
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        # Logs written before bytes_moved was reported lack it: 0.
        return cls(
            _node(raw, "node"),
            _int(raw, "now_ms"),
            _int(raw, "free_bytes"),
            _int(raw, "load"),
            _int(raw, "bytes_moved") if "bytes_moved" in raw else 0,
        )


@dataclass(frozen=True, slots=True)
class SetDraining(_CommandBase):
    """Start (or stop) decommissioning a node: it takes no new segments and no new leaderships it can avoid."""

    KIND: ClassVar[str] = "set_draining"
    node: NodeId
    draining: bool

    def __post_init__(self) -> None:
        node_id(self.node)

    def _encode(self) -> dict[str, Any]:
        return {"node": self.node, "draining": self.draining}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(_node(raw, "node"), _bool(raw, "draining"))


@dataclass(frozen=True, slots=True)
class RemoveNode(_CommandBase):
    """Forget a node. Refused while it leads a partition or is a member of any segment (drain and repair first)."""

    KIND: ClassVar[str] = "remove_node"
    node: NodeId

    def __post_init__(self) -> None:
        node_id(self.node)

    def _encode(self) -> dict[str, Any]:
        return {"node": self.node}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(_node(raw, "node"))


@dataclass(frozen=True, slots=True)
class CreateTopic(_CommandBase):
    """Create a topic; its partitions start with no leader (epoch 0, or above every epoch of the name's deleted
    incarnations) and no segment. Refused if it exists. After a tombstone of the name it makes the next
    incarnation (docs/design.md, "Topic changes across sites")."""

    KIND: ClassVar[str] = "create_topic"
    spec: TopicSpec

    def __post_init__(self) -> None:
        validate_topic_name(self.spec.name)
        validate_partitions(self.spec.partitions)
        if parse_topic_config({k: str(v) for k, v in self.spec.config.items()}) != self.spec.config:
            raise InvalidTopic(f"topic config {self.spec.config!r} is not a dict of known keys to integers")

    def _encode(self) -> dict[str, Any]:
        spec = self.spec
        out = {"name": spec.name, "partitions": spec.partitions, "config": dict(sorted(spec.config.items()))}
        if spec.incarnation:  # absent when 0: the commands of a log from before incarnations read the same
            out["incarnation"] = spec.incarnation
        return out

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        config = _mapping(raw, "config")
        incarnation = _int(raw, "incarnation") if "incarnation" in raw else 0
        return cls(
            TopicSpec(
                _str(raw, "name"), _int(raw, "partitions"), {k: _int(config, k) for k in sorted(config)}, incarnation
            )
        )


@dataclass(frozen=True, slots=True)
class ElectLeader(_CommandBase):
    """Make ``node`` the partition's leader, if the epoch is still ``expected_epoch``; the epoch goes up by one."""

    KIND: ClassVar[str] = "elect_leader"
    topic: str
    partition: int
    node: NodeId
    expected_epoch: LeaderEpoch

    def __post_init__(self) -> None:
        node_id(self.node)
        _check_non_negative("expected_epoch", self.expected_epoch)

    def _encode(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "node": self.node,
            "expected_epoch": self.expected_epoch,
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(
            _str(raw, "topic"), _int(raw, "partition"), _node(raw, "node"), LeaderEpoch(_int(raw, "expected_epoch"))
        )


@dataclass(frozen=True, slots=True)
class FailOver(_CommandBase):
    """Move every partition dead ``node`` leads to a new leader (``cluster/failover.py``'s plan, run by every
    replica as it applies this), if the node's last heartbeat is still ``last_heartbeat_ms`` and it is not live at
    ``now_ms`` by ``session_timeout_ms``; ``avoid``: the proposing controller's node. One command, a few dozen bytes,
    whatever the number of partitions."""

    KIND: ClassVar[str] = "fail_over"
    node: NodeId
    last_heartbeat_ms: int | None
    now_ms: int
    session_timeout_ms: int
    avoid: NodeId | None = None

    def __post_init__(self) -> None:
        node_id(self.node)
        if self.avoid is not None:
            node_id(self.avoid)
        _check_non_negative("now_ms", self.now_ms)
        if self.session_timeout_ms < 1:
            raise InvalidCommand(f"session_timeout_ms={self.session_timeout_ms}: must be positive")

    def _encode(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "now_ms": self.now_ms,
            "session_timeout_ms": self.session_timeout_ms,
            "avoid": self.avoid,
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        avoid = raw.get("avoid")
        return cls(
            _node(raw, "node"),
            _optional_int(raw, "last_heartbeat_ms"),
            _int(raw, "now_ms"),
            _int(raw, "session_timeout_ms"),
            None if avoid is None else _node(raw, "avoid"),
        )


@dataclass(frozen=True, slots=True)
class OpenSegment(_CommandBase):
    """The leader of ``epoch`` opens the next segment at ``base_offset`` on ``ensemble`` (itself first), its writes
    acked by ``ack_quorum`` members (None: a command from before segments recorded it, the site's quorum)."""

    KIND: ClassVar[str] = "open_segment"
    topic: str
    partition: int
    epoch: LeaderEpoch
    base_offset: LocalOffset
    ensemble: tuple[NodeId, ...]
    ack_quorum: int | None = None

    def __post_init__(self) -> None:
        _check_non_negative("base_offset", self.base_offset)
        _check_ensemble(self.ensemble)
        if self.ack_quorum is not None and not 1 <= self.ack_quorum <= len(self.ensemble):
            raise InvalidCommand(
                f"ack quorum {self.ack_quorum} is not between 1 and the ensemble size {len(self.ensemble)}: a "
                "segment's min_insync_replicas must be at least 1 and at most its replication factor"
            )

    def _encode(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "epoch": self.epoch,
            "base_offset": self.base_offset,
            "ensemble": list(self.ensemble),
            **({} if self.ack_quorum is None else {"ack_quorum": self.ack_quorum}),
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(
            _str(raw, "topic"),
            _int(raw, "partition"),
            LeaderEpoch(_int(raw, "epoch")),
            LocalOffset(_int(raw, "base_offset")),
            _ensemble(raw, "ensemble"),
            _optional_int(raw, "ack_quorum"),
        )


@dataclass(frozen=True, slots=True)
class SealSegment(_CommandBase):
    """The leader of ``epoch`` seals ``segment_id`` at ``end_offset`` (exclusive) with ``end_vector``."""

    KIND: ClassVar[str] = "seal_segment"
    topic: str
    partition: int
    epoch: LeaderEpoch
    segment_id: SegmentId
    end_offset: LocalOffset
    end_vector: VectorOffset
    # For retention: the bytes below end_offset and their newest producer timestamp (None: no batch, or unknown).
    size_bytes: int | None = None
    max_timestamp_ms: int | None = None
    # The idempotent producers' table at end_offset (cluster/producer_snapshot.py): the next leader starts from it.
    producers: ProducerSnapshot | None = None

    def __post_init__(self) -> None:
        _check_non_negative("segment_id", self.segment_id)
        _check_non_negative("end_offset", self.end_offset)
        if self.size_bytes is not None:
            _check_non_negative("size_bytes", self.size_bytes)

    def _encode(self) -> dict[str, Any]:
        out = {
            "topic": self.topic,
            "partition": self.partition,
            "epoch": self.epoch,
            "segment_id": self.segment_id,
            "end_offset": self.end_offset,
            "end_vector": _vector_to_dict(self.end_vector),
        }
        # Only when known, so a seal without them encodes as before these fields existed.
        if self.size_bytes is not None:
            out["size_bytes"] = self.size_bytes
        if self.max_timestamp_ms is not None:
            out["max_timestamp_ms"] = self.max_timestamp_ms
        if self.producers is not None:
            out["producers"] = self.producers.encode()
        return out

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        # Logs written before seals carried the size and timestamp lack them: unknown (never trimmed by them); and
        # before they carried the producers' table: unknown (the next leader falls back to the copies it holds).
        return cls(
            _str(raw, "topic"),
            _int(raw, "partition"),
            LeaderEpoch(_int(raw, "epoch")),
            SegmentId(_int(raw, "segment_id")),
            LocalOffset(_int(raw, "end_offset")),
            _vector(raw, "end_vector"),
            _optional_int(raw, "size_bytes"),
            _optional_int(raw, "max_timestamp_ms"),
            _producers(raw, "producers"),
        )


@dataclass(frozen=True, slots=True)
class TrimChain(_CommandBase):
    """Retention: drop the sealed segments of the partition's chain before ``first_segment``, which becomes the
    chain's first; the log start offset moves to its base (``cluster/retention.py`` plans it).

    Only a prefix goes, so the chain stays contiguous, and ``first_segment`` must be in the chain, so the last
    segment (the open one, if any) always stays. The chain's start only moves forward: once the chain starts at
    or past ``first_segment`` (a repeat, or a later trim won) it is a no-op. A trimmed segment's copies are
    deleted by each node once it sees the trim (``ClusterMember``).
    """

    KIND: ClassVar[str] = "trim_chain"
    topic: str
    partition: int
    first_segment: SegmentId

    def __post_init__(self) -> None:
        _check_non_negative("first_segment", self.first_segment)

    def _encode(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "first_segment": self.first_segment}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(_str(raw, "topic"), _int(raw, "partition"), SegmentId(_int(raw, "first_segment")))


@dataclass(frozen=True, slots=True)
class ReplaceMember(_CommandBase):
    """A repair copied sealed ``segment_id`` from ``old``'s fellow members to ``new``: ``new`` takes ``old``'s place.

    Applies only while ``old`` is a member; again after it applied (``new`` in place, ``old`` gone) it is a no-op.
    """

    KIND: ClassVar[str] = "replace_member"
    topic: str
    partition: int
    segment_id: SegmentId
    old: NodeId
    new: NodeId

    def __post_init__(self) -> None:
        _check_non_negative("segment_id", self.segment_id)
        node_id(self.old)
        node_id(self.new)
        if self.old == self.new:
            raise InvalidCommand(f"replacing node {self.old} by itself: name a different new node")

    def _encode(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "segment_id": self.segment_id,
            "old": self.old,
            "new": self.new,
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(
            _str(raw, "topic"),
            _int(raw, "partition"),
            SegmentId(_int(raw, "segment_id")),
            _node(raw, "old"),
            _node(raw, "new"),
        )


@dataclass(frozen=True, slots=True)
class AddMember(_CommandBase):
    """A repair copied sealed ``segment_id``, whose ensemble is below ``replication_factor`` (it opened on fewer live
    nodes), to ``node``: ``node`` joins the ensemble, last.

    Applies only while the ensemble has fewer than ``replication_factor`` members; again after it applied (``node``
    a member) it is a no-op.
    """

    KIND: ClassVar[str] = "add_member"
    topic: str
    partition: int
    segment_id: SegmentId
    node: NodeId
    replication_factor: int

    def __post_init__(self) -> None:
        _check_non_negative("segment_id", self.segment_id)
        node_id(self.node)
        if self.replication_factor < 2:
            raise InvalidCommand(
                f"replication_factor is {self.replication_factor}: adding a member needs a segment below a "
                "replication_factor of at least 2"
            )

    def _encode(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "segment_id": self.segment_id,
            "node": self.node,
            "replication_factor": self.replication_factor,
        }

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(
            _str(raw, "topic"),
            _int(raw, "partition"),
            SegmentId(_int(raw, "segment_id")),
            _node(raw, "node"),
            _int(raw, "replication_factor"),
        )


@dataclass(frozen=True, slots=True)
class InitSite(_CommandBase):
    """The site's origin epoch (``site@epoch``), proposed by every node at start: the first one committed is the
    site's for good, and later proposals are no-ops. Every node of a site stamps records as the same origin, and a
    site rebuilt from empty (a new Raft group) gets a new epoch, so it never issues an old coordinate again."""

    KIND: ClassVar[str] = "init_site"
    site: str
    epoch: int

    def __post_init__(self) -> None:
        if self.epoch < 1:
            raise InvalidCommand(f"site epoch {self.epoch} must be at least 1")

    def _encode(self) -> dict[str, Any]:
        return {"site": self.site, "epoch": self.epoch}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(_str(raw, "site"), _int(raw, "epoch"))


@dataclass(frozen=True, slots=True)
class ReadBarrier(_CommandBase):
    """Changes nothing. Once it is applied locally, the local state holds every command committed before it."""

    KIND: ClassVar[str] = "read_barrier"

    def _encode(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class PutAcl(_CommandBase):
    """Keep an ACL record (an add, a remove, or one replicated from another site) if it is newer than the one held
    for its entry; an older or equal one changes nothing (``Applied(changed=False)``)."""

    KIND: ClassVar[str] = "put_acl"
    record: AclRecord

    def __post_init__(self) -> None:
        if not self.record.entry or not self.record.site:
            raise InvalidCommand(f"ACL record {self.record!r} needs an entry and a site")

    def _encode(self) -> dict[str, Any]:
        return {"record": self.record.to_dict()}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(AclRecord.from_dict(_mapping(raw, "record")))


@dataclass(frozen=True, slots=True)
class MergeTopicEntry(_CommandBase):
    """Join a topic's replicated entry (``georep/metadata/topic_entry.py``) into the one held: an alter or a
    growth made at this site, or one a topic sync brought. A growth adds the new partitions with no leader, as a
    create's. A merge that deletes the live incarnation (a tombstone of it, or a later live incarnation) removes
    the topic's partitions and their chains (see :func:`_drop_topic`); a later incarnation's partitions
    start empty. Refused: a live entry of a name the site lacks (create it first), and a tombstone of georep's own
    topics (``__georep_offsets``)."""

    KIND: ClassVar[str] = "merge_topic_entry"
    entry: TopicEntry

    def __post_init__(self) -> None:
        validate_topic_name(self.entry.name)
        if not self.entry.deleted:
            validate_partitions(self.entry.partitions)
        parse_topic_config({k: str(v) for k, v in self.entry.config().items()})

    def _encode(self) -> dict[str, Any]:
        return {"name": self.entry.name, "entry": entry_to_dict(self.entry)}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        try:
            return cls(entry_from_dict(_str(raw, "name"), _mapping(raw, "entry")))
        except (KeyError, TypeError) as e:
            raise InvalidCommand(f"invalid topic entry: {e}") from None


@dataclass(frozen=True, slots=True)
class CommandBatch(_CommandBase):
    """Several commands in one log entry, applied in order, each as if it were alone: a refused one leaves the
    others applied, and the result lists each one's (``Applied.results``). Only the packing into log entries
    changes, never what a command does: every command is a compare-and-set or idempotent on its own, so a batch
    applies exactly what the same commands proposed one after another would, and splitting a long list over several
    batches (:func:`batches`) is safe. A batch holds no batch. It is what keeps a controller's 10,000 elections
    after a node's death, and the recoveries that follow, to a few dozen commits instead of tens of thousands."""

    KIND: ClassVar[str] = "batch"
    commands: tuple[Command, ...]

    def __post_init__(self) -> None:
        if not self.commands:
            raise InvalidCommand("a command batch needs at least one command")
        if any(isinstance(c, CommandBatch) for c in self.commands):
            raise InvalidCommand("a command batch cannot hold another batch")

    def _encode(self) -> dict[str, Any]:
        return {"commands": [c.to_dict() for c in self.commands]}

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> Self:
        return cls(tuple(command_from_dict(c) for c in _list(raw, "commands")))


def batches(commands: Iterable[Command], size_of: Callable[[Command], int], max_bytes: int) -> list[Command]:
    """``commands`` packed, in order, into as few commands as fit ``max_bytes`` each (by ``size_of``, plus
    :data:`BATCH_ENTRY_OVERHEAD_BYTES` per command): a lone command goes as itself, several as a
    :class:`CommandBatch`. A command too large alone is left alone (its proposal refuses it)."""
    out: list[Command] = []
    group: list[Command] = []
    used = BATCH_OVERHEAD_BYTES
    for command in commands:
        size = size_of(command) + BATCH_ENTRY_OVERHEAD_BYTES
        if group and used + size > max_bytes:
            out.append(group[0] if len(group) == 1 else CommandBatch(tuple(group)))
            group, used = [], BATCH_OVERHEAD_BYTES
        group.append(command)
        used += size
    if group:
        out.append(group[0] if len(group) == 1 else CommandBatch(tuple(group)))
    return out


Command = (
    RegisterNode
    | NodeHeartbeat
    | SetDraining
    | RemoveNode
    | CreateTopic
    | ElectLeader
    | FailOver
    | OpenSegment
    | SealSegment
    | ReplaceMember
    | AddMember
    | InitSite
    | ReadBarrier
    | TrimChain
    | PutAcl
    | MergeTopicEntry
    | CommandBatch
)

_COMMANDS: dict[str, type[Command]] = {
    cls.KIND: cls
    for cls in (
        RegisterNode,
        NodeHeartbeat,
        SetDraining,
        RemoveNode,
        CreateTopic,
        ElectLeader,
        FailOver,
        OpenSegment,
        SealSegment,
        ReplaceMember,
        AddMember,
        InitSite,
        ReadBarrier,
        TrimChain,
        PutAcl,
        MergeTopicEntry,
        CommandBatch,
    )
}


def command_from_dict(raw: object) -> Command:
    """Decode a command from the Raft log; raises :class:`InvalidCommand`.

    A newer format version or an unknown kind means this node runs older code than the one that proposed the
    command: upgrade every node before proposing new kinds (a node that cannot decode an entry refuses it while the
    others apply it, and their states part).
    """
    if not isinstance(raw, Mapping):
        raise InvalidCommand(f"a command must be an object, got {type(raw).__name__}")
    version = raw.get("v")
    if version != COMMAND_FORMAT_VERSION:
        raise InvalidCommand(
            f"command format version {version!r} is not {COMMAND_FORMAT_VERSION}, the one this node understands: "
            "run the same georep version on every node of the site"
        )
    kind = raw.get("kind")
    cls = _COMMANDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidCommand(
            f"unknown command kind {kind!r} (known: {', '.join(sorted(_COMMANDS))}): "
            "run the same georep version on every node of the site"
        )
    return cls.from_dict(raw)


# -- the state -----------------------------------------------------------------------------------------------


def _where(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


class SiteState:
    """The site's metadata; see the module docstring. Change it only through :meth:`apply`."""

    __slots__ = (
        "_topics",
        "_entries",
        "_partitions",
        "_nodes",
        "_site",
        "_acls",
        "_version",
        "_derived",
        "_epoch_floors",
    )

    def __init__(self) -> None:
        self._topics: dict[str, TopicSpec] = {}
        # The entries of the names changed through MergeTopicEntry (the others' are unstamped, from _topics);
        # replaced, never changed in place.
        self._entries: dict[str, TopicEntry] = {}
        self._partitions: dict[tuple[str, int], PartitionInfo] = {}
        self._nodes: dict[NodeId, NodeInfo] = {}
        self._site: tuple[str, int] | None = None  # (site id, origin epoch), from the first InitSite
        self._acls: dict[str, AclRecord] = {}  # replaced, never changed in place: readers cache by identity
        self._version = next(_VERSIONS)
        self._derived: dict[str, Any] = {}  # what derived() computed at this version; replaced, never cleared
        # Per deleted topic name: the highest leader epoch its deleted incarnations reached. A later incarnation's
        # partitions start there, so a command of a deleted partition's leader (a stale epoch) never applies to
        # them. Replaced, never changed in place.
        self._epoch_floors: dict[str, LeaderEpoch] = {}

    # -- change tracking -------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Changes with every command but a heartbeat (which changes only a node's heartbeat, free bytes, load and
        bytes moved) and a read barrier: two states of one version hold the same topics, partitions and nodes
        (those four fields aside). What lets a node skip the walks over every partition while nothing changes:
        an idle site at 10,000 partitions did them several times per tick."""
        return self._version

    def derived(self, name: str, compute: Callable[[SiteState], _T]) -> _T:
        """``compute(self)``, once per :attr:`version` (and per ``name``): ``compute`` must read only what the
        version covers (not heartbeats), and its result must not be changed by the caller."""
        if name not in self._derived:
            self._derived[name] = compute(self)
        result: _T = self._derived[name]
        return result

    def _changed(self) -> None:
        self._version = next(_VERSIONS)
        self._derived = {}  # a copy shares the old dict: a new one, not cleared

    # -- queries ------------------------------------------------------------------------------------------

    def topics(self) -> dict[str, TopicSpec]:
        return dict(sorted(self._topics.items()))

    def entries(self) -> dict[str, TopicEntry]:
        """Every name's replicated entry, tombstones included: a topic never changed by an entry is incarnation 0
        with no stamps. The same dict (and entries) until the state's version changes."""
        return self.derived("entries", _entries_of)

    def acls(self) -> dict[str, AclRecord]:
        """Entry text -> ACL record, tombstones included: the same dict until a :class:`PutAcl` changes it."""
        return self._acls

    def site(self) -> tuple[str, int] | None:
        """The site id and origin epoch every node of the site stamps with (``InitSite``); None before the first."""
        return self._site

    def topic(self, name: str) -> TopicSpec | None:
        return self._topics.get(name)

    def partition(self, topic: str, partition: int) -> PartitionInfo | None:
        return self._partitions.get((topic, partition))

    def partitions(self) -> list[PartitionInfo]:
        """Every partition, by topic then partition number."""
        return list(self.derived("partitions", lambda s: [s._partitions[key] for key in sorted(s._partitions)]))

    def nodes(self) -> dict[NodeId, NodeInfo]:
        return dict(sorted(self._nodes.items()))

    def node(self, node: NodeId) -> NodeInfo | None:
        return self._nodes.get(node)

    def live_nodes(self, now_ms: int, session_timeout_ms: int) -> list[NodeInfo]:
        """Nodes that heartbeated less than ``session_timeout_ms`` before ``now_ms``, by id."""
        return [info for _, info in sorted(self._nodes.items()) if info.is_live(now_ms, session_timeout_ms)]

    def copy(self) -> SiteState:
        """An independent copy (the values are immutable, so copying the tables is enough)."""
        twin = SiteState()
        twin._topics = dict(self._topics)
        twin._entries = self._entries
        twin._partitions = dict(self._partitions)
        twin._nodes = dict(self._nodes)
        twin._site = self._site
        twin._acls = self._acls
        twin._version = self._version
        twin._derived = self._derived
        twin._epoch_floors = self._epoch_floors
        return twin

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SiteState):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    def __repr__(self) -> str:
        return f"SiteState({len(self._topics)} topics, {len(self._partitions)} partitions, {len(self._nodes)} nodes)"

    __hash__ = None  # type: ignore[assignment]  # mutable

    # -- apply ------------------------------------------------------------------------------------------------

    def apply(self, command: Command) -> Result:
        """Apply one command from the log; never raises (see the module docstring)."""
        if not isinstance(command, NodeHeartbeat | ReadBarrier | CommandBatch):  # a batch's commands count each
            self._changed()
        return self._apply(command)

    def _apply(self, command: Command) -> Result:
        if isinstance(command, RegisterNode):
            return self._register_node(command)
        if isinstance(command, NodeHeartbeat):
            return self._heartbeat(command)
        if isinstance(command, SetDraining):
            return self._set_draining(command)
        if isinstance(command, RemoveNode):
            return self._remove_node(command)
        if isinstance(command, CreateTopic):
            return self._create_topic(command)
        if isinstance(command, ElectLeader):
            return self._elect_leader(command)
        if isinstance(command, FailOver):
            return self._fail_over(command)
        if isinstance(command, OpenSegment):
            return self._open_segment(command)
        if isinstance(command, SealSegment):
            return self._seal_segment(command)
        if isinstance(command, ReplaceMember):
            return self._replace_member(command)
        if isinstance(command, AddMember):
            return self._add_member(command)
        if isinstance(command, InitSite):
            return self._init_site(command)
        if isinstance(command, ReadBarrier):
            return Applied(changed=False)
        if isinstance(command, CommandBatch):
            results = tuple(self.apply(c) for c in command.commands)
            return Applied(changed=any(isinstance(r, Applied) and r.changed for r in results), results=results)
        if isinstance(command, TrimChain):
            return self._trim_chain(command)
        if isinstance(command, MergeTopicEntry):
            return self._merge_topic_entry(command.entry)
        if isinstance(command, PutAcl):
            if not acl_newer(command.record, self._acls.get(command.record.entry)):
                return Applied(changed=False)
            self._acls = {**self._acls, command.record.entry: command.record}
            return Applied()
        return Refused(RefusalCode.INVALID_COMMAND, f"not a command: {command!r}")

    def _init_site(self, cmd: InitSite) -> Result:
        if self._site is None:
            self._site = (cmd.site, cmd.epoch)
            return Applied()
        if self._site[0] != cmd.site:
            return Refused(
                RefusalCode.INVALID_COMMAND,
                f"this Raft group holds the metadata of site {self._site[0]!r}, not {cmd.site!r}: check the "
                "node's --site and the Raft addresses in the topology",
            )
        return Applied(changed=False)

    def _unknown_node(self, node: NodeId) -> Refused:
        return Refused(RefusalCode.UNKNOWN_NODE, f"node {node} is not registered: start it so that it registers")

    def _find_partition(self, topic: str, partition: int) -> PartitionInfo | Refused:
        spec = self._topics.get(topic)
        if spec is None:
            tombstone = self._entries.get(topic)
            if tombstone is not None and tombstone.deleted:
                return Refused(
                    RefusalCode.UNKNOWN_TOPIC,
                    f"topic {topic!r} was deleted (incarnation {tombstone.incarnation}, at site "
                    f"{tombstone.stamp.site}): its partitions and segments are gone; stop acting on "
                    f"{_where(topic, partition)}",
                )
            return Refused(
                RefusalCode.UNKNOWN_TOPIC,
                f"topic {topic!r} does not exist: create it with 'georep topic create {topic} --partitions N'",
            )
        info = self._partitions.get((topic, partition))
        if info is None:
            return Refused(
                RefusalCode.UNKNOWN_PARTITION,
                f"topic {topic!r} has partitions 0..{spec.partitions - 1}, not {partition}",
            )
        return info

    def _stale_epoch(self, info: PartitionInfo, epoch: int, what: str) -> Refused:
        leader = "no leader" if info.leader is None else f"leader node {info.leader}"
        return Refused(
            RefusalCode.STALE_EPOCH,
            f"{what} {_where(info.topic, info.partition)} under leader epoch {epoch}, but the epoch is "
            f"{info.leader_epoch} ({leader}): the leadership changed; stop acting as leader of epoch "
            f"{epoch} and plan again from the current state",
        )

    def _register_node(self, cmd: RegisterNode) -> Result:
        for other in sorted(self._nodes):
            if other != cmd.node and self._nodes[other].address == cmd.address:
                return Refused(
                    RefusalCode.ADDRESS_IN_USE,
                    f"address {cmd.address} is registered to node {other}: give node {cmd.node} its own "
                    f"address, or remove node {other} first",
                )
        current = self._nodes.get(cmd.node)
        if current is None:
            self._nodes[cmd.node] = NodeInfo(cmd.node, cmd.address)
            return Applied()
        if current.address == cmd.address:
            return Applied(changed=False)
        self._nodes[cmd.node] = replace(current, address=cmd.address)
        return Applied()

    def _heartbeat(self, cmd: NodeHeartbeat) -> Result:
        current = self._nodes.get(cmd.node)
        if current is None:
            return self._unknown_node(cmd.node)
        if current.last_heartbeat_ms is not None and cmd.now_ms < current.last_heartbeat_ms:
            return Applied(changed=False)
        self._nodes[cmd.node] = replace(
            current, last_heartbeat_ms=cmd.now_ms, free_bytes=cmd.free_bytes, load=cmd.load, bytes_moved=cmd.bytes_moved
        )
        return Applied()

    def _set_draining(self, cmd: SetDraining) -> Result:
        current = self._nodes.get(cmd.node)
        if current is None:
            return self._unknown_node(cmd.node)
        if current.draining == cmd.draining:
            return Applied(changed=False)
        self._nodes[cmd.node] = replace(current, draining=cmd.draining)
        return Applied()

    def _remove_node(self, cmd: RemoveNode) -> Result:
        if cmd.node not in self._nodes:
            return Applied(changed=False)
        for info in self.partitions():
            where = _where(info.topic, info.partition)
            if info.leader == cmd.node:
                return Refused(
                    RefusalCode.NODE_IN_USE,
                    f"node {cmd.node} leads {where}: drain it (georep node drain) so that the leadership "
                    "moves, then remove it",
                )
            for segment in info.segments:
                if cmd.node in segment.ensemble:
                    return Refused(
                        RefusalCode.NODE_IN_USE,
                        f"node {cmd.node} holds {where} segment {segment.segment_id}: drain it and wait "
                        "until repair has copied its segments away, then remove it",
                    )
        del self._nodes[cmd.node]
        return Applied()

    def _create_topic(self, cmd: CreateTopic) -> Result:
        spec = cmd.spec
        if spec.name in self._topics:
            return Refused(
                RefusalCode.TOPIC_EXISTS,
                f"topic {spec.name!r} already exists: describe it with 'georep topic describe {spec.name}'",
            )
        held = self._entries.get(spec.name)
        incarnation = spec.incarnation if held is None else max(spec.incarnation, held.incarnation + 1)
        self._topics[spec.name] = TopicSpec(spec.name, spec.partitions, dict(sorted(spec.config.items())), incarnation)
        if held is not None or incarnation:  # the name's entry is the new incarnation's, unstamped as a create's
            live = replace(legacy_entry(spec.name, spec.partitions, spec.config), incarnation=incarnation)
            self._entries = {**self._entries, spec.name: live}
        _add_partitions(self, spec.name, 0, spec.partitions)
        return Applied()

    def _merge_topic_entry(self, received: TopicEntry) -> Result:
        name = received.name
        spec = self._topics.get(name)
        held = self._entries.get(name) or (None if spec is None else legacy_entry(name, spec.partitions, spec.config))
        if held is None and not received.deleted:
            return Refused(RefusalCode.UNKNOWN_TOPIC, f"topic {name!r} does not exist at this site: create it first")
        merged = merge(held, received).entry
        if merged == held:
            return Applied(changed=False)
        deletes = held is not None and not held.deleted and (merged.deleted or merged.incarnation != held.incarnation)
        if deletes and is_internal(name):
            return Refused(
                RefusalCode.INVALID_TOPIC,
                f"topic {name!r} is georep's own (its partitions hold the groups' commits): it cannot be deleted",
            )
        if deletes:
            _drop_topic(self, name)
        if not merged.deleted:
            first = 0 if held is None or held.deleted or deletes else held.partitions
            _add_partitions(self, name, first, merged.partitions)
            self._topics[name] = spec_of(merged)
        self._entries = {**self._entries, name: merged}
        return Applied()

    def _elect_leader(self, cmd: ElectLeader) -> Result:
        info = self._find_partition(cmd.topic, cmd.partition)
        if isinstance(info, Refused):
            return info
        if cmd.expected_epoch != info.leader_epoch:
            return self._stale_epoch(info, cmd.expected_epoch, "electing a leader of")
        if cmd.node not in self._nodes:
            return self._unknown_node(cmd.node)
        open_segment = info.open_segment
        if open_segment is not None and cmd.node not in open_segment.ensemble:
            return Refused(
                RefusalCode.NOT_IN_ENSEMBLE,
                f"node {cmd.node} is not in the ensemble {list(open_segment.ensemble)} of the open "
                f"segment {open_segment.segment_id} of {_where(cmd.topic, cmd.partition)}: only a member "
                "holds a prefix of it and can recover it; choose a live member",
            )
        epoch = LeaderEpoch(info.leader_epoch + 1)
        self._partitions[(cmd.topic, cmd.partition)] = replace(info, leader=cmd.node, leader_epoch=epoch)
        return Applied(leader_epoch=epoch)

    def _fail_over(self, cmd: FailOver) -> Result:
        blocker = failover_blocker(self, cmd.node, cmd.last_heartbeat_ms, cmd.now_ms, cmd.session_timeout_ms)
        if blocker:
            return Refused(RefusalCode.NODE_NOT_DEAD if cmd.node in self._nodes else RefusalCode.UNKNOWN_NODE, blocker)
        plan = plan_failover(self, cmd.node, cmd.now_ms, cmd.session_timeout_ms, cmd.avoid)
        for key, node in plan.items():
            i = self._partitions[key]
            # PartitionInfo(...), not dataclasses.replace: half the apply's time at 33,000 moves
            self._partitions[key] = PartitionInfo(
                i.topic, i.partition, node, LeaderEpoch(i.leader_epoch + 1), i.segments, i.start_vector, i.producers
            )
        self._changed()  # the plan cached what it derived (partitions()) from the state before the moves
        return Applied(changed=bool(plan), moved=len(plan))

    def _open_segment(self, cmd: OpenSegment) -> Result:
        info = self._find_partition(cmd.topic, cmd.partition)
        if isinstance(info, Refused):
            return info
        if cmd.epoch != info.leader_epoch or info.leader is None:
            return self._stale_epoch(info, cmd.epoch, "opening a segment of")
        where = _where(cmd.topic, cmd.partition)
        open_segment = info.open_segment
        if open_segment is not None:
            if (
                open_segment.opened_epoch,
                open_segment.base_offset,
                open_segment.ensemble,
                open_segment.ack_quorum,
            ) == (cmd.epoch, cmd.base_offset, cmd.ensemble, cmd.ack_quorum):
                return Applied(changed=False, segment_id=open_segment.segment_id)
            return Refused(
                RefusalCode.SEGMENT_OPEN,
                f"segment {open_segment.segment_id} of {where} is still open: seal it first (recover it "
                "if it was opened under an earlier epoch)",
            )
        expected_base = info.next_base_offset
        if cmd.base_offset != expected_base:
            return Refused(
                RefusalCode.BASE_OFFSET_MISMATCH,
                f"the next segment of {where} must start at offset {expected_base}, where the last one "
                f"was sealed, not at {cmd.base_offset}",
            )
        for member in cmd.ensemble:
            if member not in self._nodes:
                return self._unknown_node(member)
        if cmd.ensemble[0] != info.leader:
            return Refused(
                RefusalCode.INVALID_ENSEMBLE,
                f"the ensemble {list(cmd.ensemble)} of a new segment of {where} must start with its "
                f"leader, node {info.leader}: the leader appends locally and streams to the "
                "others",
            )
        segment_id = SegmentId(info.segments[-1].segment_id + 1 if info.segments else 0)
        segment = SegmentInfo(segment_id, cmd.base_offset, cmd.ensemble, cmd.epoch, ack_quorum=cmd.ack_quorum)
        self._partitions[(cmd.topic, cmd.partition)] = replace(info, segments=(*info.segments, segment))
        return Applied(segment_id=segment_id)

    def _seal_segment(self, cmd: SealSegment) -> Result:
        info = self._find_partition(cmd.topic, cmd.partition)
        if isinstance(info, Refused):
            return info
        if cmd.epoch != info.leader_epoch or info.leader is None:
            return self._stale_epoch(info, cmd.epoch, "sealing a segment of")
        where = _where(cmd.topic, cmd.partition)
        segment = info.segment(cmd.segment_id)
        if segment is None:
            return Refused(RefusalCode.UNKNOWN_SEGMENT, f"{where} has no segment {cmd.segment_id}")
        if segment.sealed:
            if segment.end_offset == cmd.end_offset and segment.end_vector == cmd.end_vector:
                return Applied(changed=False, segment_id=segment.segment_id)
            return Refused(
                RefusalCode.END_MISMATCH,
                f"segment {cmd.segment_id} of {where} is sealed at offset {segment.end_offset} with vector "
                f"{segment.end_vector}, not at {cmd.end_offset} with {cmd.end_vector}: a sealed segment "
                "never changes; recover from the sealed end",
            )
        if cmd.end_offset < segment.base_offset:
            return Refused(
                RefusalCode.END_BEFORE_BASE,
                f"segment {cmd.segment_id} of {where} starts at offset {segment.base_offset}; it cannot end "
                f"at {cmd.end_offset}",
            )
        before = info.sealed_vector_before(segment.segment_id)
        if not before.dominated_by(cmd.end_vector):
            return Refused(
                RefusalCode.VECTOR_WENT_BACK,
                f"the end vector {cmd.end_vector} of segment {cmd.segment_id} of {where} is behind the "
                f"previous segment's {before}: origin seqs never go back; recovery lost data",
            )
        sealed = replace(
            segment,
            state=SegmentState.SEALED,
            end_offset=cmd.end_offset,
            end_vector=cmd.end_vector,
            size_bytes=cmd.size_bytes,
            max_timestamp_ms=cmd.max_timestamp_ms,
        )
        self._partitions[(cmd.topic, cmd.partition)] = replace(
            info, segments=(*info.segments[:-1], sealed), producers=cmd.producers
        )
        return Applied(segment_id=segment.segment_id)

    def _sealed_segment(
        self, topic: str, partition: int, segment_id: SegmentId, roll: str
    ) -> tuple[PartitionInfo, SegmentInfo, str] | Refused:
        """The sealed segment a repair command names (and where it is, for messages); refused if it is unknown or
        open: its leader rolls it (``roll`` says into what) instead of copying a moving tail."""
        info = self._find_partition(topic, partition)
        if isinstance(info, Refused):
            return info
        where = _where(topic, partition)
        segment = info.segment(segment_id)
        if segment is None:
            return Refused(RefusalCode.UNKNOWN_SEGMENT, f"{where} has no segment {segment_id}")
        if not segment.sealed:
            return Refused(
                RefusalCode.NOT_SEALED,
                f"segment {segment_id} of {where} is open: its leader rolls it (seal, then {roll}) "
                "instead of copying a moving tail",
            )
        return info, segment, where

    def _replace_member(self, cmd: ReplaceMember) -> Result:
        found = self._sealed_segment(cmd.topic, cmd.partition, cmd.segment_id, "a new segment on a new ensemble")
        if isinstance(found, Refused):
            return found
        info, segment, where = found
        if cmd.old not in segment.ensemble:
            if cmd.new in segment.ensemble:
                return Applied(changed=False, segment_id=segment.segment_id)
            return Refused(
                RefusalCode.NOT_A_MEMBER,
                f"node {cmd.old} is not a member of segment {cmd.segment_id} of {where} "
                f"{list(segment.ensemble)}: another repair replaced it; plan again",
            )
        if cmd.new in segment.ensemble:
            return Refused(
                RefusalCode.INVALID_ENSEMBLE,
                f"node {cmd.new} already holds segment {cmd.segment_id} of {where}: copy to a node outside "
                f"its ensemble {list(segment.ensemble)}",
            )
        if cmd.new not in self._nodes:
            return self._unknown_node(cmd.new)
        ensemble = tuple(cmd.new if member == cmd.old else member for member in segment.ensemble)
        segments = tuple(replace(s, ensemble=ensemble) if s is segment else s for s in info.segments)
        self._partitions[(cmd.topic, cmd.partition)] = replace(info, segments=segments)
        return Applied(segment_id=segment.segment_id)

    def _add_member(self, cmd: AddMember) -> Result:
        found = self._sealed_segment(
            cmd.topic, cmd.partition, cmd.segment_id, "the next segment on replication_factor nodes"
        )
        if isinstance(found, Refused):
            return found
        info, segment, where = found
        if cmd.node in segment.ensemble:
            return Applied(changed=False, segment_id=segment.segment_id)
        if len(segment.ensemble) >= cmd.replication_factor:
            return Refused(
                RefusalCode.ENSEMBLE_FULL,
                f"segment {cmd.segment_id} of {where} already has {len(segment.ensemble)} members "
                f"{list(segment.ensemble)}, replication_factor {cmd.replication_factor}: another repair "
                f"completed it; plan again (node {cmd.node}'s copy is not needed)",
            )
        if cmd.node not in self._nodes:
            return self._unknown_node(cmd.node)
        segments = tuple(replace(s, ensemble=(*s.ensemble, cmd.node)) if s is segment else s for s in info.segments)
        self._partitions[(cmd.topic, cmd.partition)] = replace(info, segments=segments)
        return Applied(segment_id=segment.segment_id)

    def _trim_chain(self, cmd: TrimChain) -> Result:
        info = self._find_partition(cmd.topic, cmd.partition)
        if isinstance(info, Refused):
            return info
        where = _where(cmd.topic, cmd.partition)
        if info.segments and info.segments[0].segment_id >= cmd.first_segment:
            return Applied(changed=False, segment_id=info.segments[0].segment_id)
        index = next((i for i, s in enumerate(info.segments) if s.segment_id == cmd.first_segment), None)
        if index is None:
            return Refused(
                RefusalCode.LAST_SEGMENT,
                f"{where} has no segment {cmd.first_segment} to keep as its first: retention never "
                "drops a chain's last segment; plan again",
            )
        dropped = info.segments[index - 1]
        assert dropped.end_vector is not None  # only the last segment can be open
        self._partitions[(cmd.topic, cmd.partition)] = replace(
            info, segments=info.segments[index:], start_vector=dropped.end_vector
        )
        return Applied(segment_id=cmd.first_segment)

    # -- snapshot -------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole state as a plain, JSON-serializable dict with sorted keys and lists."""
        out: dict[str, Any] = {
            "version": SNAPSHOT_FORMAT_VERSION,
            "topics": [
                {"name": spec.name, "partitions": spec.partitions, "config": dict(sorted(spec.config.items()))}
                for _, spec in sorted(self._topics.items())
            ],
            "partitions": [_partition_to_dict(info) for info in self.partitions()],
            "nodes": [_node_to_dict(info) for _, info in sorted(self._nodes.items())],
            "site": None if self._site is None else {"id": self._site[0], "epoch": self._site[1]},
        }
        if self._acls:  # only once there are any, so snapshots from before ACLs compare equal
            out["acls"] = [self._acls[k].to_dict() for k in sorted(self._acls)]
        if self._entries:  # likewise: only once a topic was changed by an entry
            out["entries"] = [{"name": k, **entry_to_dict(self._entries[k])} for k in sorted(self._entries)]
        if self._epoch_floors:  # likewise: only once a topic was deleted
            out["epoch_floors"] = dict(sorted(self._epoch_floors.items()))
        return out

    @classmethod
    def restore(cls, raw: Mapping[str, Any]) -> SiteState:
        """Read :meth:`snapshot`'s form back; raises :class:`InvalidSnapshot`."""
        try:
            return cls._restore(raw)
        except InvalidSnapshot:
            raise
        except (ValueError, TypeError) as e:
            raise InvalidSnapshot(f"invalid site state snapshot: {e}") from None

    @classmethod
    def _restore(cls, raw: Mapping[str, Any]) -> SiteState:
        if raw.get("version") != SNAPSHOT_FORMAT_VERSION:
            raise InvalidSnapshot(
                f"site state snapshot version {raw.get('version')!r} is not {SNAPSHOT_FORMAT_VERSION}, the one this "
                "node reads: run the same georep version on every node of the site"
            )
        state = cls()
        for entry in _list(raw, "topics"):
            config = _mapping(entry, "config")
            spec = TopicSpec(_str(entry, "name"), _int(entry, "partitions"), {k: _int(config, k) for k in config})
            state._topics[spec.name] = spec
        for entry in _list(raw, "partitions"):
            info = _partition_from_dict(entry)
            if info.topic not in state._topics:
                raise InvalidSnapshot(f"partition {_where(info.topic, info.partition)} of a topic not in the snapshot")
            state._partitions[(info.topic, info.partition)] = info
        for spec in state._topics.values():
            for partition in range(spec.partitions):
                if (spec.name, partition) not in state._partitions:
                    raise InvalidSnapshot(f"partition {_where(spec.name, partition)} is missing from the snapshot")
        for entry in _list(raw, "nodes"):
            node = _node_from_dict(entry)
            state._nodes[node.node] = node
        site = raw.get("site")
        if site is not None:
            state._site = (_str(site, "id"), _int(site, "epoch"))
        acls = {}
        for entry in raw.get("acls", ()):
            record = AclRecord.from_dict(entry)
            acls[record.entry] = record
        state._acls = acls
        state._entries = {}
        for entry in raw.get("entries", ()):
            try:
                state._entries[_str(entry, "name")] = entry_from_dict(_str(entry, "name"), entry)
            except KeyError as e:
                raise InvalidSnapshot(f"invalid topic entry in the snapshot: {e}") from None
        floors = raw.get("epoch_floors", {})
        state._epoch_floors = {str(name): LeaderEpoch(_int(floors, name)) for name in sorted(floors)}
        state._changed()
        return state


def _add_partitions(state: SiteState, name: str, first: int, end: int) -> None:
    """Partitions ``first`` .. ``end - 1`` of ``name``, leaderless and empty (at the name's epoch floor)."""
    floor = state._epoch_floors.get(name, LeaderEpoch(0))
    for partition in range(first, end):
        state._partitions[(name, partition)] = PartitionInfo(name, partition, leader_epoch=floor)


def _drop_topic(state: SiteState, name: str) -> None:
    """A delete: the topic's partitions go with their chains (each member removes its copies when it sees
    it, ``ReplicaStore.remove_deleted``); the name's epoch floor keeps the highest epoch they reached."""
    spec = state._topics.pop(name)
    floor = state._epoch_floors.get(name, LeaderEpoch(0))
    for partition in range(spec.partitions):
        info = state._partitions.pop((name, partition), None)
        if info is not None:
            floor = max(floor, info.leader_epoch)
    state._epoch_floors = {**state._epoch_floors, name: floor}


def _entries_of(state: SiteState) -> dict[str, TopicEntry]:
    out = dict(state._entries)
    for name, spec in state._topics.items():
        if name not in out:
            out[name] = legacy_entry(name, spec.partitions, spec.config)
    return dict(sorted(out.items()))


def _partition_to_dict(info: PartitionInfo) -> dict[str, Any]:
    out: dict[str, Any] = {
        "topic": info.topic,
        "partition": info.partition,
        "leader": info.leader,
        "leader_epoch": info.leader_epoch,
        "segments": [
            {
                "segment_id": s.segment_id,
                "base_offset": s.base_offset,
                "ensemble": list(s.ensemble),
                "opened_epoch": s.opened_epoch,
                "state": s.state.value,
                "end_offset": s.end_offset,
                "end_vector": None if s.end_vector is None else _vector_to_dict(s.end_vector),
                **({} if s.size_bytes is None else {"size_bytes": s.size_bytes}),
                **({} if s.max_timestamp_ms is None else {"max_timestamp_ms": s.max_timestamp_ms}),
                **({} if s.ack_quorum is None else {"ack_quorum": s.ack_quorum}),
            }
            for s in info.segments
        ],
    }
    if info.start_vector:  # only once trimmed, so older snapshots compare equal
        out["start_vector"] = _vector_to_dict(info.start_vector)
    if info.producers is not None:  # only once a seal carried it, likewise
        out["producers"] = info.producers.encode()
    return out


def _partition_from_dict(raw: Mapping[str, Any]) -> PartitionInfo:
    segments = []
    for entry in _list(raw, "segments"):
        state = SegmentState(_str(entry, "state"))
        sealed = state is SegmentState.SEALED
        end_offset = _optional_int(entry, "end_offset")
        end_vector = None if entry.get("end_vector") is None else _vector(entry, "end_vector")
        if sealed != (end_offset is not None) or sealed != (end_vector is not None):
            raise InvalidSnapshot(f"segment {entry.get('segment_id')!r}: a sealed segment has an end, an open one none")
        segments.append(
            SegmentInfo(
                SegmentId(_int(entry, "segment_id")),
                LocalOffset(_int(entry, "base_offset")),
                _ensemble(entry, "ensemble"),
                LeaderEpoch(_int(entry, "opened_epoch")),
                state,
                None if end_offset is None else LocalOffset(end_offset),
                end_vector,
                _optional_int(entry, "size_bytes"),
                _optional_int(entry, "max_timestamp_ms"),
                _optional_int(entry, "ack_quorum"),
            )
        )
    leader = None if raw.get("leader") is None else _node(raw, "leader")
    start_vector = _vector(raw, "start_vector") if raw.get("start_vector") is not None else VectorOffset()
    return PartitionInfo(
        _str(raw, "topic"),
        _int(raw, "partition"),
        leader,
        LeaderEpoch(_int(raw, "leader_epoch")),
        tuple(segments),
        start_vector,
        _producers(raw, "producers"),
    )


def _node_to_dict(info: NodeInfo) -> dict[str, Any]:
    return {
        "node": info.node,
        "address": info.address,
        "last_heartbeat_ms": info.last_heartbeat_ms,
        "free_bytes": info.free_bytes,
        "load": info.load,
        "draining": info.draining,
        "bytes_moved": info.bytes_moved,
    }


def _node_from_dict(raw: Mapping[str, Any]) -> NodeInfo:
    return NodeInfo(
        _node(raw, "node"),
        _str(raw, "address"),
        _optional_int(raw, "last_heartbeat_ms"),
        _int(raw, "free_bytes"),
        _int(raw, "load"),
        _bool(raw, "draining"),
        _int(raw, "bytes_moved") if "bytes_moved" in raw else 0,
    )


# -- the leadership controller ------------------------------------------------------------------------------


def plan_leadership(
    state: SiteState,
    now_ms: int,
    session_timeout_ms: int,
    controller_since_ms: int | None = None,
    settle_ms: int = 0,
    controller: NodeId | None = None,
) -> list[ElectLeader]:
    """The leader elections to propose now: one per partition whose leader is missing or whose heartbeat expired.

    **Not before the controller has led the log for a session.** Heartbeats reach the state through the Raft log,
    so while the log has no leader (the Raft leader's node died, a partition of the network) no heartbeat commits,
    and every node's last one ages: right after a new Raft leader takes over, live nodes look expired. A controller
    that has led the log (since ``controller_since_ms``) for less than ``session_timeout_ms`` cannot tell a dead
    node from one whose heartbeats were stuck by its expired heartbeat alone. But every live node heartbeats
    every tick, and its heartbeats commit again as soon as the log has a leader: so once the controller has led
    for ``settle_ms`` (a few ticks), a leader that has not heartbeated since the controller took over, and whose
    last heartbeat is older than ``session_timeout_ms``, is dead, and is replaced; any other stays until a whole
    session has passed (a partition that has no leader gets one at once: a live node that looks stale is merely
    not chosen). Without the rule, killing the Raft leader's node moved partitions off live leaders (a new epoch,
    a recovery and a roll each), as seen on real nodes; with only the session, a partition whose leader died
    with the Raft leader waited a session more. ``None``: the caller knows the log had no gap.

    Pure and deterministic: partitions in topic then partition order; the candidate is a live node, not draining
    if possible, then the one that leads the fewest partitions (counting the elections planned before it in this
    plan), then not ``controller`` (the node whose Raft replica leads the log and runs this plan), then the one
    that heartbeated last, then the lowest id. **Why spread, and why not the controller.** A node that leads
    every partition is a site's one bottleneck, and its loss stops every partition at once. And a partition whose
    leader is also the Raft leader fails over slowly: its node's death stops the metadata as well, so the
    survivors first elect a new Raft leader, whose controller then waits ``settle_ms`` before it replaces the dead
    leader (above); a leader elsewhere is replaced as soon as its session expires. Each :class:`ElectLeader` carries the
    current epoch as ``expected_epoch``, so if another controller (or an earlier run of this one) changed the
    leadership in the meantime, the command is refused and nothing happens twice; plan again from the new state.

    **Why the new leader must come from the open segment's ensemble.** The open segment's members are the only
    nodes that hold any of it, each a prefix (the leader streams batches in order, and members append only
    contiguously). The new leader must recover every batch that a quorum could have acked before it seals the
    segment: a batch below the LAC is on at least ``min_insync_replicas`` (AQ) of the E members, so reading the ends
    of any E - AQ + 1 members finds it (any E - AQ + 1 members include at least one of any AQ). A leader from the
    ensemble is itself one of those members and already holds a prefix, so it needs E - AQ others and copies only
    the tail it lacks; a node outside would hold nothing of the segment and would have to fetch all of it before
    it could serve or seal. ``SiteState`` enforces the rule too (``NOT_IN_ENSEMBLE``). If no member is live, the
    partition stays leaderless: electing an outsider could only seal the segment at an end it cannot verify, and
    acknowledged writes would be lost, so it waits for a member to come back.

    This does not check that E - AQ + 1 members are live (the ack quorum is a topic setting the recovery reads);
    a leader elected with fewer still fences the old one, and completes recovery once enough members are back.

    A partition with no open segment (never written, or sealed by a leader that then died) may go to any live
    node: it has nothing to recover, and its sealed segments stay with their ensembles.
    """
    settling = controller_since_ms is not None and now_ms - controller_since_ms < session_timeout_ms
    live = {info.node: info for info in state.live_nodes(now_ms, session_timeout_ms)}
    led: dict[NodeId, int] = {}
    for info in state.partitions():
        if info.leader is not None and info.leader in live:
            led[info.leader] = led.get(info.leader, 0) + 1

    plan: list[ElectLeader] = []
    for info in state.partitions():
        if info.leader is not None and (
            info.leader in live
            or (settling and not _silent_since_takeover(state, info.leader, now_ms, controller_since_ms, settle_ms))
        ):
            continue
        pool: Iterable[NodeInfo] = live.values()
        if info.open_segment is not None:
            pool = [live[member] for member in info.open_segment.ensemble if member in live]
        candidates = sorted(pool, key=lambda node: _candidate_order(node, led, controller))
        if candidates:
            chosen = candidates[0].node
            led[chosen] = led.get(chosen, 0) + 1
            plan.append(ElectLeader(info.topic, info.partition, chosen, info.leader_epoch))
    return plan


def _candidate_order(node: NodeInfo, led: Mapping[NodeId, int], controller: NodeId | None) -> tuple[Any, ...]:
    """Not draining, fewest partitions led, not the controller, latest heartbeat, lowest id (``plan_leadership``)."""
    return (node.draining, led.get(node.node, 0), node.node == controller, -(node.last_heartbeat_ms or 0), node.node)


def _silent_since_takeover(
    state: SiteState, node: NodeId, now_ms: int, controller_since_ms: int | None, settle_ms: int
) -> bool:
    """Heartbeated not once since the controller took over, a settling time ago (``plan_leadership``)."""
    assert controller_since_ms is not None
    hb = state.node(node)
    last = hb.last_heartbeat_ms if hb is not None else None
    return now_ms - controller_since_ms >= settle_ms and (last is None or last < controller_since_ms)


def next_leader_expiry_ms(state: SiteState, now_ms: int, session_timeout_ms: int) -> int | None:
    """The first time after ``now_ms`` at which a partition leader's session expires if it heartbeats no more: when
    :func:`plan_leadership` may next have a dead leader to replace, so that the controller looks then rather than at
    its next tick (which can come up to a tick later). None: no leader's session expires after ``now_ms``."""
    soonest: int | None = None
    leaders = state.derived("leaders", lambda s: sorted({i.leader for i in s.partitions() if i.leader is not None}))
    for leader in leaders:  # the nodes, not the partitions: this runs at every change of the metadata
        node = state.node(leader)
        if node is None or node.last_heartbeat_ms is None:
            continue
        expiry = node.last_heartbeat_ms + session_timeout_ms  # the first ms at which NodeInfo.is_live is false
        if expiry > now_ms:
            soonest = expiry if soonest is None else min(soonest, expiry)
    return soonest


def partitions_without_leader(state: SiteState, now_ms: int, session_timeout_ms: int) -> list[PartitionInfo]:
    """Partitions whose leader is missing or expired: offline until :func:`plan_leadership` finds them one."""
    live = {info.node for info in state.live_nodes(now_ms, session_timeout_ms)}
    return [info for info in state.partitions() if info.leader is None or info.leader not in live]
