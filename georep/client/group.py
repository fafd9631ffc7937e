"""A consumer's membership in a group at one site, and its commits.

The coordinator is the node the consumer is connected to (``cluster/groups.py``
on the server). The member heartbeats every ``heartbeat_interval_ms``; each
answer carries the generation and the assignment, and a new generation makes
the consumer apply the new assignment: partitions it lost are dropped,
partitions it gained start at the group's committed vector.

When the consumer's connection moves to another site (its site failed and the
bootstrap list names another), the member joins the group there afresh. Each
partition then continues after *both* what this consumer consumed and what
the group committed, their pointwise max: between the two sites another member
may have owned the partition and committed past this consumer's position, and
what either covers was delivered already.

A commit carries the stamp of this consumer's previous commit (``after_hlc``),
so its commits order after one another at every site, whatever the sites'
clocks say, and a commit that arrives late somewhere never wins over a newer
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc

from georep.client.errors import (
    CommitsBehind,
    GeorepError,
    GroupRebalanced,
    InvalidRequest,
    MemberFenced,
    NodeUnavailable,
)
from georep.client.errors import from_rpc_error as _from_rpc_error
from georep.proto import georep_pb2 as pb
from georep.proto.convert import topic_partitions_to_proto, vector_from_proto, vector_to_proto
from offsets.vector import VectorOffset

if TYPE_CHECKING:
    from georep.client.consumer import Consumer, TopicPartition

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupOptions:
    session_timeout_ms: int = 10_000
    assignor: str = "range"
    client_id: str = ""
    enable_auto_commit: bool = True
    auto_commit_interval_ms: int = 5_000
    commit_acks: tuple[pb.Acks.ValueType, int] = (pb.ACKS_LEADER, 0)
    commit_wait_caught_up_ms: int = 5_000


class Committed(NamedTuple):
    """A group's committed position for one partition, as the site read from holds it."""

    vector: VectorOffset
    committed_by: str  # site@epoch
    hint_offset: int
    hlc: int
    committed_at_ms: int
    lag_records: int


class GroupMembership:
    def __init__(self, consumer: Consumer, group: str, topics: list[str], options: GroupOptions) -> None:
        self.consumer = consumer
        self.group = group
        self.topics = topics
        self.options = options
        self.member_id = ""
        self.generation = -1
        self.site = ""  # site@epoch of the coordinator the member joined
        self.interval_ms = min(1000, options.session_timeout_ms // 3)
        self.last_hlc = 0
        self.error: GeorepError | None = None
        self._moved_pending = False  # a move to another site whose assignment is not applied yet
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def _timeout_s(self) -> float:
        return self.consumer._request_timeout_s

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        await self.heartbeat()
        self._task = asyncio.create_task(self._run(), name=f"georep-heartbeat-{self.group}")

    async def _run(self) -> None:
        connection = self.consumer._connection
        while True:
            # A channel the fetchers replaced (their site failed) means a new
            # coordinator: heartbeat there at once rather than after the interval.
            await asyncio.wait([connection.opened()], timeout=self.interval_ms / 1000)
            generation = connection.generation
            try:
                await self.heartbeat()
                self.error = None
            except NodeUnavailable as exc:
                # Replace the channel the heartbeat failed on, not one another task opened since.
                log.info("group %r: heartbeat failed (%s); reconnecting", self.group, exc.message)
                with contextlib.suppress(GeorepError):
                    await connection.reconnect(generation)
            except CommitsBehind as exc:
                # The assignment is applied again at the next heartbeat, from commits that are not stale.
                log.info("group %r: %s", self.group, exc.message)
            except GeorepError as exc:
                self.error = exc

    async def heartbeat(self) -> None:
        """One heartbeat (a join if the member has no id at this site); applies a new assignment."""
        async with self._lock:
            connection = self.consumer._connection
            stub = await connection.connect()
            site = connection.origin
            moved = bool(self.site) and site != self.site
            if moved:
                log.info("group %r: now at site %s (was %s): joining there", self.group, site, self.site)
                self.member_id = ""
            try:
                resp = await self._call(stub)
            except MemberFenced:
                log.warning("group %r: member %s was fenced (session expired): rejoining", self.group, self.member_id)
                self.member_id = ""
                moved = True
                resp = await self._call(stub)
            moved = moved or self._moved_pending
            new_generation = resp.generation != self.generation or resp.member_id != self.member_id
            self.member_id, self.site = resp.member_id, site
            self.interval_ms = resp.heartbeat_interval_ms or self.interval_ms
            if new_generation or moved:
                assignment = {(t.topic, p) for t in resp.assignment for p in t.partitions}
                # The generation is recorded only once its assignment is applied: if
                # applying fails (reading the commits timed out), the next heartbeat
                # applies it again instead of leaving partitions with no reader.
                self.generation = -1
                self._moved_pending = moved
                await self.consumer._apply_assignment(assignment, moved)
                self._moved_pending = False
            self.generation = resp.generation

    async def _call(self, stub: object) -> pb.GroupHeartbeatResponse:
        request = pb.GroupHeartbeatRequest(
            group=self.group, member_id=self.member_id, topics=self.topics,
            session_timeout_ms=self.options.session_timeout_ms, assignor=self.options.assignor,
            client_id=self.options.client_id,
        )  # fmt: skip
        try:
            connection = self.consumer._connection
            resp: pb.GroupHeartbeatResponse = await connection.unary(
                connection.stub.GroupHeartbeat(request, timeout=self._timeout_s)
            )
        except grpc.RpcError as exc:
            raise _from_rpc_error(exc, self.consumer._connection.address) from None
        return resp

    async def fetch_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, Committed]:
        stub = await self.consumer._connection.connect()
        request = pb.FetchCommittedRequest(group=self.group, partitions=topic_partitions_to_proto(tps),
                                           wait_caught_up_ms=self.options.commit_wait_caught_up_ms)  # fmt: skip
        try:
            resp = await self.consumer._connection.unary(
                stub.FetchCommitted(request, timeout=self._timeout_s + request.wait_caught_up_ms / 1000)
            )
        except grpc.RpcError as exc:
            raise _from_rpc_error(exc, self.consumer._connection.address) from None
        return {
            (c.topic, c.partition): Committed(vector_from_proto(c.vector), c.committed_by, c.hint_offset, c.hlc,
                                              c.committed_at_ms, c.lag_records)  # fmt: skip
            for c in resp.offsets
        }

    async def commit(
        self, offsets: Mapping[TopicPartition, VectorOffset], hints: Mapping[TopicPartition, int], member: bool
    ) -> None:
        """Commit ``offsets``; ``member``: as this group member (else a standalone commit)."""
        if not offsets:
            return
        for attempt in range(2):
            stub = await self.consumer._connection.connect()
            acks, geo_sites = self.options.commit_acks
            request = pb.CommitOffsetsRequest(
                group=self.group, member_id=self.member_id if member else "",
                generation=self.generation if member else -1, acks=acks, geo_sites=geo_sites,
                ack_timeout_ms=int(self._timeout_s * 1000), after_hlc=self.last_hlc,
                commits=[pb.PartitionCommit(topic=t, partition=p, vector=vector_to_proto(v),
                                            hint_offset=hints.get((t, p), -1))
                         for (t, p), v in sorted(offsets.items())],
            )  # fmt: skip
            try:
                resp = await self.consumer._connection.unary(stub.CommitOffsets(request, timeout=self._timeout_s + 1))
            except grpc.RpcError as exc:
                error = _from_rpc_error(exc, self.consumer._connection.address)
                if isinstance(error, GroupRebalanced) and member and attempt == 0:
                    # The group moved on since our last heartbeat: learn the new
                    # assignment, then commit what is still ours.
                    await self.heartbeat()
                    owned = set(self.consumer.assignment())
                    offsets = {tp: v for tp, v in offsets.items() if tp in owned}
                    if not offsets:
                        raise GroupRebalanced(
                            f"{error.message}; none of the partitions to commit is assigned to this member now",
                            error.code,
                        ) from None
                    continue
                raise error from None
            self.last_hlc = max(self.last_hlc, resp.hlc)
            return

    async def leave(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if not self.member_id:
            return
        with contextlib.suppress(GeorepError, grpc.RpcError):
            stub = await self.consumer._connection.connect()
            await self.consumer._connection.unary(stub.LeaveGroup(
                pb.LeaveGroupRequest(group=self.group, member_id=self.member_id), timeout=self._timeout_s))  # fmt: skip
        self.member_id = ""


def check_group(group: str | None) -> str:
    if not group:
        raise InvalidRequest("this needs a consumer group: pass group_id= to Consumer or subscribe(topics, group=...)")
    return group
