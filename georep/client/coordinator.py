"""A consumer's coordinator: its membership in a group at one site, the assignment it applies to the subscription,
and its commits (aiokafka's ``GroupCoordinator``; the fetcher and the subscription state are their own modules).

The coordinator is the node the consumer is connected to (``cluster/groups.py``
on the server) on a one-node site. On a multi-node site it is the leader of the
group's ``__georep_offsets`` partition: another node answers ``NotLeader``
(NOT_COORDINATOR) with the coordinator's address, and every group call here
follows that hint, or asks the site (``DescribeTopic`` of the internal topic)
when there is none or the coordinator went away, and retries, as the producer
follows partition leaders. A new coordinator does not know the member (its
membership is in memory): the member rejoins, and each partition continues
after both its own position and the group's commit, which the new coordinator
reads from the replicated log. The member heartbeats every ``heartbeat_interval_ms``; each
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
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import grpc

from georep.client.connection import Connection
from georep.client.errors import (
    CommitsBehind,
    GeorepError,
    GroupRebalanced,
    InvalidRequest,
    MemberFenced,
    NodeUnavailable,
    NotLeader,
    Operation,
)
from georep.client.errors import from_rpc_error as _from_rpc_error
from georep.client.subscription import Start
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import topic_partitions_to_proto, vector_from_proto, vector_to_proto
from offsets.commits import OFFSETS_TOPIC, offsets_partition
from offsets.vector import VectorOffset

if TYPE_CHECKING:
    from georep.client.fetcher import Fetcher
    from georep.client.subscription import SubscriptionState, TopicPartition

log = logging.getLogger(__name__)

T = TypeVar("T")

COORDINATOR_ATTEMPTS = 12  # per group call: hints followed and coordinators looked up before giving up
COORDINATOR_BACKOFF_S = 0.1
COORDINATOR_BACKOFF_MAX_S = 1.0


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


class Coordinator:
    def __init__(
        self,
        connection: Connection,
        subscription: SubscriptionState,
        fetcher: Fetcher,
        group: str,
        options: GroupOptions,
        timeout_s: float,
    ) -> None:
        self.connection = connection  # the consumer's: the site it reads from, whose group it joins
        self.subscription = subscription
        self.fetcher = fetcher
        self.group = group
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
        # A multi-node site: the group's coordinator when it is not the node the consumer is connected to.
        self._coordinator: Connection | None = None
        self._answered = time.monotonic()  # when a coordinator last answered a heartbeat
        self._timeout_s = timeout_s
        self._next_auto_commit = 0.0
        self._auto_commit: asyncio.Task[None] | None = None

    @property
    def lapsed(self) -> bool:
        """No coordinator has answered for a whole session: the consumer delivers nothing until one does.

        The group may have given this member's partitions to others meanwhile (its session expired, or a new
        coordinator took over and does not know it), and they start at the group's commit and commit further;
        records this member went on delivering could be ones those commits cover. Kafka's consumer stops likewise
        when it cannot reach its coordinator. A new coordinator waits a session before it assigns anything
        (``cluster.groups.takeover_hold_until``), so by then every member of the previous one has stopped."""
        return self.started and time.monotonic() - self._answered > self.options.session_timeout_ms / 1000

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        try:
            await self.heartbeat()
        except CommitsBehind as exc:
            # The site could not yet vouch for the group's commits (an upstream slow to answer): retried by the
            # heartbeat task, as later in the member's life, not raised out of poll() as if it were the caller's.
            log.info("group %r: %s", self.group, exc.message)
        self._task = asyncio.create_task(self._run(), name=f"georep-heartbeat-{self.group}")

    async def _run(self) -> None:
        connection = self.connection
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
            except NotLeader as exc:
                # No coordinator yet (a multi-node site electing the leader of the group's offsets partition).
                log.info("group %r: %s; trying again", self.group, exc.message)
            except CommitsBehind as exc:
                # The assignment is applied again at the next heartbeat, from commits that are not stale.
                log.info("group %r: %s", self.group, exc.message)
            except GeorepError as exc:
                self.error = exc

    async def heartbeat(self) -> None:
        """One heartbeat (a join if the member has no id at this site); applies a new assignment."""
        async with self._lock:
            connection = self.connection
            await connection.connect()
            site = connection.origin
            moved = bool(self.site) and site != self.site
            if moved:
                log.info("group %r: now at site %s (was %s): joining there", self.group, site, self.site)
                self.member_id = ""
            try:
                resp = await self._call()
            except MemberFenced:
                # Its session expired, or (a multi-node site) the group's coordinator changed: it knows no member.
                log.warning(
                    "group %r: member %s is not known to the coordinator (session expired, or a new "
                    "coordinator): rejoining",
                    self.group,
                    self.member_id,
                )
                self.member_id = ""
                moved = True
                resp = await self._call()
            self._answered = time.monotonic()
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
                await self.apply_assignment(assignment, moved)
                self._moved_pending = False
            self.generation = resp.generation

    async def _call(self) -> pb.GroupHeartbeatResponse:
        request = pb.GroupHeartbeatRequest(
            group=self.group,
            member_id=self.member_id,
            topics=self.subscription.subscribed,  # a pattern's topics as last resolved (topic_pattern.py)
            session_timeout_ms=self.options.session_timeout_ms,
            assignor=self.options.assignor,
            client_id=self.options.client_id,
        )
        return await self._rpc(lambda stub: stub.GroupHeartbeat(request, timeout=self._timeout_s))

    # -- finding the coordinator ------------------------------------------------

    async def _rpc(self, call: Callable[[pbg.NodeAsyncStub], Awaitable[T]]) -> T:
        """``call`` at the group's coordinator: following ``NotLeader`` hints, and looking the coordinator up again
        when it went away. Raises the last error after ``COORDINATOR_ATTEMPTS``; ``NodeUnavailable`` of the node
        the consumer is connected to at once (its owner reconnects)."""
        backoff_s = COORDINATOR_BACKOFF_S
        error: GeorepError | None = None
        for _attempt in range(COORDINATOR_ATTEMPTS):
            main = self.connection
            await main.connect()
            coordinator = self._coordinator
            if coordinator is not None and coordinator.origin and coordinator.origin != main.origin:
                await self._drop_coordinator()  # the consumer moved to another site: its coordinator is there
                coordinator = None
            connection = coordinator if coordinator is not None else main
            try:
                stub = await connection.connect()
                return await connection.unary(call(stub))
            except grpc.RpcError as exc:
                error = _from_rpc_error(exc, connection.address, operation=Operation.GROUP)
            except NodeUnavailable as exc:
                error = exc
            if isinstance(error, NotLeader):
                if await self._follow(error.leader, connection):
                    continue  # a new address: no need to wait
            elif isinstance(error, NodeUnavailable) and connection is not main:
                log.info(
                    "group %r: coordinator %s went away (%s): asking the site for the next one",
                    self.group,
                    connection.address or ", ".join(connection.addresses),
                    error.message,
                )
                await self._drop_coordinator()
            else:
                raise error
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, COORDINATOR_BACKOFF_MAX_S)
        if isinstance(error, NodeUnavailable):
            # Only a coordinator's connection gets here (the connected node's failure is raised at once): say so,
            # so that the heartbeat loop does not replace a connection that works.
            raise NotLeader(
                f"no coordinator of group {self.group!r} answered ({error.message}); the site may be "
                "electing one: retry",
                error.code,
            )
        assert error is not None
        raise error

    async def _follow(self, hint: str, tried: Connection) -> bool:
        """Route group calls to ``hint`` (or, without one, to the leader the site names); True if that is another
        node than the one just ``tried``."""
        main = self.connection
        address = hint or await self._find()
        if not address or address == tried.address:
            await self._drop_coordinator()
            return False
        if address == main.address:
            await self._drop_coordinator()
            return True
        if self._coordinator is None or self._coordinator.addresses != [address]:
            await self._drop_coordinator()
            self._coordinator = Connection(address, int(main.connect_timeout_s * 1000), main.tls)
        return True

    async def _find(self) -> str:
        """The coordinator's address as the connected node's metadata names it (``DescribeTopic`` of the internal
        topic: the leader of the group's partition), or "" if none is known now."""
        main = self.connection
        try:
            stub = await main.connect()
            description = await main.unary(
                stub.DescribeTopic(pb.DescribeTopicRequest(name=OFFSETS_TOPIC), timeout=self._timeout_s)
            )
        except (grpc.RpcError, GeorepError):
            return ""
        index = offsets_partition(self.group)
        return next((leader.address for leader in description.leaders if leader.partition == index), "")

    async def _drop_coordinator(self) -> None:
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            await coordinator.close()

    async def fetch_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, Committed]:
        request = pb.FetchCommittedRequest(
            group=self.group,
            partitions=topic_partitions_to_proto(tps),
            wait_caught_up_ms=self.options.commit_wait_caught_up_ms,
        )
        resp = await self._rpc(
            lambda stub: stub.FetchCommitted(request, timeout=self._timeout_s + request.wait_caught_up_ms / 1000)
        )
        return {
            (c.topic, c.partition): Committed(
                vector_from_proto(c.vector), c.committed_by, c.hint_offset, c.hlc, c.committed_at_ms, c.lag_records
            )
            for c in resp.offsets
        }

    async def commit(
        self, offsets: Mapping[TopicPartition, VectorOffset], hints: Mapping[TopicPartition, int], member: bool
    ) -> None:
        """Commit ``offsets``; ``member``: as this group member (else a standalone commit)."""
        if not offsets:
            return
        for attempt in range(2):
            acks, geo_sites = self.options.commit_acks
            request = pb.CommitOffsetsRequest(
                group=self.group,
                member_id=self.member_id if member else "",
                generation=self.generation if member else -1,
                acks=acks,
                geo_sites=geo_sites,
                ack_timeout_ms=int(self._timeout_s * 1000),
                after_hlc=self.last_hlc,
                commits=[
                    pb.PartitionCommit(
                        topic=t, partition=p, vector=vector_to_proto(v), hint_offset=hints.get((t, p), -1)
                    )
                    for (t, p), v in sorted(offsets.items())
                ],
            )
            try:
                resp = await self._rpc(self._commit_call(request))
            except GeorepError as error:
                if isinstance(error, GroupRebalanced) and member and attempt == 0:
                    # The group moved on since our last heartbeat: learn the new
                    # assignment, then commit what is still ours.
                    await self.heartbeat()
                    owned = set(self.subscription.states)
                    offsets = {tp: v for tp, v in offsets.items() if tp in owned}
                    if not offsets:
                        raise GroupRebalanced(
                            f"{error.message}; none of the partitions to commit is assigned to this member now",
                            error.code,
                        ) from None
                    continue
                raise
            self.last_hlc = max(self.last_hlc, resp.hlc)
            return

    def _commit_call(
        self, request: pb.CommitOffsetsRequest
    ) -> Callable[[pbg.NodeAsyncStub], Awaitable[pb.CommitOffsetsResponse]]:
        return lambda stub: stub.CommitOffsets(request, timeout=self._timeout_s + 1)

    # -- the consumer's side -------------------------------------------------------

    async def apply_assignment(self, assignment: set[TopicPartition], moved: bool) -> None:
        """This member's new assignment: partitions it lost are dropped, partitions it gained start at the group's
        committed vector, and (``moved``: at another site) every partition goes on after both what it consumed and
        what the group committed."""
        subscription = self.subscription
        for tp in list(subscription.states):
            if tp not in assignment:
                subscription.drop(tp)
        need = sorted(tp for tp in assignment if moved or tp not in subscription.states)
        committed = await self.fetch_committed(need) if need else {}
        for tp in need:
            c = committed.get(tp)
            state = subscription.states.get(tp)
            if state is None:
                subscription.add(
                    tp, None if c is None else Start("vector", -1, c.vector, c.committed_by, c.hint_offset)
                )
            elif c is not None and not c.vector.dominated_by(state.vector()):
                # Another member committed past what this one consumed (it owned the partition meanwhile): go on
                # after both.
                subscription.restart(tp, Start("vector", -1, state.vector().merge(c.vector)))
        self.fetcher.start()

    async def commit_consumed(self, offsets: dict[TopicPartition, VectorOffset] | None, member: bool) -> None:
        """Commit ``offsets``, by default the vector of everything ``poll`` returned for every assigned partition
        (with each one's position as the hint, where it counts in the connected site's log)."""
        if offsets is None:
            offsets = {tp: s.vector() for tp, s in self.subscription.states.items()}
            hints = self.subscription.positions_at(self.connection.origin)
        else:
            hints = {}
        await self.commit(offsets, hints, member=member)

    def maybe_auto_commit(self) -> None:
        """With auto-commit on, commit in the background every ``auto_commit_interval_ms``."""
        if not self.options.enable_auto_commit or not self.member_id:
            return
        now = time.monotonic()
        if now < self._next_auto_commit or (self._auto_commit is not None and not self._auto_commit.done()):
            return
        self._next_auto_commit = now + self.options.auto_commit_interval_ms / 1000
        self._auto_commit = asyncio.create_task(self._auto_commit_once(), name="georep-auto-commit")

    async def _auto_commit_once(self) -> None:
        try:
            await self.commit_consumed(None, member=True)
        except GeorepError as exc:
            log.warning("auto-commit of group %r failed: %s", self.group, exc.message)

    async def close(self) -> None:
        """Commit what was consumed (with auto-commit on), then leave, so others take over at once."""
        if self.options.enable_auto_commit and self.member_id:
            try:
                await self.commit_consumed(None, member=True)
            except GeorepError as exc:
                log.warning("final commit of group %r failed: %s", self.group, exc.message)
        await self.leave()

    async def leave(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.member_id:
            request = pb.LeaveGroupRequest(group=self.group, member_id=self.member_id)
            with contextlib.suppress(GeorepError, grpc.RpcError):
                await self._rpc(lambda stub: stub.LeaveGroup(request, timeout=self._timeout_s))
            self.member_id = ""
        await self._drop_coordinator()


def check_group(group: str | None) -> str:
    if not group:
        raise InvalidRequest("this needs a consumer group: pass group_id= to Consumer or subscribe(topics, group=...)")
    return group
