"""What an idle replication link costs, and what delta heartbeats still catch (issue 22, "Links").

A source's heartbeat carries only the partitions whose durable state moved since the stream last told the dst, plus
a rotating few (``REANNOUNCE``); it looks only at partitions a flush named. These tests pin that an idle link's work
does not grow with the partition count, and that a lost last message is still found (session.py's lost-tail rule),
driving a ``ReplicaSource`` and a ``PullSession`` by hand over ``MemoryLog``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from georep.record.batch import parse_header
from georep.replication.links import LinkManager
from georep.replication.session import ApplyChunks, Effect, LinkEvent, OpenStream, PullConfig, PullSession
from georep.replication.sink import apply_chunk
from georep.replication.source import REANNOUNCE, ReplicaSource
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import LocalOffset, Origin
from tests.support.sites import origin_batch
from topology.ids import SiteId
from topology.model import default_topology

B = Origin(SiteId("b"), 1)
A = Origin(SiteId("a"), 1)
HEARTBEAT_MS = 100


class CountingLog(MemoryLog):
    """A log that counts what the source asks it (every question is a visit to the partition)."""

    def __init__(self, visits: list[int]) -> None:
        super().__init__()
        self._visits = visits

    @property
    def flushed_offset(self) -> LocalOffset:
        self._visits[0] += 1
        return super().flushed_offset

    @property
    def log_end_offset(self) -> LocalOffset:
        self._visits[0] += 1
        return super().log_end_offset


def put(log: MemoryLog, origin: Origin, seq: int) -> None:
    data = origin_batch(origin, seq)
    log.append(parse_header(data), [memoryview(data)[24:]], 5_000)


def idle_source(partitions: int) -> tuple[ReplicaSource, list[int], int]:
    """A source over ``partitions`` partitions holding one batch each, that has sent them all; its clock."""
    visits = [0]
    logs: dict[tuple[str, int], MemoryLog] = {}
    for p in range(partitions):
        log = logs[("t", p)] = CountingLog(visits)
        put(log, B, 0)
        log.flush()
    source = ReplicaSource(logs, {k: ({}, ("b",)) for k in logs}, heartbeat_ms=HEARTBEAT_MS)
    now = 0
    while True:  # the summary, then the data
        step = source.step(now, 1 << 20)
        if not step.again:
            break
    for _ in range(3):  # a few heartbeats: what changed while the data went out is told once
        now += HEARTBEAT_MS
        source.step(now, 1 << 20)
    visits[0] = 0
    return source, visits, now


def idle_beats(partitions: int) -> tuple[list[int], int]:
    """The chunks in each of 10 idle heartbeats, and the partition visits they took."""
    source, visits, now = idle_source(partitions)
    sizes = []
    for _ in range(10):
        now += HEARTBEAT_MS
        step = source.step(now, 1 << 20)
        assert step.heartbeat
        sizes.append(len(step.chunks))
        for _ in range(5):  # steps between heartbeats: nothing to send, wait
            assert source.step(now + 1, 1 << 20).chunks == []
    return sizes, visits[0]


def test_an_idle_sources_heartbeats_do_not_grow_with_the_partition_count() -> None:
    # on main every heartbeat carried one chunk per wanted partition: 2,000 here
    small, _ = idle_beats(20)
    large, _ = idle_beats(2_000)
    assert large == small == [REANNOUNCE] * 10


def test_an_idle_source_visits_only_a_bounded_number_of_partitions_per_step() -> None:
    # on main each step asked every cursor whether it had more (has_more), and every heartbeat read every log
    _, small = idle_beats(20)
    _, large = idle_beats(2_000)
    assert large == small


def test_a_source_tells_a_moved_partition_in_the_next_heartbeat_and_only_it() -> None:
    source, _visits, now = idle_source(500)
    log = source_log(source, ("t", 321))
    put(log, B, 2)
    log.flush()
    source.flushed(("t", 321))
    step = source.step(now + 1, 1 << 20)
    assert [(c.key, c.src_vector) for c in step.chunks] == [(("t", 321), {B: 4})] and not step.heartbeat
    beat = source.step(now + 1 + HEARTBEAT_MS, 1 << 20)
    assert beat.heartbeat and ("t", 321) not in {c.key for c in beat.chunks[REANNOUNCE:]}


def source_log(source: ReplicaSource, key: tuple[str, int]) -> MemoryLog:
    log = source._by_key[key].log
    assert isinstance(log, MemoryLog)
    return log


# -- a lost tail, with delta heartbeats ---------------------------------------------------------------------------


class Link:
    """Site a pulling ``PARTITIONS`` partitions from b: a source at b, a session at a, a wire that can drop."""

    PARTITIONS = 60

    def __init__(self) -> None:
        self.src = {("t", p): MemoryLog() for p in range(self.PARTITIONS)}
        self.dst = {("t", p): MemoryLog() for p in range(self.PARTITIONS)}
        self.links = LinkManager(default_topology(), "a")
        self.links.topic("t", self.PARTITIONS)
        config = PullConfig(idle_timeout_ms=10_000, backoff_min_ms=100, backoff_max_ms=400)
        self.session = PullSession(SiteId("b"), self.links, A, self.vector_of, itertools.count(1), config)
        self.source: ReplicaSource | None = None
        self.stream_id = 0
        self.events: list[str] = []
        self.now = 0

    def vector_of(self, key: tuple[str, int]) -> Mapping[Origin, int]:
        return self.dst[key].vector()

    def perform(self, effects: list[Effect]) -> None:
        todo = list(effects)
        while todo:
            effect = todo.pop(0)
            if isinstance(effect, OpenStream):
                self.stream_id = effect.stream_id
                self.source = ReplicaSource(self.src, effect.wants, heartbeat_ms=HEARTBEAT_MS)
            elif isinstance(effect, ApplyChunks):
                then: list[Effect] = []
                for chunk in effect.chunks:
                    outcome = apply_chunk(self.dst[chunk.key], chunk.batches, self.now)
                    then += self.session.on_applied(effect.stream_id, chunk.key, outcome, self.now)
                todo = then + todo
            elif isinstance(effect, LinkEvent):
                self.events.append(effect.kind)

    def pump(self, drop_data: bool = False) -> None:
        """Step the source until it waits; deliver what it sends (but its data, if ``drop_data``)."""
        assert self.source is not None
        while True:
            step = self.source.step(self.now, 1 << 20)
            if (step.chunks or step.heartbeat) and not (drop_data and not step.heartbeat):
                self.perform(self.session.on_message(self.stream_id, step.chunks, step.heartbeat, self.now))
            if not step.again:
                return

    def produce(self, key: tuple[str, int], seq: int) -> None:
        put(self.src[key], B, seq)
        self.src[key].flush()
        assert self.source is not None
        self.source.flushed(key)


def test_a_lost_last_message_is_found_by_the_rotating_reannounce_and_pulled_again() -> None:
    link = Link()
    link.perform(link.session.start(0))
    link.pump()
    key = ("t", 7)
    link.produce(key, 0)
    link.pump()
    assert link.dst[key].vector() == {B: 2}
    link.produce(key, 2)
    link.pump(drop_data=True)  # the stream's last data of the partition is lost on the way
    # Nothing of it changes at b any more: only the rotation tells the partition again, twice, and a reopens.
    rounds = 2 * (Link.PARTITIONS // REANNOUNCE + 1) + 2
    for _ in range(rounds):
        link.now += HEARTBEAT_MS
        link.pump()
        link.perform(link.session.tick(link.now))
        if "tail" in link.events:
            break
    assert "tail" in link.events
    link.pump()  # the new stream starts from a's have-vector
    assert link.dst[key].vector() == {B: 4}


# -- liveness at many partitions --------------------------------------------------------------------------------


def test_a_source_scanning_only_other_origins_batches_still_heartbeats_when_due() -> None:
    # A long stretch of batches the dst does not want (another origin's) takes many steps to scan; on main the
    # source sent nothing meanwhile, and at many partitions the dst took the silence for a dead stream.
    log = MemoryLog()
    put(log, B, 0)
    for seq in range(0, 6_000, 2):  # origin a, not wanted by this dst: more than one read (READ_BYTES_MIN)
        put(log, A, seq)
    put(log, B, 2)
    log.flush()
    source = ReplicaSource({("t", 0): log}, {("t", 0): ({}, ("b",))}, heartbeat_ms=HEARTBEAT_MS)
    assert source.step(0, 1).heartbeat  # the summary
    assert not source.step(1, 1).heartbeat  # b's first batch
    step = source.step(1 + HEARTBEAT_MS, 1)  # a scan budget of 16 bytes: far from b's next batch
    assert step.heartbeat and step.again  # on main: no message, "scan on"
    assert step.chunks == [] or step.chunks[0].src_vector == {A: 6_000, B: 4}
    while not (step := source.step(1 + HEARTBEAT_MS, 1)).chunks:
        assert step.again
    assert [c.key for c in step.chunks] == [("t", 0)] and step.chunks[0].batches  # b's second batch, in the end


def test_a_dst_busy_applying_a_long_message_does_not_take_it_for_a_dead_stream() -> None:
    link = Link()
    link.perform(link.session.start(0))
    link.pump()
    assert link.source is not None
    for p in range(3):
        link.produce(("t", p), 0)
    step = link.source.step(10, 1 << 20)
    assert len(step.chunks) == 3
    session = link.session
    [applies] = session.on_message(link.stream_id, step.chunks, False, 10)  # the message's three applies
    assert isinstance(applies, ApplyChunks)
    # each apply takes 6 s (a slow disk): the stream delivered nothing new for longer than the idle timeout
    idle = session.config.idle_timeout_ms
    apply = applies.chunks[0]
    outcome = apply_chunk(link.dst[apply.key], apply.batches, 10)
    assert session.on_applied(link.stream_id, apply.key, outcome, 10 + idle - 4_000) == []
    apply = applies.chunks[1]
    outcome = apply_chunk(link.dst[apply.key], apply.batches, 10)
    session.on_applied(link.stream_id, apply.key, outcome, 10 + idle + 2_000)
    assert session.tick(10 + idle + 3_000) == []  # on main: "no message from b for 10000 ms", the link down
