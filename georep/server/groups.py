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
from collections.abc import Callable

import grpc

from cluster.groups import (
    GroupCoordinator,
    IllegalGeneration,
    InvalidGroupRequest,
    NotAssigned,
    UnknownMember,
)
from georep.proto import georep_pb2 as pb
from georep.proto.convert import topic_partitions_to_proto, vector_from_proto, vector_to_proto
from georep.record.batch import CorruptBatch, RecordInput, check_batch, decode_records, encode_batch
from georep.server.broker import Broker, BrokerError
from georep.storage.api import OffsetOutOfRange
from offsets.commits import (
    METADATA_MAX_CHARS,
    OFFSETS_PARTITIONS,
    OFFSETS_TOPIC,
    Commit,
    CommitTable,
    InvalidCommit,
    offsets_partition,
    validate_group,
)
from offsets.coordinates import LocalOffset
from offsets.hlc import HybridClock, unpack
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.filters import is_internal

log = logging.getLogger(__name__)

OFFSETS_TOPIC_CONFIG = {"retention_ms": str(7 * 24 * 3600 * 1000), "flush_interval_ms": "0"}
# A consumer's previous stamp may come from a site whose clock runs ahead; more
# than this ahead of ours is a broken client, and taking it in would push this
# site's clock forward by as much.
AFTER_HLC_AHEAD_MS_MAX = 3600 * 1000
READ_BYTES = 1 << 20
CAUGHT_UP_WAIT_MS_MAX = 30_000
CAUGHT_UP_POLL_S = 0.01


def _group_error(exc: Exception) -> BrokerError:
    if isinstance(exc, UnknownMember):
        return BrokerError(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, IllegalGeneration | NotAssigned):
        return BrokerError(grpc.StatusCode.ABORTED, str(exc))
    return BrokerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class GroupService:
    def __init__(self, broker: Broker, clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self.broker = broker
        self.clock_ms = clock_ms
        self.coordinator = GroupCoordinator(self._partition_count, self._new_member_id)
        self.clock = HybridClock()
        self.table = CommitTable()
        self._cursors: dict[int, int] = {}
        # Whether a live upstream holds records of a partition this site lacks;
        # the replicator replaces it (a standalone node has no upstream).
        self.behind_upstreams: Callable[[tuple[str, int]], bool] = lambda key: False
        if OFFSETS_TOPIC not in broker.metadata.topics():
            broker.create_topic(OFFSETS_TOPIC, OFFSETS_PARTITIONS, OFFSETS_TOPIC_CONFIG)
        self.catch_up()

    def _partition_count(self, topic: str) -> int:
        spec = self.broker.metadata.topics().get(topic)
        return 0 if spec is None or is_internal(topic) else spec.partitions

    @staticmethod
    def _new_member_id(client_id: str) -> str:
        return f"{client_id or 'consumer'}-{uuid.uuid4().hex[:12]}"

    # -- the commit table -------------------------------------------------------

    def catch_up(self) -> None:
        """Fold every commit record this site holds and has not folded yet."""
        for index in range(OFFSETS_PARTITIONS):
            p = self.broker.partition(OFFSETS_TOPIC, index)
            at = max(self._cursors.get(index, 0), p.log.log_start_offset)
            end = p.log.log_end_offset
            while at < end:
                try:
                    res = p.log.read(LocalOffset(at), READ_BYTES)
                except OffsetOutOfRange:
                    at = p.log.log_start_offset
                    continue
                self._fold(res.data, index)
                if res.next_offset <= at:
                    break
                at = res.next_offset
            self._cursors[index] = at

    def _fold(self, data: bytes, index: int) -> None:
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            try:
                header = check_batch(view, pos)
            except CorruptBatch as exc:
                log.error("unreadable batch in %s-%d: %s; commits in it are skipped", OFFSETS_TOPIC, index, exc)
                return
            for record in decode_records(view[pos : pos + header.size_bytes], header):
                if record.value is None:
                    continue
                try:
                    commit = Commit.decode(record.value)
                except InvalidCommit as exc:
                    log.warning("skipping a record of %s-%d at %d: %s", OFFSETS_TOPIC, index, record.offset, exc)
                    continue
                self.clock.observe(commit.hlc)
                self.table.apply(commit)
            pos += header.size_bytes

    def lag(self, topic: str, partition: int, vector: VectorOffset) -> int:
        """Records this site holds for the partition that ``vector`` does not cover (exact: seqs are dense)."""
        try:
            held = self.broker.partition(topic, partition).log.vector()
        except BrokerError:
            return 0
        return sum(max(0, seq - vector.get(origin)) for origin, seq in held.items())

    def _committed(self, c: Commit) -> pb.CommittedOffset:
        return pb.CommittedOffset(
            topic=c.topic, partition=c.partition, vector=vector_to_proto(c.vector), hlc=c.hlc,
            committed_by=str(c.committed_by), hint_offset=c.hint_offset, member_id=c.member_id,
            generation=c.generation, committed_at_ms=c.committed_at_ms, metadata=c.metadata,
            lag_records=self.lag(c.topic, c.partition, c.vector),
        )  # fmt: skip

    # -- RPCs -------------------------------------------------------------------

    def heartbeat(self, req: pb.GroupHeartbeatRequest) -> pb.GroupHeartbeatResponse:
        try:
            group = validate_group(req.group)
            for topic in req.topics:
                if is_internal(topic):
                    raise InvalidGroupRequest(f"topic {topic!r} is internal to georep: subscribe to your own topics")
            hb = self.coordinator.heartbeat(
                group, req.member_id, list(req.topics), req.session_timeout_ms or 10_000, req.assignor or "range",
                self.clock_ms(), req.client_id,
            )  # fmt: skip
        except (InvalidCommit, UnknownMember, IllegalGeneration, NotAssigned, InvalidGroupRequest) as exc:
            raise _group_error(exc) from None
        return pb.GroupHeartbeatResponse(
            member_id=hb.member_id, generation=hb.generation, assignment=topic_partitions_to_proto(hb.assignment),
            heartbeat_interval_ms=hb.heartbeat_interval_ms,
        )  # fmt: skip

    def leave(self, req: pb.LeaveGroupRequest) -> pb.LeaveGroupResponse:
        try:
            self.coordinator.leave(req.group, req.member_id)
        except UnknownMember as exc:
            raise _group_error(exc) from None
        return pb.LeaveGroupResponse()

    def expire(self) -> None:
        for group, member in self.coordinator.expire(self.clock_ms()):
            log.info("member %s of group %r left: no heartbeat within its session timeout", member, group)

    async def commit(self, req: pb.CommitOffsetsRequest) -> pb.CommitOffsetsResponse:
        try:
            group = validate_group(req.group)
        except InvalidCommit as exc:
            raise BrokerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if not req.commits:
            raise BrokerError(grpc.StatusCode.INVALID_ARGUMENT, "a commit needs at least one partition")
        seen: set[tuple[str, int]] = set()
        vectors: list[VectorOffset] = []
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        for c in req.commits:
            key = (c.topic, c.partition)
            if is_internal(c.topic):
                raise BrokerError(invalid, f"cannot commit offsets of internal topic {c.topic!r}")
            if key in seen:
                raise BrokerError(invalid, f"{c.topic}/{c.partition} appears twice in one commit: list it once")
            seen.add(key)
            self.broker.partition(c.topic, c.partition)  # NOT_FOUND for an unknown topic or partition
            if len(c.metadata) > METADATA_MAX_CHARS:
                raise BrokerError(
                    invalid, f"commit metadata is {len(c.metadata)} characters; the limit is {METADATA_MAX_CHARS}"
                )
            try:
                vectors.append(vector_from_proto(c.vector))
            except InvalidVectorOffset as exc:
                raise BrokerError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed vector offset: {exc}") from None
        try:
            self.coordinator.check_commit(group, req.member_id, req.generation, sorted(seen))
        except (UnknownMember, IllegalGeneration, NotAssigned, InvalidGroupRequest) as exc:
            raise _group_error(exc) from None
        now = self.clock_ms()
        if req.after_hlc and unpack(req.after_hlc)[0] > now + AFTER_HLC_AHEAD_MS_MAX:
            raise BrokerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"after_hlc {req.after_hlc} is more than {AFTER_HLC_AHEAD_MS_MAX // 60_000} minutes ahead of site "
                f"{self.broker.identity.site}'s clock: check the clocks of the sites this consumer used",
            )
        self.catch_up()
        stamp = self.clock.now(now, req.after_hlc)
        origin = self.broker.origin
        commits = [
            Commit(group=group, topic=c.topic, partition=c.partition, vector=v, hlc=stamp, committed_by=origin,
                   hint_offset=c.hint_offset if c.hint_offset >= 0 else -1, member_id=req.member_id,
                   generation=req.generation, committed_at_ms=now, metadata=c.metadata)  # fmt: skip
            for c, v in zip(req.commits, vectors, strict=True)
        ]
        batch = encode_batch([RecordInput(c.key(), c.value(), (), now) for c in commits])
        index = offsets_partition(group)
        p, produced = self.broker.append(OFFSETS_TOPIC, index, batch, req.acks, req.geo_sites)
        for c in commits:
            self.table.apply(c)
        waiter = self.broker.ack_waiter(p, produced, req.acks, req.geo_sites, req.ack_timeout_ms)
        if waiter is not None:
            await waiter
        return pb.CommitOffsetsResponse(hlc=stamp, committed_by=str(origin))

    async def fetch_committed(self, req: pb.FetchCommittedRequest) -> pb.FetchCommittedResponse:
        if req.wait_caught_up_ms > 0:
            deadline = time.monotonic() + min(req.wait_caught_up_ms, CAUGHT_UP_WAIT_MS_MAX) / 1000
            key = (OFFSETS_TOPIC, offsets_partition(req.group))
            while self.behind_upstreams(key) and time.monotonic() < deadline:
                await asyncio.sleep(CAUGHT_UP_POLL_S)
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
            raise BrokerError(
                grpc.StatusCode.NOT_FOUND,
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
