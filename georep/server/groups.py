"""Consumer groups and committed offsets at one site: the shell around
``cluster/groups.py`` (membership) and ``offsets/commits.py`` (commits).

Commits are records of the internal topic ``__georep_offsets``. This module
appends them through the broker as this site's origin, like any produced
batch, so they replicate to every site and take the same ack levels, geo
acks included. ``catch_up`` folds every commit record this site holds, its
own and replicated ones, into the ``CommitTable``, reading each internal
partition from where it stopped last time. It runs before every read of the
table and before every commit, so a consumer that fails over to this site sees
every commit that has arrived here.

**A multi-node site.** The coordinator of group G is the node leading
``(__georep_offsets, offsets_partition(G))``, as Kafka's is the leader of the
group's ``__consumer_offsets`` partition. The first group call a node gets
creates the internal topic through the site's metadata, with the one-node
config (a topic another node created first is fine), as Kafka creates
``__consumer_offsets`` at the first coordinator lookup. A node answers group calls only for the groups it coordinates
(``NotCoordinator``, with the coordinator's address, for the others), appends
commits through the partition's ``ChainLog`` like any batch (``acks=all`` at the
ack quorum, ``geo:N`` on top), and folds only the offsets partitions it leads.
``cluster.groups.lead_step`` says what to drop when what it leads changes: the
members of a partition it lost or leads at a new epoch (they rejoin), and the
fold of a partition whose chain changed (folded again from the start, reading
segments other nodes hold through ``SiteCluster.read_elsewhere``). ``ListGroups``
answers for the groups this node coordinates; the client asks every leader of
the internal topic and merges (``georep/cli/group.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from cluster.groups import (
    GroupCoordinator,
    InvalidGroupRequest,
    LeadToken,
    forget_groups,
    lead_step,
    takeover_hold_until,
)
from georep.broker.acks import Acks
from georep.broker.commits import CommitEntry, CommitLog, check_commit_request, commit_batch, lacks
from georep.broker.errors import (
    CommitsBehind,
    GroupNotEmpty,
    InvalidRequest,
    NotCoordinator,
    NotLeader,
    SegmentUnreadable,
    UnknownGroup,
    UnknownPartition,
)
from georep.metadata.store import TopicExists, UnknownTopic
from georep.proto import georep_pb2 as pb
from georep.proto.convert import acks_from_proto, topic_partitions_to_proto, vector_from_proto, vector_to_proto
from georep.raft.store import MetadataUnavailable
from georep.server.broker import Broker, Partition
from georep.storage.api import PartitionLog
from georep.storage.chain_log import ChainLog, SegmentElsewhere
from offsets.commits import OFFSETS_PARTITIONS, OFFSETS_TOPIC, Commit, CommitTable, offsets_partition, validate_group
from offsets.coordinates import Origin
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.filters import is_internal

if TYPE_CHECKING:
    from georep.server.site_cluster import SiteCluster

log = logging.getLogger(__name__)

OFFSETS_TOPIC_CONFIG = {"retention_ms": str(7 * 24 * 3600 * 1000), "flush_interval_ms": "0"}
CAUGHT_UP_WAIT_MS_MAX = 30_000
CAUGHT_UP_POLL_S = 0.01
UPSTREAM_ASK_S = 2.0
REMOTE_READS_MAX = 10_000  # segments read from other nodes in one fold: a bound, never reached


async def _none(key: tuple[str, int], timeout_s: float) -> list[Mapping[Origin, int] | None]:
    return []


class GroupService:
    def __init__(
        self,
        broker: Broker,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        site_cluster: SiteCluster | None = None,
    ) -> None:
        self.broker = broker
        self.site_cluster = site_cluster
        self._led: dict[int, LeadToken] = {}  # multi-node site: the offsets partitions this node leads, as folded
        # ... and when it took each over at its leader epoch (None: it leads it since its first epoch, no takeover)
        self._taken_over_ms: dict[int, int | None] = {}
        self._creating = asyncio.Lock()
        self.clock_ms = clock_ms
        self.coordinator = GroupCoordinator(self._partition_count, self._new_member_id)
        self.subscriptions_changed = 0  # one more whenever a member joins or names other topics
        self.commits = CommitLog()
        # What each live upstream holds of a partition now; the replicator replaces it (a standalone node has
        # no upstream).
        self.upstream_vectors: Callable[[tuple[str, int], float], Awaitable[list[Mapping[Origin, int] | None]]] = _none
        if broker.in_site:
            return  # the site's metadata holds the internal topic: the first group call creates it there
        if OFFSETS_TOPIC not in broker.metadata.topics():
            broker.create_topic(OFFSETS_TOPIC, OFFSETS_PARTITIONS, OFFSETS_TOPIC_CONFIG, internal=True)
        self.catch_up()

    @property
    def table(self) -> CommitTable:
        return self.commits.table

    def _partition_count(self, topic: str) -> int:
        """One topic's count, without a copy of the whole table (asked per subscribed topic at each expiry check:
        200 topics at a site of 20,000 copied 4 million entries a second)."""
        if is_internal(topic):
            return 0
        try:
            return self.broker.metadata.get(topic).partitions
        except UnknownTopic:
            return 0

    @staticmethod
    def _new_member_id(client_id: str) -> str:
        return f"{client_id or 'consumer'}-{uuid.uuid4().hex[:12]}"

    # -- the internal topic and what this node coordinates ----------------------

    async def tick(self) -> None:
        """The node's group housekeeping: drop the groups of offsets partitions this node stopped leading (a
        multi-node site), and expire members whose session timed out."""
        self._observe_leadership()
        self.expire()

    async def ensure_offsets_topic(self, group: str) -> None:
        """A multi-node site: create the internal topic through the site's metadata if it lacks it, at the first
        group call (Kafka creates ``__consumer_offsets`` at the first coordinator lookup), so a site that runs no
        group carries none of its partitions. Every node that gets a group call may try at once: all but one get
        ``TopicExists``, which is fine. Until its partitions have leaders, group calls answer ``NotCoordinator``
        with no hint, and clients look again."""
        if not self.broker.in_site or OFFSETS_TOPIC in self.broker.metadata.topics():
            return
        async with self._creating:
            if OFFSETS_TOPIC in self.broker.metadata.topics():
                return
            try:
                # Blocking: a Raft proposal, in a worker thread.
                await asyncio.to_thread(
                    self.broker.create_topic, OFFSETS_TOPIC, OFFSETS_PARTITIONS, OFFSETS_TOPIC_CONFIG, internal=True
                )
                log.info("created the internal topic %s (%d partitions)", OFFSETS_TOPIC, OFFSETS_PARTITIONS)
            except TopicExists:
                pass
            except MetadataUnavailable as exc:  # no Raft majority now: the client looks again
                raise NotCoordinator(
                    group,
                    OFFSETS_TOPIC,
                    offsets_partition(group),
                    why=f"the site's metadata cannot create {OFFSETS_TOPIC} now: {exc}",
                ) from None

    def _offsets_logs(self) -> dict[int, PartitionLog]:
        if not self.broker.in_site:
            return {i: self.broker.partition(OFFSETS_TOPIC, i).log for i in range(OFFSETS_PARTITIONS)}
        led = ((i, self.broker.partitions.get((OFFSETS_TOPIC, i))) for i in range(OFFSETS_PARTITIONS))
        return {i: p.log for i, p in led if p is not None}  # not a walk of every partition: this runs every tick

    def _observe_leadership(self) -> dict[int, PartitionLog]:
        """Multi-node site: what this node leads of the offsets partitions now; drops what ``lead_step`` says."""
        logs = self._offsets_logs()
        if not self.broker.in_site:
            return logs
        now = {
            i: (int(chain.epoch), int(chain.open.segment_id))
            for i, chain in logs.items()
            if isinstance(chain, ChainLog)
        }
        step = lead_step(self._led, now)
        for name in forget_groups(self.coordinator, step.forget_members, offsets_partition):
            log.info(
                "group %r: this node no longer coordinates it under the same leader epoch; its members rejoin", name
            )
        for index in step.refold:
            self.commits.reset(index, offsets_partition)
        now_ms = self.clock_ms()
        self._taken_over_ms = {i: now_ms if i in step.taken_over else self._taken_over_ms.get(i) for i in now}
        self._led = now
        return logs

    def _coordinated(self, group: str) -> Partition:
        """The offsets partition of ``group``; ``NotCoordinator`` (with the coordinator's address) on a node of a
        multi-node site that does not lead it."""
        index = offsets_partition(group)
        p = self.broker.partitions.get((OFFSETS_TOPIC, index))
        if p is None and self.broker.in_site:
            raise NotCoordinator(group, OFFSETS_TOPIC, index, self.broker.leader_hint(OFFSETS_TOPIC, index))
        return self.broker.partition(OFFSETS_TOPIC, index)

    def _check_partition(self, topic: str, partition: int) -> None:
        """``UnknownTopic`` / ``UnknownPartition``; any node knows every topic, whoever leads its partitions."""
        spec = self.broker.topic(topic)
        if not 0 <= partition < spec.partitions:
            raise UnknownPartition(topic, partition, spec.partitions)

    # -- the commit table -------------------------------------------------------

    def catch_up(self) -> None:
        """Fold every commit record this site holds and has not folded yet (``CommitLog.catch_up``)."""
        for problem in self.commits.catch_up(self._offsets_logs()).problems:
            log.warning("%s", problem)

    async def sync(self) -> None:
        """``catch_up`` of what this node leads, after ``lead_step``; on a multi-node site, segments held by other
        nodes are read from them (``SegmentUnreadable`` if none answers).

        It returns only after a pass over every led partition that awaited nothing, so a caller that reads the
        table right after it (with no await in between) reads a complete fold: while a read from another node is
        awaited, ``lead_step`` may reset a partition (a roll, a new epoch), and a table read then would miss
        commits and hand out an older position."""
        if self.site_cluster is None:
            self._observe_leadership()
            self.catch_up()
            return
        for _pass in range(REMOTE_READS_MAX):
            logs = self._observe_leadership()
            try:
                for index in sorted(logs):
                    for problem in self.commits.catch_up({index: logs[index]}).problems:
                        log.warning("%s", problem)
                return
            except SegmentElsewhere as missing:
                chain = logs[index]
                assert isinstance(chain, ChainLog)
                await self.site_cluster.read_elsewhere(chain, missing, 1 << 20)
        raise SegmentUnreadable(
            f"the fold of {OFFSETS_TOPIC} read {REMOTE_READS_MAX} segments from other nodes "
            "without reaching the end; retry"
        )

    def lag(self, topic: str, partition: int, vector: VectorOffset) -> int:
        """Records this site holds for the partition that ``vector`` does not cover (exact: seqs are dense); -1 on a
        node of a multi-node site that does not lead the partition (it does not know its end)."""
        p = self.broker.partitions.get((topic, partition))
        if p is None:
            return -1 if self.broker.in_site else 0
        return sum(max(0, seq - vector.get(origin)) for origin, seq in p.log.vector().items())

    def _live(self, c: Commit) -> bool:
        """Whether ``c`` is a position in its topic's live incarnation (or in a topic this site does not hold): a
        commit of a deleted incarnation is no position in the topic created again (offsets/commits.py)."""
        entry = self.broker.metadata.entries().get(c.topic)
        if entry is None:
            return True
        return c.incarnation > entry.incarnation if entry.deleted else c.incarnation == entry.incarnation

    def _positions(self, group: str) -> Iterator[Commit]:
        """``group``'s commits that are positions in their topic's live incarnation."""
        return (c for c in self.table.of_group(group) if self._live(c))

    def _committed(self, c: Commit) -> pb.CommittedOffset:
        return pb.CommittedOffset(
            topic=c.topic,
            partition=c.partition,
            vector=vector_to_proto(c.vector),
            hlc=c.hlc,
            committed_by=str(c.committed_by),
            hint_offset=c.hint_offset,
            member_id=c.member_id,
            generation=c.generation,
            committed_at_ms=c.committed_at_ms,
            metadata=c.metadata,
            lag_records=self.lag(c.topic, c.partition, c.vector),
        )

    # -- RPCs -------------------------------------------------------------------

    async def heartbeat(self, req: pb.GroupHeartbeatRequest) -> pb.GroupHeartbeatResponse:
        group = validate_group(req.group)
        for topic in req.topics:
            if is_internal(topic):
                raise InvalidGroupRequest(f"topic {topic!r} is internal to georep: subscribe to your own topics")
        await self.ensure_offsets_topic(group)
        await self.sync()  # the group's commits, which decide a new coordinator's hold
        self._coordinated(group)
        session_timeout_ms = req.session_timeout_ms or 10_000
        hold = takeover_hold_until(
            self._taken_over_ms.get(offsets_partition(group)),
            session_timeout_ms,
            any(True for _ in self.table.of_group(group)),
        )
        held = self.coordinator.groups.get(group)
        member = None if held is None else held.members.get(req.member_id)
        if member is None or list(member.topics) != list(req.topics):
            self.subscriptions_changed += 1  # what this site reads changed: its interest links look at once
        hb = self.coordinator.heartbeat(
            group,
            req.member_id,
            list(req.topics),
            session_timeout_ms,
            req.assignor or "range",
            self.clock_ms(),
            req.client_id,
            hold_until_ms=hold,
        )
        return pb.GroupHeartbeatResponse(
            member_id=hb.member_id,
            generation=hb.generation,
            assignment=topic_partitions_to_proto(hb.assignment),
            heartbeat_interval_ms=hb.heartbeat_interval_ms,
        )

    async def leave(self, req: pb.LeaveGroupRequest) -> pb.LeaveGroupResponse:
        self._observe_leadership()
        self._coordinated(validate_group(req.group))
        self.coordinator.leave(req.group, req.member_id)
        return pb.LeaveGroupResponse()

    def expire(self) -> None:
        for group, member in self.coordinator.expire(self.clock_ms()):
            log.info("member %s of group %r left: no heartbeat within its session timeout", member, group)

    async def commit(self, req: pb.CommitOffsetsRequest, members_ok: bool = False) -> pb.CommitOffsetsResponse:
        """A commit (``members_ok``: an OffsetDelete's tombstones of topics no member subscribes to, which Kafka
        deletes while the group has members)."""
        entries = []
        for pc in req.commits:
            try:
                vector = VectorOffset() if pc.deleted else vector_from_proto(pc.vector)
            except InvalidVectorOffset as exc:
                raise InvalidRequest(f"malformed vector offset: {exc}") from None
            entries.append(CommitEntry(pc.topic, pc.partition, vector, pc.hint_offset, pc.metadata, pc.deleted))
        group = check_commit_request(req.group, entries)
        for e in entries:
            if not e.deleted:  # a position of a topic deleted since may still be deleted
                self._check_partition(e.topic, e.partition)
        await self.ensure_offsets_topic(group)
        await self.sync()
        self._coordinated(group)
        if any(e.deleted for e in entries) and not members_ok:
            self._check_deletable(group, req.member_id)
        if not members_ok:
            self.coordinator.check_commit(
                group, req.member_id, req.generation, sorted((e.topic, e.partition) for e in entries)
            )
        now = self.clock_ms()
        stamp = self.commits.stamp(now, req.after_hlc, self.broker.identity.site)
        origin = self.broker.origin
        commits = self.commits.new_commits(
            group,
            entries,
            stamp,
            origin,
            member_id=req.member_id,
            generation=req.generation,
            now_ms=now,
            incarnations={e.topic: self.broker.topic(e.topic).incarnation for e in entries},
        )
        acks: Acks = acks_from_proto(req.acks, req.geo_sites)
        p, produced = self.broker.append(
            OFFSETS_TOPIC, offsets_partition(group), commit_batch(commits, now), acks, internal=True
        )
        self.commits.record(commits)
        waiter = self.broker.ack_waiter(p, produced, acks, req.ack_timeout_ms)
        if waiter is not None:
            await waiter
        return pb.CommitOffsetsResponse(hlc=stamp, committed_by=str(origin))

    def subscribed(self, group: str) -> set[str]:
        """The topics the group's active members subscribe to."""
        g = self.coordinator.groups.get(group)
        return set() if g is None else {t for m in g.members.values() for t in m.topics}

    async def delete(
        self, group: str, partitions: list[tuple[str, int]] | None, members_ok: bool = False
    ) -> list[tuple[str, int]]:
        """Delete ``group``'s positions (``partitions``; all of them if None) with tombstone commits, as an
        administrator (no member id); returns the partitions deleted. ``UnknownGroup`` for a group with neither
        members nor positions, ``GroupNotEmpty`` while it has members. Partitions it has no position of are left
        out: nothing to delete."""
        group = validate_group(group)
        await self.ensure_offsets_topic(group)
        await self.sync()
        self._coordinated(group)
        g = self.coordinator.groups.get(group)
        held = [(c.topic, c.partition) for c in self.table.of_group(group)]
        if not held and (g is None or not g.members):
            raise UnknownGroup(
                f"unknown group {group!r} at site {self.broker.identity.site}: no members and no committed "
                "positions here (list groups with 'georep group list')"
            )
        if not members_ok:
            self._check_deletable(group, "")
        doomed = held if partitions is None else sorted(set(partitions) & set(held))
        if doomed:
            commits = [pb.PartitionCommit(topic=t, partition=i, deleted=True, hint_offset=-1) for t, i in doomed]
            await self.commit(pb.CommitOffsetsRequest(group=group, generation=-1, commits=commits), members_ok)
        return doomed

    def _check_deletable(self, group: str, member_id: str) -> None:
        """A delete is an administrator's, and only of a group with no active member (Kafka's NON_EMPTY_GROUP)."""
        g = self.coordinator.groups.get(group)
        if member_id or (g is not None and g.members):
            n = len(g.members) if g is not None else 0
            raise GroupNotEmpty(
                f"group {group!r} has {n} active member(s) at site {self.broker.identity.site}: stop its consumers "
                "(or wait for their sessions to time out), then delete its offsets again"
            )

    async def fetch_committed(self, req: pb.FetchCommittedRequest) -> pb.FetchCommittedResponse:
        group = validate_group(req.group)
        await self.ensure_offsets_topic(group)
        self._observe_leadership()
        self._coordinated(group)
        if req.wait_caught_up_ms > 0:
            await self._caught_up(group, req.wait_caught_up_ms)
        await self.sync()
        self._coordinated(group)
        if not req.partitions:
            return pb.FetchCommittedResponse(offsets=[self._committed(c) for c in self._positions(group)])
        out = []
        for tps in req.partitions:
            for partition in tps.partitions:
                c = self.table.get(group, tps.topic, partition)
                if c is not None and self._live(c):
                    out.append(self._committed(c))
        return pb.FetchCommittedResponse(offsets=out)

    async def _caught_up(self, group: str, wait_ms: int) -> None:
        """Return once this site holds every commit record of ``group`` that each live upstream holds now; raise
        ``CommitsBehind`` if it does not within ``wait_ms``, or if a streaming upstream does not answer (it may
        hold a commit this site lacks: answering would risk a stale position, and I5)."""
        wait_s = min(wait_ms, CAUGHT_UP_WAIT_MS_MAX) / 1000
        deadline = time.monotonic() + wait_s
        key = (OFFSETS_TOPIC, offsets_partition(group))
        upstreams = await self.upstream_vectors(key, min(wait_s, UPSTREAM_ASK_S))
        site = self.broker.identity.site
        if any(u is None for u in upstreams):
            raise CommitsBehind(
                f"site {site} could not ask, within {wait_ms} ms, every live upstream what it holds of group "
                f"{group!r}'s commits: its committed positions could be stale. Retry (a group member retries by "
                "itself); if this lasts, check the links with 'georep status'"
            )
        known = [u for u in upstreams if u is not None]
        log_ = self._coordinated(group).log
        while lacks(log_.vector(), known) and time.monotonic() < deadline:
            await asyncio.sleep(CAUGHT_UP_POLL_S)
            log_ = self._coordinated(group).log  # a multi-node leader's chain log changes at a roll
        if lacks(log_.vector(), known):
            raise CommitsBehind(
                f"site {site} has not caught up, within {wait_ms} ms, with the commits of group {group!r} that a "
                "live upstream holds: its committed positions could be stale. Retry (a group member retries by "
                "itself); if this lasts, check the links with 'georep status'"
            )

    async def list_groups(self) -> pb.ListGroupsResponse:
        """Every group this site (a one-node site) or this node (a multi-node site: the groups whose offsets
        partition it leads) knows of: clients of a multi-node site ask each leader and merge."""
        await self.sync()
        led = {i for i in range(OFFSETS_PARTITIONS) if (OFFSETS_TOPIC, i) in self.broker.partitions}
        if self.site_cluster is not None:
            # Named the leader of an offsets partition it does not serve yet (it is recovering it): its groups
            # would be missing from the answer. Say so; the client asks again.
            me = self.site_cluster.node_address(self.site_cluster.member.me)
            taking_over = [
                i
                for i in range(OFFSETS_PARTITIONS)
                if i not in led and me and self.broker.leader_hint(OFFSETS_TOPIC, i) == me
            ]
            if taking_over and OFFSETS_TOPIC in self.broker.metadata.topics():
                raise NotLeader(
                    OFFSETS_TOPIC,
                    taking_over[0],
                    "this node is taking the partition over and does "
                    "not serve it yet; list the groups again in a moment",
                )
        names = sorted(set(self.table.groups()) | {n for n, g in self.coordinator.groups.items() if g.members})
        out = []
        for name in names:
            if self.broker.in_site and offsets_partition(name) not in led:
                continue
            g = self.coordinator.groups.get(name)
            commits = list(self._positions(name))
            lags = [self.lag(c.topic, c.partition, c.vector) for c in commits]
            out.append(
                pb.GroupSummary(
                    group=name,
                    members=len(g.members) if g else 0,
                    generation=g.generation if g else 0,
                    assignor=g.assignor if g else "",
                    committed_partitions=len(commits),
                    lag_records=-1 if any(lag < 0 for lag in lags) else sum(lags),
                )
            )
        return pb.ListGroupsResponse(groups=out)

    async def describe(self, req: pb.DescribeGroupRequest) -> pb.GroupDescription:
        group = validate_group(req.group)
        await self.ensure_offsets_topic(group)
        await self.sync()
        self._coordinated(group)
        g = self.coordinator.groups.get(group)
        commits = list(self._positions(group))
        if (g is None or not g.members) and not commits:
            raise UnknownGroup(
                f"unknown group {group!r} at site {self.broker.identity.site}: no members and no commits here "
                "(list groups with 'georep group list')"
            )
        now = self.clock_ms()
        members = (
            []
            if g is None
            else [
                pb.GroupMember(
                    member_id=m.member_id,
                    client_id=m.client_id,
                    assignment=topic_partitions_to_proto(m.assignment),
                    last_heartbeat_age_ms=now - m.last_heartbeat_ms,
                )
                for _, m in sorted(g.members.items())
            ]
        )
        return pb.GroupDescription(
            group=group,
            generation=g.generation if g else 0,
            assignor=g.assignor if g else "",
            members=members,
            offsets=[self._committed(c) for c in commits],
        )
