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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

from cluster.groups import GroupCoordinator, InvalidGroupRequest
from georep.broker.acks import Acks
from georep.broker.commits import CommitEntry, CommitLog, check_commit_request, commit_batch, lacks
from georep.broker.errors import CommitsBehind, InvalidRequest, UnknownGroup
from georep.proto import georep_pb2 as pb
from georep.proto.convert import acks_from_proto, topic_partitions_to_proto, vector_from_proto, vector_to_proto
from georep.server.broker import Broker
from georep.storage.api import PartitionLog
from offsets.commits import OFFSETS_PARTITIONS, OFFSETS_TOPIC, Commit, CommitTable, offsets_partition, validate_group
from offsets.coordinates import Origin
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.filters import is_internal

log = logging.getLogger(__name__)

OFFSETS_TOPIC_CONFIG = {"retention_ms": str(7 * 24 * 3600 * 1000), "flush_interval_ms": "0"}
CAUGHT_UP_WAIT_MS_MAX = 30_000
CAUGHT_UP_POLL_S = 0.01
UPSTREAM_ASK_S = 2.0


async def _none(key: tuple[str, int], timeout_s: float) -> list[Mapping[Origin, int]]:
    return []


class GroupService:
    def __init__(self, broker: Broker, clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self.broker = broker
        self.clock_ms = clock_ms
        self.coordinator = GroupCoordinator(self._partition_count, self._new_member_id)
        self.commits = CommitLog()
        # What each live upstream holds of a partition now; the replicator replaces it (a standalone node has
        # no upstream).
        self.upstream_vectors: Callable[[tuple[str, int], float], Awaitable[list[Mapping[Origin, int]]]] = _none
        if broker.in_site:
            return  # consumer groups do not run on multi-node sites yet: every group call says so (service.py)
        if OFFSETS_TOPIC not in broker.metadata.topics():
            broker.create_topic(OFFSETS_TOPIC, OFFSETS_PARTITIONS, OFFSETS_TOPIC_CONFIG)
        self.catch_up()

    @property
    def table(self) -> CommitTable:
        return self.commits.table

    def _partition_count(self, topic: str) -> int:
        spec = self.broker.metadata.topics().get(topic)
        return 0 if spec is None or is_internal(topic) else spec.partitions

    @staticmethod
    def _new_member_id(client_id: str) -> str:
        return f"{client_id or 'consumer'}-{uuid.uuid4().hex[:12]}"

    # -- the commit table -------------------------------------------------------

    def _offsets_logs(self) -> dict[int, PartitionLog]:
        return {i: self.broker.partition(OFFSETS_TOPIC, i).log for i in range(OFFSETS_PARTITIONS)}

    def catch_up(self) -> None:
        """Fold every commit record this site holds and has not folded yet (``CommitLog.catch_up``)."""
        for problem in self.commits.catch_up(self._offsets_logs()).problems:
            log.warning("%s", problem)

    def lag(self, topic: str, partition: int, vector: VectorOffset) -> int:
        """Records this site holds for the partition that ``vector`` does not cover (exact: seqs are dense)."""
        p = self.broker.partitions.get((topic, partition))
        if p is None:
            return 0
        return sum(max(0, seq - vector.get(origin)) for origin, seq in p.log.vector().items())

    def _committed(self, c: Commit) -> pb.CommittedOffset:
        return pb.CommittedOffset(
            topic=c.topic, partition=c.partition, vector=vector_to_proto(c.vector), hlc=c.hlc,
            committed_by=str(c.committed_by), hint_offset=c.hint_offset, member_id=c.member_id,
            generation=c.generation, committed_at_ms=c.committed_at_ms, metadata=c.metadata,
            lag_records=self.lag(c.topic, c.partition, c.vector),
        )  # fmt: skip

    # -- RPCs -------------------------------------------------------------------

    def heartbeat(self, req: pb.GroupHeartbeatRequest) -> pb.GroupHeartbeatResponse:
        group = validate_group(req.group)
        for topic in req.topics:
            if is_internal(topic):
                raise InvalidGroupRequest(f"topic {topic!r} is internal to georep: subscribe to your own topics")
        hb = self.coordinator.heartbeat(
            group, req.member_id, list(req.topics), req.session_timeout_ms or 10_000, req.assignor or "range",
            self.clock_ms(), req.client_id,
        )  # fmt: skip
        return pb.GroupHeartbeatResponse(
            member_id=hb.member_id, generation=hb.generation, assignment=topic_partitions_to_proto(hb.assignment),
            heartbeat_interval_ms=hb.heartbeat_interval_ms,
        )  # fmt: skip

    def leave(self, req: pb.LeaveGroupRequest) -> pb.LeaveGroupResponse:
        self.coordinator.leave(req.group, req.member_id)
        return pb.LeaveGroupResponse()

    def expire(self) -> None:
        for group, member in self.coordinator.expire(self.clock_ms()):
            log.info("member %s of group %r left: no heartbeat within its session timeout", member, group)

    async def commit(self, req: pb.CommitOffsetsRequest) -> pb.CommitOffsetsResponse:
        entries = []
        for pc in req.commits:
            try:
                vector = vector_from_proto(pc.vector)
            except InvalidVectorOffset as exc:
                raise InvalidRequest(f"malformed vector offset: {exc}") from None
            entries.append(CommitEntry(pc.topic, pc.partition, vector, pc.hint_offset, pc.metadata))
        group = check_commit_request(req.group, entries)
        for e in entries:
            self.broker.partition(e.topic, e.partition)  # UnknownTopic / UnknownPartition
        self.coordinator.check_commit(group, req.member_id, req.generation, sorted((e.topic, e.partition)
                                                                                    for e in entries))  # fmt: skip
        now = self.clock_ms()
        self.catch_up()
        stamp = self.commits.stamp(now, req.after_hlc, self.broker.identity.site)
        origin = self.broker.origin
        commits = self.commits.new_commits(group, entries, stamp, origin, member_id=req.member_id,
                                           generation=req.generation, now_ms=now)  # fmt: skip
        acks: Acks = acks_from_proto(req.acks, req.geo_sites)
        p, produced = self.broker.append(OFFSETS_TOPIC, offsets_partition(group), commit_batch(commits, now), acks)
        self.commits.record(commits)
        waiter = self.broker.ack_waiter(p, produced, acks, req.ack_timeout_ms)
        if waiter is not None:
            await waiter
        return pb.CommitOffsetsResponse(hlc=stamp, committed_by=str(origin))

    async def fetch_committed(self, req: pb.FetchCommittedRequest) -> pb.FetchCommittedResponse:
        if req.wait_caught_up_ms > 0:
            wait_s = min(req.wait_caught_up_ms, CAUGHT_UP_WAIT_MS_MAX) / 1000
            deadline = time.monotonic() + wait_s
            key = (OFFSETS_TOPIC, offsets_partition(req.group))
            upstreams = await self.upstream_vectors(key, min(wait_s, UPSTREAM_ASK_S))
            log_ = self.broker.partition(*key).log
            while lacks(log_.vector(), upstreams) and time.monotonic() < deadline:
                await asyncio.sleep(CAUGHT_UP_POLL_S)
            if lacks(log_.vector(), upstreams):
                raise CommitsBehind(
                    f"site {self.broker.identity.site} has not caught up, within {req.wait_caught_up_ms} ms, with "
                    f"the commits of group {req.group!r} that a live upstream holds: its committed positions "
                    "could be stale. Retry (a group member retries by itself); if this lasts, check the links "
                    "with 'georep status'"
                )
        self.catch_up()
        if not req.partitions:
            return pb.FetchCommittedResponse(offsets=[self._committed(c) for c in self.table.of_group(req.group)])
        out = []
        for tps in req.partitions:
            for partition in tps.partitions:
                c = self.table.get(req.group, tps.topic, partition)
                if c is not None:
                    out.append(self._committed(c))
        return pb.FetchCommittedResponse(offsets=out)

    def list_groups(self) -> pb.ListGroupsResponse:
        self.catch_up()
        names = sorted(set(self.table.groups()) | {n for n, g in self.coordinator.groups.items() if g.members})
        out = []
        for name in names:
            g = self.coordinator.groups.get(name)
            commits = list(self.table.of_group(name))
            out.append(pb.GroupSummary(
                group=name, members=len(g.members) if g else 0, generation=g.generation if g else 0,
                assignor=g.assignor if g else "", committed_partitions=len(commits),
                lag_records=sum(self.lag(c.topic, c.partition, c.vector) for c in commits),
            ))  # fmt: skip
        return pb.ListGroupsResponse(groups=out)

    def describe(self, req: pb.DescribeGroupRequest) -> pb.GroupDescription:
        self.catch_up()
        g = self.coordinator.groups.get(req.group)
        commits = list(self.table.of_group(req.group))
        if (g is None or not g.members) and not commits:
            raise UnknownGroup(
                f"unknown group {req.group!r} at site {self.broker.identity.site}: no members and no commits here "
                "(list groups with 'georep group list')",
            )
        now = self.clock_ms()
        members = [] if g is None else [
            pb.GroupMember(member_id=m.member_id, client_id=m.client_id,
                           assignment=topic_partitions_to_proto(m.assignment),
                           last_heartbeat_age_ms=now - m.last_heartbeat_ms)
            for _, m in sorted(g.members.items())
        ]  # fmt: skip
        return pb.GroupDescription(
            group=req.group, generation=g.generation if g else 0, assignor=g.assignor if g else "",
            members=members, offsets=[self._committed(c) for c in commits],
        )  # fmt: skip
