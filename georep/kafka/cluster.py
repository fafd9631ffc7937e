"""Which node a Kafka client must talk to: the Kafka gateway's view of its site. Pure: a site's metadata
snapshot in, Kafka's brokers, partition leaders and error codes out.

Kafka clients route by Metadata: they send a partition's Produce, Fetch and ListOffsets to the broker the
response names its leader, and a group's requests to the broker FindCoordinator names; an answer of
``NOT_LEADER_OR_FOLLOWER`` or ``NOT_COORDINATOR`` makes them refresh and go again. georep's multi-node
site has the same shape (docs/cluster.md): each partition has one leader node, named with a leader epoch
in the site's Raft metadata, and a group's coordinator is the leader of its ``__georep_offsets``
partition. So the gateway answers with georep's own view, one for one:

* **brokers**: every live node of the site (and this one) that has a Kafka address (the topology's
  ``kafka`` per node, like Kafka's ``advertised.listeners``), ``node_id`` = georep's node id;
* **a partition's leader** = georep's leader, with georep's leader epoch; ``replicas`` = the open segment's
  ensemble (the nodes that hold what is being written), ``isr`` = those of them that are live. A partition
  whose leader is not live, has no Kafka address, or was never elected gets ``LEADER_NOT_AVAILABLE`` and
  leader -1: clients wait and ask again, as during a Kafka leader election;
* **a request for a partition this node does not serve**: ``NOT_LEADER_OR_FOLLOWER`` if the view names
  another leader (the client's metadata is stale), ``LEADER_NOT_AVAILABLE`` if it names none. Whether
  this node serves a partition is the broker's (``Broker.partition`` raises ``NotLeader`` when it does not
  hold the partition's open segment): the view may lag the broker by a Raft apply, the broker never
  serves what it does not lead, so the broker decides and the view only chooses the code;
* **the controller** is this node: every node creates topics (through the site's Raft log), so the one a
  client asks is as good as any;
* **a group's coordinator** (FindCoordinator) is the leader of the group's ``__georep_offsets`` partition, as
  georep's own group calls find it (``georep/server/groups.py``), and Kafka's is the leader of the group's
  ``__consumer_offsets`` partition. While that partition has no live leader the answer is
  ``COORDINATOR_NOT_AVAILABLE`` (:data:`NO_COORDINATOR`), which clients retry. The coordinator computes a
  commit's exact vector, and where a commit resumes, at each partition's leader (the gateway asks it over
  georep's ``ListOffsets``), so the vector comes from the log and the fetch filter sits on the node that serves
  the client's fetches.

A one-node site is the degenerate case (:class:`OneNode`): one broker, id 0, leading every partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cluster.site_state import PartitionInfo, SiteState
from georep.kafka import errors as k
from offsets.commits import OFFSETS_TOPIC, offsets_partition

if TYPE_CHECKING:
    from georep.server.site_cluster import SiteCluster

NO_COORDINATOR = (
    "the group's coordinator (the leader of its __georep_offsets partition) is being elected or has not started "
    "leading yet; ask again"
)
LEADER_NOT_AVAILABLE = 5  # Kafka's code for a partition without a leader now (an election is under way)
NO_LEADER = -1
ONE_NODE_ID = 0  # the broker id of a one-node site's only node


@dataclass(frozen=True, slots=True)
class KafkaBroker:
    node_id: int
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Route:
    """One partition as Metadata answers it."""

    error: int  # 0, or LEADER_NOT_AVAILABLE
    leader: int  # the leader's broker id; NO_LEADER with the error
    leader_epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


class SiteView(Protocol):
    """What the gateway asks of its site; built fresh for each request that needs it."""

    @property
    def me(self) -> int: ...

    def brokers(self) -> list[KafkaBroker]: ...

    def route(self, topic: str, partition: int) -> Route: ...

    def not_served(self, topic: str, partition: int) -> int: ...

    def coordinator(self, group: str) -> KafkaBroker | None: ...  # None: COORDINATOR_NOT_AVAILABLE


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class OneNode:
    """A one-node site: this node is the only broker and leads everything."""

    host: str
    port: int
    me: int = ONE_NODE_ID

    def brokers(self) -> list[KafkaBroker]:
        return [KafkaBroker(self.me, self.host, self.port)]

    def route(self, topic: str, partition: int) -> Route:
        return Route(0, self.me, 0, (self.me,), (self.me,))

    def not_served(self, topic: str, partition: int) -> int:
        return k.NOT_LEADER_OR_FOLLOWER  # a node that is stopping

    def coordinator(self, group: str) -> KafkaBroker | None:
        return self.brokers()[0]


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A node of a multi-node site: its metadata snapshot, the nodes it takes for live, and every node's Kafka
    address (the topology's). See the module docstring for the rules."""

    me: int
    live: frozenset[int]  # nodes that heartbeated within the session timeout, by this node's view
    kafka: Mapping[int, str]  # node id -> Kafka HOST:PORT
    partitions: Mapping[tuple[str, int], PartitionInfo]

    @classmethod
    def of(
        cls,
        state: SiteState,
        me: int,
        kafka: Mapping[int, str],
        now_ms: int,
        session_timeout_ms: int,
        keys: list[tuple[str, int]] | None = None,
    ) -> ClusterView:
        """The view from ``state`` at ``now_ms``: of ``keys``' partitions only, or of all."""
        live = frozenset(n.node for n in state.live_nodes(now_ms, session_timeout_ms)) | {me}
        if keys is None:
            parts = {(p.topic, p.partition): p for p in state.partitions()}
        else:
            parts = {key: p for key in keys if (p := state.partition(*key)) is not None}
        return cls(me, live, dict(kafka), parts)

    def _reachable(self, node: int) -> bool:
        return node in self.live and node in self.kafka

    def brokers(self) -> list[KafkaBroker]:
        return [KafkaBroker(n, *split_address(self.kafka[n])) for n in sorted(self.live) if n in self.kafka]

    def route(self, topic: str, partition: int) -> Route:
        info = self.partitions.get((topic, partition))
        if info is None:  # not yet in this node's view of the metadata
            return Route(LEADER_NOT_AVAILABLE, NO_LEADER, 0, (), ())
        opened = info.open_segment
        replicas = tuple(int(n) for n in opened.ensemble) if opened is not None else ()
        isr = tuple(n for n in replicas if n in self.live)
        epoch = int(info.leader_epoch)
        if info.leader is None or not self._reachable(int(info.leader)):
            return Route(LEADER_NOT_AVAILABLE, NO_LEADER, epoch, replicas, isr)
        leader = int(info.leader)
        return Route(0, leader, epoch, replicas or (leader,), isr or (leader,))

    def not_served(self, topic: str, partition: int) -> int:
        """The code for a request about a partition this node's broker does not serve."""
        route = self.route(topic, partition)
        if route.error or route.leader == self.me:  # named here, not attached yet: no leader to send it to
            return LEADER_NOT_AVAILABLE
        return k.NOT_LEADER_OR_FOLLOWER

    def coordinator(self, group: str) -> KafkaBroker | None:
        """The leader of ``group``'s offsets partition, if live with a Kafka address (the view must hold that
        partition); None: not now."""
        route = self.route(OFFSETS_TOPIC, offsets_partition(group))
        if route.error:
            return None
        return KafkaBroker(route.leader, *split_address(self.kafka[route.leader]))


ViewOf = Callable[[list[tuple[str, int]] | None], SiteView]  # the view of some partitions (None: all), now


def cluster_view_of(site_cluster: SiteCluster, kafka: Mapping[int, str]) -> ViewOf:
    """Views of ``site_cluster``'s metadata as this node has it now (read under its lock, not copied)."""
    member = site_cluster.member

    def view(keys: list[tuple[str, int]] | None) -> SiteView:
        now_ms, timeout_ms = member.clock_ms(), member.config.session_timeout_ms
        return site_cluster.metadata.read(
            lambda state: ClusterView.of(state, int(member.me), kafka, now_ms, timeout_ms, keys)
        )

    return view
