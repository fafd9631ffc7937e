"""Consumer groups at one site: membership, server-side assignment, generations.

Pure: time comes in as ``now_ms`` and member ids from a callable, so the
simulator and the unit tests drive it without a clock or a network. The node
wraps it in ``georep/server/groups.py``.

The protocol is heartbeat-driven, like Kafka's KIP-848 consumer protocol: a
member joins by heartbeating with no member id, and every heartbeat answers
with the group's generation and the member's assignment. A join, a leave, an
expired session or a change in the subscribed topics' partition counts is a
rebalance: the generation goes up by one and the assignment is recomputed on
the server, by the ``range`` or the ``sticky`` assignor.

A commit carries the member id and generation it was made under. It is
refused if the member is unknown (its session expired: it is fenced), if the
generation is not the current one (a rebalance happened: heartbeat, then
commit again), or if a partition is not assigned to the member. So a partition
that moved to another member can never be committed by its former owner, and
the new owner starts exactly at the last commit the coordinator accepted.
A commit with no member id and generation -1 is a standalone commit (a
consumer using ``assign``), accepted only while the group has no members.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

TopicPartition = tuple[str, int]

ASSIGNORS = ("range", "sticky")
SESSION_TIMEOUT_MS_MIN = 1_000
SESSION_TIMEOUT_MS_MAX = 300_000
HEARTBEAT_INTERVAL_MS_MAX = 1_000


class GroupError(Exception):
    """Base of the errors a member causes; each says what to do."""


class UnknownMember(GroupError):
    """The member id is not in the group: its session expired or it left. Rejoin with no member id."""


class IllegalGeneration(GroupError):
    """The group rebalanced since the member last heartbeated: heartbeat, then retry."""


class NotAssigned(GroupError):
    """A commit for a partition the member does not own."""


class InvalidGroupRequest(GroupError):
    """A malformed join (bad assignor, bad session timeout, no topics)."""


@dataclass
class Member:
    member_id: str
    client_id: str
    topics: tuple[str, ...]
    session_timeout_ms: int
    last_heartbeat_ms: int
    assignment: tuple[TopicPartition, ...] = ()


@dataclass
class Group:
    name: str
    assignor: str
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    # partition counts the last assignment was computed from
    partition_counts: dict[str, int] = field(default_factory=dict)
    # A new coordinator's hold (``takeover_hold_until``): no partition is assigned before this time.
    hold_until_ms: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    member_id: str
    generation: int
    assignment: tuple[TopicPartition, ...]
    heartbeat_interval_ms: int


def heartbeat_interval_ms(session_timeout_ms: int) -> int:
    return min(HEARTBEAT_INTERVAL_MS_MAX, session_timeout_ms // 3)


def _subscribed_partitions(topics: Iterable[str], counts: Mapping[str, int]) -> list[TopicPartition]:
    return [(t, p) for t in sorted(set(topics)) for p in range(counts.get(t, 0))]


def range_assign(
    members: Mapping[str, tuple[str, ...]], counts: Mapping[str, int]
) -> dict[str, tuple[TopicPartition, ...]]:
    """Kafka's range assignor: per topic, contiguous ranges over the sorted subscribers."""
    out: dict[str, list[TopicPartition]] = {m: [] for m in members}
    for topic in sorted({t for topics in members.values() for t in topics}):
        subscribers = sorted(m for m, topics in members.items() if topic in topics)
        n = counts.get(topic, 0)
        if not subscribers or n == 0:
            continue
        per, extra = divmod(n, len(subscribers))
        start = 0
        for i, m in enumerate(subscribers):
            size = per + (1 if i < extra else 0)
            out[m].extend((topic, p) for p in range(start, start + size))
            start += size
    return {m: tuple(tps) for m, tps in out.items()}


def sticky_assign(
    members: Mapping[str, tuple[str, ...]],
    counts: Mapping[str, int],
    previous: Mapping[str, tuple[TopicPartition, ...]],
) -> dict[str, tuple[TopicPartition, ...]]:
    """Balanced, and moves as few partitions as it can: a member keeps what it
    had, up to its fair share; freed and new partitions go to the least loaded
    subscribers."""
    out: dict[str, list[TopicPartition]] = {m: [] for m in members}
    owner: dict[TopicPartition, str] = {}
    for m in sorted(members):
        for tp in previous.get(m, ()):
            if tp[0] in members[m] and tp[1] < counts.get(tp[0], 0) and tp not in owner:
                owner[tp] = m
                out[m].append(tp)
    every = sorted({tp for m, topics in members.items() for tp in _subscribed_partitions(topics, counts)})
    if not members:
        return {}
    # Fair share: with P partitions and M members, nobody holds more than ceil(P/M).
    # (With members subscribed to different topics this is a bound, not an exact balance.)
    limit = -(-len(every) // len(members)) if every else 0
    for m in sorted(members):
        while len(out[m]) > limit:
            tp = out[m].pop()
            del owner[tp]
    for tp in every:
        if tp in owner:
            continue
        candidates = [m for m in members if tp[0] in members[m]]
        best = min(candidates, key=lambda m: (len(out[m]), m))
        owner[tp] = best
        out[best].append(tp)
    # Even out what the fair-share cut left uneven (members at limit vs. far below it).
    for _ in range(len(every)):
        loads = sorted(out, key=lambda m: (len(out[m]), m))
        low, high = loads[0], loads[-1]
        movable = [tp for tp in out[high] if tp[0] in members[low]]
        if len(out[high]) - len(out[low]) <= 1 or not movable:
            break
        tp = movable[-1]
        out[high].remove(tp)
        out[low].append(tp)
    return {m: tuple(sorted(tps)) for m, tps in out.items()}


class GroupCoordinator:
    """Every consumer group of one site."""

    def __init__(self, partition_counts: Callable[[str], int], new_member_id: Callable[[str], str]) -> None:
        self._counts = partition_counts  # topic -> partitions (0 if the topic does not exist here)
        self._new_member_id = new_member_id
        self.groups: dict[str, Group] = {}

    def heartbeat(
        self,
        group: str,
        member_id: str,
        topics: Iterable[str],
        session_timeout_ms: int,
        assignor: str,
        now_ms: int,
        client_id: str = "",
        hold_until_ms: int = 0,
    ) -> Heartbeat:
        wanted = tuple(sorted(set(topics)))
        if not wanted:
            raise InvalidGroupRequest(f"member of group {group!r} subscribes to no topic: subscribe to at least one")
        if assignor not in ASSIGNORS:
            raise InvalidGroupRequest(f"unknown assignor {assignor!r}: use one of {', '.join(ASSIGNORS)}")
        if not SESSION_TIMEOUT_MS_MIN <= session_timeout_ms <= SESSION_TIMEOUT_MS_MAX:
            raise InvalidGroupRequest(
                f"session_timeout_ms={session_timeout_ms} outside {SESSION_TIMEOUT_MS_MIN}..{SESSION_TIMEOUT_MS_MAX}"
            )
        g = self.groups.get(group)
        if g is None or not g.members:
            g = self.groups[group] = Group(
                group,
                assignor,
                generation=g.generation if g else 0,
                hold_until_ms=max(hold_until_ms, g.hold_until_ms if g else 0),
            )
        elif assignor != g.assignor:
            raise InvalidGroupRequest(
                f"group {group!r} uses the {g.assignor} assignor; its members must all use it (this one asked for "
                f"{assignor})"
            )
        if member_id:
            member = g.members.get(member_id)
            if member is None:
                raise UnknownMember(
                    f"member {member_id} is not in group {group!r} (its session expired or it left): rejoin"
                )
            member.last_heartbeat_ms = now_ms
            member.session_timeout_ms = session_timeout_ms
            if member.topics != wanted:
                member.topics = wanted
                self._rebalance(g)
        else:
            member = Member(self._new_member_id(client_id), client_id, wanted, session_timeout_ms, now_ms)
            g.members[member.member_id] = member
            self._rebalance(g)
        if self._counts_changed(g):
            self._rebalance(g)
        self._release(g, now_ms)
        return Heartbeat(member.member_id, g.generation, member.assignment, heartbeat_interval_ms(session_timeout_ms))

    def leave(self, group: str, member_id: str) -> None:
        g = self.groups.get(group)
        if g is None or g.members.pop(member_id, None) is None:
            raise UnknownMember(f"member {member_id} is not in group {group!r}: nothing to leave")
        self._rebalance(g)

    def expire(self, now_ms: int) -> list[tuple[str, str]]:
        """Remove members whose session timed out; returns ``(group, member_id)`` of each."""
        gone: list[tuple[str, str]] = []
        for name in sorted(self.groups):
            g = self.groups[name]
            dead = [
                m
                for m, member in sorted(g.members.items())
                if now_ms - member.last_heartbeat_ms > member.session_timeout_ms
            ]
            for m in dead:
                del g.members[m]
                gone.append((name, m))
            if dead or (g.members and self._counts_changed(g)):
                self._rebalance(g)
            self._release(g, now_ms)
        return gone

    def _release(self, g: Group, now_ms: int) -> None:
        """End a hold that is over: the members get their partitions at their next heartbeat."""
        if g.hold_until_ms and now_ms >= g.hold_until_ms:
            g.hold_until_ms = 0
            if g.members:
                self._rebalance(g)

    def check_commit(self, group: str, member_id: str, generation: int, partitions: Iterable[TopicPartition]) -> None:
        g = self.groups.get(group)
        if not member_id:
            if generation != -1:
                raise InvalidGroupRequest("a commit without a member id must use generation -1")
            if g is not None and g.members:
                raise UnknownMember(
                    f"group {group!r} has {len(g.members)} active member(s): only its members may commit; "
                    "subscribe with the group instead of assigning partitions"
                )
            return
        member = g.members.get(member_id) if g is not None else None
        if g is None or member is None:
            raise UnknownMember(f"member {member_id} is not in group {group!r} (session expired or left): rejoin")
        if generation != g.generation:
            raise IllegalGeneration(
                f"group {group!r} is at generation {g.generation}, the commit was made at {generation}: "
                "the group rebalanced; heartbeat to get the new assignment, then commit again"
            )
        owned = set(member.assignment)
        for tp in partitions:
            if tp not in owned:
                raise NotAssigned(f"{tp[0]}/{tp[1]} is not assigned to member {member_id} of group {group!r}")

    def _counts_changed(self, g: Group) -> bool:
        topics = {t for m in g.members.values() for t in m.topics}
        return any(self._counts(t) != g.partition_counts.get(t, 0) for t in topics)

    def _rebalance(self, g: Group) -> None:
        g.generation += 1
        subscriptions = {m: member.topics for m, member in g.members.items()}
        counts = {t: self._counts(t) for t in sorted({t for ts in subscriptions.values() for t in ts})}
        g.partition_counts = counts
        if g.assignor == "range":
            assignment = range_assign(subscriptions, counts)
        else:
            previous = {m: member.assignment for m, member in g.members.items()}
            assignment = sticky_assign(subscriptions, counts, previous)
        held = g.hold_until_ms > 0
        for m, member in g.members.items():
            member.assignment = () if held else assignment.get(m, ())


# -- coordinators on a multi-node site ------------------------------------------------------------------------

# What a node leads of one ``__georep_offsets`` partition: (leader epoch, open segment id) of its chain log.
LeadToken = tuple[int, int]
FIRST_EPOCH = 1  # a partition's first leader's epoch (the metadata's ElectLeader counts from 0)


@dataclass(frozen=True, slots=True)
class LeadStep:
    """What a node must drop when what it leads of the offsets partitions changes (:func:`lead_step`)."""

    forget_members: tuple[int, ...]  # offsets partitions whose groups' membership is no longer this node's
    refold: tuple[int, ...]  # offsets partitions whose commits must be folded again, from the log's start
    taken_over: tuple[int, ...] = ()  # offsets partitions this node now leads at a new leader epoch


def lead_step(before: Mapping[int, LeadToken], now: Mapping[int, LeadToken]) -> LeadStep:
    """A group's coordinator is the leader of its ``__georep_offsets`` partition (Kafka's rule for
    ``__consumer_offsets``), so a node's groups follow what it leads:

    * a partition it no longer leads, or leads at another leader epoch, loses its groups' members: they were
      (or may have been) coordinated elsewhere meanwhile, and a member id from an older term must rejoin
      rather than hold partitions until its session expires. Membership is in memory, as on a one-node site;
      the committed positions are in the log, so a rejoin loses none of them.
    * a partition it no longer leads, or leads over another chain (a new epoch or a roll), is folded again
      from its start: the table may hold a commit this node appended that a recovery or a roll's seal cut
      (it was never confirmed), and it lacks what other leaders appended meanwhile. What the log keeps is
      the truth; a fold of it gives every node the same winners.

    A roll under the same leader epoch keeps the members (the coordinator did not change).

    * ``taken_over`` lists the partitions it now leads at a new leader epoch *above the first*: at epoch 1 no
      coordinator came before it, and a node that restarted never leads at an epoch granted before its restart
      (``cluster/leadership.py``, ``granted_to_this_incarnation``), so every member of the group's past joined
      this one. Counting epoch 1 held a group that committed right after its offsets partition was made, on its
      first use, for a session timeout (tests/test_group_coordinators.py)."""
    forget = sorted(i for i, token in before.items() if i not in now or now[i][0] != token[0])
    refold = sorted(i for i, token in before.items() if now.get(i) != token)
    refold += sorted(i for i in now if i not in before)
    taken_over = sorted(
        i for i, token in now.items() if token[0] > FIRST_EPOCH and (i not in before or before[i][0] != token[0])
    )
    return LeadStep(tuple(forget), tuple(sorted(set(refold))), tuple(taken_over))


def takeover_hold_until(taken_over_ms: int | None, session_timeout_ms: int, has_commits: bool) -> int:
    """When a group that (re)joins a coordinator that took its offsets partition over at ``taken_over_ms`` may be
    given partitions (0: at once).

    The members of the previous coordinator do not all learn of the change at once: one that has not yet found
    the new coordinator still reads the partitions it owned, and if another member were given them meanwhile,
    started at the group's commit and committed further, the first one could deliver records that commit covers.
    A member gives its partitions up once it has had no answer from a coordinator for its session timeout
    (``georep/client/group.py``), as Kafka's does; the previous coordinator's last answer came before the takeover,
    so a session timeout after the takeover every such member has given up or rejoined. Kafka's coordinator
    waits likewise for the previous generation's members (its rebalance timeout). A group with no commit has
    nothing a delivery could go behind (a new topic's first coordinator holds none), and ``None`` is a
    one-node site's coordinator, which never takes over: neither is held."""
    if taken_over_ms is None or not has_commits:
        return 0
    return taken_over_ms + session_timeout_ms


def forget_groups(
    coordinator: GroupCoordinator, partitions: Iterable[int], partition_of: Callable[[str], int]
) -> list[str]:
    """Drop the membership of every group whose offsets partition is in ``partitions``; returns their names."""
    dropped = set(partitions)
    gone = sorted(name for name in coordinator.groups if partition_of(name) in dropped)
    for name in gone:
        del coordinator.groups[name]
    return gone
