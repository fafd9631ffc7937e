"""A consumer's subscription state: which partitions it reads (assigned by hand, every partition of the subscribed
topics, or a group's assignment), where each one starts, and how far the application consumed it.

Per partition, :class:`PartitionState` holds the start (a local offset, the log's earliest or latest, or a vector
offset with the hint of a commit), the *position* (the next local offset ``poll`` returns, at the site that
served it) and the vector of everything consumed (the start vector plus, per origin, the seq after the last
record returned): the position means something at one site only, the vector at every site. It also holds the
queue of decoded responses its fetcher filled (``georep/client/fetcher.py``) and that ``poll`` takes from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from georep.client.topic_pattern import PatternTopics
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.filters import TopicFilter

if TYPE_CHECKING:
    from georep.client.errors import GeorepError
    from georep.client.fetched import ConsumerRecord

TopicPartition = tuple[str, int]
OFFSET_RESETS = ("earliest", "latest", "none")


class Start(NamedTuple):
    kind: str  # "offset", "earliest", "latest", "vector", "none" (no position and auto_offset_reset="none")
    offset: int = -1
    vector: VectorOffset | None = None
    hint_origin: str = ""  # with a vector: a committed local-offset hint, valid at that site@epoch only
    hint_offset: int = -1


class Chunk:
    """Records decoded from one fetch response, and where the stream goes on; or the error that ended it."""

    __slots__ = ("records", "index", "next_offset", "error")

    def __init__(self, records: list[ConsumerRecord], next_offset: int, error: GeorepError | None = None) -> None:
        self.records = records
        self.index = 0
        self.next_offset = next_offset
        self.error = error


class PartitionState:
    __slots__ = (
        "tp",
        "start",
        "position",
        "base_vector",
        "consumed",
        "queue",
        "current",
        "fetcher",
        "served_by",
        "leader",
        "fallback_until",
    )

    def __init__(self, tp: TopicPartition, start: Start, queue_max: int) -> None:
        self.tp = tp
        self.served_by = ""  # site@epoch whose local offsets `position` counts in
        self.leader = ""  # a multi-node site: the address of the node leading the partition, once it answered so
        self.fallback_until = 0.0  # read_from="follower": fetch at the leader until then (time.monotonic())
        self.start = start
        self.position: int | None = start.offset if start.kind == "offset" else None
        self.base_vector = start.vector or VectorOffset()
        self.consumed: dict[Origin, int] = {}
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue(queue_max)
        self.current: Chunk | None = None
        self.fetcher: asyncio.Task[None] | None = None

    def vector(self) -> VectorOffset:
        """The vector offset of everything consumed."""
        if not self.consumed:
            return self.base_vector
        return self.base_vector.merge(VectorOffset(self.consumed))

    def cancel(self) -> None:
        if self.fetcher is not None:
            self.fetcher.cancel()


class SubscriptionState:
    def __init__(self, reset: str, queue_max: int, pattern_refresh_s: float = 5.0) -> None:
        self.reset = reset  # auto_offset_reset
        self.queue_max = queue_max
        self.states: dict[TopicPartition, PartitionState] = {}
        self.subscribed: list[str] = []  # the topics; with a pattern, those it matched at its last refresh
        self.pattern: PatternTopics | None = None
        self.pattern_refresh_s = pattern_refresh_s
        self.resolved_topics: set[str] = set()
        self.subscription_start: Start | None = None  # a seek made before the subscription resolved

    def default_start(self) -> Start:
        if self.subscription_start is not None:
            return self.subscription_start
        return (
            Start("latest")
            if self.reset == "latest"
            else Start("earliest")
            if self.reset == "earliest"
            else Start("none")
        )

    def add(self, tp: TopicPartition, start: Start | None = None) -> PartitionState:
        """``tp`` read from ``start`` (by default the subscription's), unless it is read already."""
        state = self.states.get(tp)
        if state is None:
            state = self.states[tp] = PartitionState(tp, start or self.default_start(), self.queue_max)
        return state

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        wanted = [(str(t), int(p)) for t, p in partitions]
        self.subscribed, self.pattern = [], None
        for tp in list(self.states):
            if tp not in wanted:
                self.drop(tp)
        for tp in wanted:
            self.add(tp)

    def subscribe(self, topics: Iterable[str], pattern: TopicFilter | None = None) -> None:
        self.assign([])
        self.subscribed = list(topics)
        self.pattern = None if pattern is None else PatternTopics(pattern, self.pattern_refresh_s)
        self.resolved_topics = set()
        self.subscription_start = None

    def matched(self, topics: dict[str, int], in_group: bool) -> None:
        """A pattern's topics now (name -> partitions). Outside a group, every partition of them is read (those
        of a topic no longer matched are dropped); a group member's are what its coordinator assigns."""
        self.subscribed = sorted(topics)
        if in_group:
            return
        for tp in [tp for tp in self.states if tp[0] not in topics]:
            self.drop(tp)
        for topic, partitions in topics.items():
            for partition in range(partitions):
                self.add((topic, partition))
        self.resolved_topics = set(topics)

    def drop(self, tp: TopicPartition) -> None:
        self.states.pop(tp).cancel()

    def restart(self, tp: TopicPartition, start: Start) -> None:
        """Read ``tp`` again from ``start``: its fetcher, queue and position start over."""
        old = self.states.get(tp)
        if old is not None:
            old.cancel()
        self.states[tp] = PartitionState(tp, start, self.queue_max)

    def partitions(self, tps: Iterable[TopicPartition] | None) -> list[TopicPartition]:
        return list(self.states) if tps is None else [(str(t), int(p)) for t, p in tps]

    def seek_all(self, tps: Iterable[TopicPartition] | None, start: Start) -> None:
        """``start`` for ``tps`` (by default every partition, and those the subscription resolves later)."""
        if tps is None and (self.subscribed or self.pattern is not None):
            self.subscription_start = start
        for tp in self.partitions(tps):
            self.restart(tp, start)

    def vector_start(self, state: PartitionState) -> Start:
        """Where ``state`` continues at another site: after everything consumed. What was fetched and not yet
        returned is dropped (the other site sends it again)."""
        while not state.queue.empty():
            state.queue.get_nowait()
        state.current = None
        state.position = None
        vector = state.vector()
        if not vector and state.start.kind != "vector":
            # Nothing consumed yet, and a local offset means nothing at another site.
            kind = state.start.kind if state.start.kind in ("earliest", "latest") else self.reset
            return Start("latest") if kind == "latest" else Start("earliest")
        state.base_vector, state.consumed = vector, {}
        return Start("vector", -1, vector)

    def positions_at(self, origin: str) -> dict[TopicPartition, int]:
        """Each partition's position, where it counts in the log of ``origin`` (the commits' hints)."""
        return {tp: s.position for tp, s in self.states.items() if s.position is not None and s.served_by == origin}
