"""The destination's pull session, the topic-sync plan, the held reporter, a source at a damaged batch and the
repair queue, driven by hand over ``MemoryLog``.

The simulator drives the same objects over random topologies and faults (tests/test_sim.py); these tests pin
each rule of georep/replication/session.py with one small scenario.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import pytest

from georep.broker.errors import NotHeld
from georep.broker.fetch import batch_by_coordinate
from georep.broker.repair import RepairQueue
from georep.record.batch import iter_headers, parse_header
from georep.replication.links import LinkManager, LinkState
from georep.replication.session import DISABLED, ApplyChunks, Effect, LinkEvent, OpenStream, PullConfig, PullSession
from georep.replication.sink import SEQ_MAX, apply_chunk
from georep.replication.source import Chunk, ReplicaSource
from georep.replication.topics import RemoteTopic, plan_topic_sync
from georep.storage.api import BatchDamaged
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from offsets.held import HeldReporter, HeldTable
from offsets.vector import VectorOffset
from tests.support.sites import origin_batch
from topology.ids import SiteId
from topology.model import default_topology, parse_topology

A = Origin(SiteId("a"), 1)
B = Origin(SiteId("b"), 1)
KEY = ("t", 0)
CONFIG = PullConfig(idle_timeout_ms=1_000, backoff_min_ms=100, backoff_max_ms=400)


class Dst:
    """Site a pulling from b over the default triangle; c's link is up, so b sends a's old epochs and b's."""

    def __init__(self) -> None:
        self.log = MemoryLog()
        self.links = LinkManager(default_topology(), "a")
        self.links.topic("t", 1)
        self.links.link_up("c", 0)
        self.session = PullSession(SiteId("b"), self.links, A, self.vector_of, itertools.count(1), CONFIG)

    def vector_of(self, key: tuple[str, int]) -> Mapping[Origin, int]:
        return self.log.vector()

    def run(self, effects: Sequence[Effect], now_ms: int) -> list[Effect]:
        """Carry out the applies as the node's writer thread would; return every other effect."""
        out: list[Effect] = []
        todo = list(effects)
        while todo:
            effect = todo.pop(0)
            if isinstance(effect, ApplyChunks):
                outcomes = [apply_chunk(self.log, c.batches, now_ms) for c in effect.chunks]  # one writer hop
                then: list[Effect] = []
                for chunk, outcome in zip(effect.chunks, outcomes, strict=True):
                    then += self.session.on_applied(effect.stream_id, chunk.key, outcome, now_ms)
                todo = then + todo
            else:
                out.append(effect)
        return out

    def message(self, stream_id: int, *chunks: Chunk, now_ms: int = 10) -> list[Effect]:
        heartbeat = not any(c.batches for c in chunks)
        return self.run(self.session.on_message(stream_id, chunks, heartbeat, now_ms), now_ms)


def data(origin: Origin, seq: int, n: int = 2) -> Chunk:
    return Chunk(KEY, origin_batch(origin, seq, n), {origin: seq + n}, 0)


def heartbeat(vector: Mapping[Origin, int]) -> Chunk:
    return Chunk(KEY, b"", vector, 0)


def kinds(effects: Sequence[Effect]) -> list[str]:
    return [e.kind if isinstance(e, LinkEvent) else type(e).__name__ for e in effects]


def test_open_asks_for_the_wanted_origins_with_this_sites_own_origin_fully_held() -> None:
    dst = Dst()
    [opened] = dst.session.start(0)
    assert isinstance(opened, OpenStream) and opened.stream_id == 1
    have, sites = opened.wants[KEY]
    assert have == {A: SEQ_MAX}  # its own current origin never comes back
    assert sites == ("a", "b")  # a's older epochs (a rebuilt site) and b's records; c's come from c
    assert dst.session.start(0) == []  # one stream at a time


def test_a_messages_chunks_are_applied_together_in_order_and_the_next_message_waits() -> None:
    dst = Dst()
    dst.session.start(0)
    effects = dst.session.on_message(1, [data(B, 0), heartbeat({B: 4}), data(B, 2)], False, 10)
    assert kinds(effects) == ["up", "ApplyChunks"]  # one hop for the message's data chunks (issue 22)
    [_up, apply] = effects
    assert isinstance(apply, ApplyChunks) and [c.batches for c in apply.chunks] == [
        origin_batch(B, 0, 2),
        origin_batch(B, 2, 2),
    ]
    assert dst.session.on_message(1, [data(B, 4)], False, 11) == []  # the next message waits for both
    outcome = apply_chunk(dst.log, apply.chunks[0].batches, 12)
    assert dst.session.on_applied(1, KEY, outcome, 12) == []  # one of two in: still waiting
    outcome = apply_chunk(dst.log, apply.chunks[1].batches, 12)
    [then] = dst.session.on_applied(1, KEY, outcome, 12)
    assert isinstance(then, ApplyChunks) and len(then.chunks) == 1  # now the next message
    assert dst.run([then], 13) == []
    assert dst.log.vector() == {B: 6} and dst.session.stats.applied_batches == 3
    assert dst.links.links[SiteId("b")].state is LinkState.STREAMING


def test_a_gap_reopens_from_the_sites_vector_and_the_old_stream_is_ignored() -> None:
    dst = Dst()
    dst.session.start(0)
    dst.message(1, data(B, 0))
    effects = dst.message(1, data(B, 4))  # b:2-3 was lost on the way
    assert kinds(effects) == ["gap", "OpenStream"] and dst.session.stats.gaps == 1
    reopened = effects[1]
    assert isinstance(reopened, OpenStream) and reopened.stream_id == 2
    assert reopened.wants[KEY][0] == {A: SEQ_MAX, B: 2}
    assert dst.message(1, data(B, 2)) == [] and dst.log.vector() == {B: 2}  # stream 1 is gone


def test_a_batch_straddling_the_vector_is_divergence_never_appended() -> None:
    dst = Dst()
    dst.session.start(0)
    dst.message(1, data(B, 0, n=4))
    other = Chunk(KEY, origin_batch(B, 2, 4, tag=b"other-"), {B: 6}, 0)  # b:2-5 where b:2-3 is held
    assert kinds(dst.message(1, other)) == ["diverged", "OpenStream"]
    assert dst.log.vector() == {B: 4} and "diverg" in dst.session.stats.last_error.lower()


def test_a_lost_tail_shows_as_two_heartbeats_promising_what_never_came() -> None:
    dst = Dst()
    dst.session.start(0)
    dst.message(1, data(B, 0))
    assert dst.message(1, heartbeat({B: 4})) == []  # the data may be on its way
    dst.message(1, data(B, 2))
    assert dst.message(1, heartbeat({B: 6})) == []  # data in between: a fresh promise
    assert kinds(dst.message(1, heartbeat({B: 6}))) == ["tail", "OpenStream"]
    # a heartbeat that promises nothing more than the site holds never reopens
    dst2 = Dst()
    dst2.session.start(0)
    dst2.message(1, data(B, 0))
    assert dst2.message(1, heartbeat({B: 2})) == [] and dst2.message(1, heartbeat({B: 2})) == []


def test_a_silent_stream_is_dead_and_retries_back_off_then_reset() -> None:
    dst = Dst()
    dst.session.start(0)
    assert dst.session.next_due_ms() == 1_000 and dst.session.tick(999) == []
    assert kinds(dst.session.tick(1_000)) == ["timeout"]
    assert dst.links.links[SiteId("b")].state is LinkState.DOWN
    assert dst.session.tick(1_099) == [] and kinds(dst.session.tick(1_100)) == ["OpenStream"]
    dst.session.tick(2_100)  # dead again: the next retry waits twice as long
    assert dst.session.next_due_ms() == 2_300
    for t in (2_300, 3_300, 3_700, 4_700):
        dst.session.tick(t)
    assert dst.session.next_due_ms() == 4_700 + 400  # capped at backoff_max_ms
    dst.session.tick(5_100)
    # the link is up (its wants change: a new stream at 5_200); a heartbeat so young proves nothing, one
    # backoff_max_ms later it resets the backoff
    assert kinds(dst.message(dst.session.stream_id or 0, heartbeat({}), now_ms=5_200)) == ["wants", "OpenStream"]
    dst.message(dst.session.stream_id or 0, heartbeat({}), now_ms=5_599)
    assert dst.session.stats.last_error
    assert kinds(dst.message(dst.session.stream_id or 0, heartbeat({}), now_ms=5_600)) == ["up"]
    dst.session.tick(6_600)
    assert dst.session.next_due_ms() == 6_700


def test_a_stream_that_fails_on_its_first_apply_backs_off_and_keeps_its_error_until_progress() -> None:
    dst = Dst()
    dst.session.start(0)
    b = dst.links.links[SiteId("b")]
    for stream_id, now, retry in ((1, 10, 110), (2, 110, 310), (3, 310, 710)):  # a full disk, say
        first = stream_id == 1  # a failure that repeats with no progress between is announced once
        effects = dst.session.on_message(stream_id, [data(B, 0)], False, now)
        assert kinds(effects) == (["up", "ApplyChunks"] if first else ["ApplyChunks"])
        assert b.state is LinkState.STREAMING
        assert kinds(dst.session.on_stream_ended(stream_id, now, "DiskFull: no space")) == (["down"] if first else [])
        assert dst.session.stats.last_error == b.last_error == "DiskFull: no space"
        assert dst.session.next_due_ms() == retry  # doubling: the message that came did not reset it
        assert kinds(dst.session.tick(retry)) == ["OpenStream"]
    assert kinds(dst.message(4, data(B, 0), now_ms=720))[0] == "up"  # applied whole: the link works again
    assert dst.session.stats.last_error == b.last_error == "" and dst.log.vector() == {B: 2}
    dst.session.on_stream_ended(dst.session.stream_id or 0, 730, "reset")
    assert dst.session.next_due_ms() == 830


def test_a_clean_end_reopens_at_once_and_a_failed_one_after_the_backoff() -> None:
    dst = Dst()
    dst.session.start(0)
    assert kinds(dst.session.on_stream_ended(1, 5)) == ["ended", "OpenStream"]
    assert kinds(dst.session.on_stream_ended(2, 6, "connection refused")) == ["down"]
    assert dst.session.stats.last_error == "connection refused" and dst.session.next_due_ms() == 106
    assert dst.session.on_stream_ended(2, 7, "again") == []  # that stream is gone already


def test_a_change_of_wants_reopens_the_stream() -> None:
    dst = Dst()
    dst.session.start(0)
    dst.message(1, heartbeat({}))
    assert dst.session.tick(20) == []
    dst.links.link_down("c", 30, "unreachable")  # c's records now come through b
    [event, reopened] = dst.session.tick(40)
    assert isinstance(event, LinkEvent) and event.kind == "wants"
    assert isinstance(reopened, OpenStream) and reopened.wants[KEY][1] == ("a", "b", "c")


def test_a_partition_that_stops_being_served_during_its_apply_reopens_the_stream() -> None:
    """A multi-node site's node stops serving a partition while a chunk of it is applied (its segment rolled):
    its vector cannot be read then (the node's broker raises NotLeader), and the stream is reopened without it.
    This once ended the node's pull loop for good, silently, and acks=geo:N at the other site timed out."""
    served = {KEY}

    class Leader(Dst):
        def __init__(self) -> None:
            super().__init__()
            self.session = PullSession(
                SiteId("b"), self.links, A, self.vector_of, itertools.count(1), CONFIG, usable=lambda key: key in served
            )

        def vector_of(self, key: tuple[str, int]) -> Mapping[Origin, int]:
            assert key in served, "the vector of a partition this node does not serve"
            return self.log.vector()

    dst = Leader()
    dst.session.start(0)
    [_up, applies] = dst.session.on_message(1, [data(B, 0)], False, 10)
    assert isinstance(applies, ApplyChunks)
    [apply] = applies.chunks
    outcome = apply_chunk(dst.log, apply.batches, 11)
    served.clear()  # the segment rolls while the writer thread applies the chunk
    [event, reopened] = dst.session.on_applied(1, KEY, outcome, 12)
    assert isinstance(event, LinkEvent) and event.kind == "wants"
    assert isinstance(reopened, OpenStream) and reopened.wants == {}
    assert dst.message(2, heartbeat({B: 4})) != [] and dst.session.stream_id == 2  # a heartbeat of it is harmless
    served.add(KEY)  # the next segment opens: pulled again
    [event, reopened] = dst.session.tick(40)
    assert isinstance(reopened, OpenStream) and reopened.wants[KEY][0] == {A: SEQ_MAX, B: 2}


def test_an_operator_cut_stops_the_link_until_it_is_healed() -> None:
    dst = Dst()
    dst.session.start(0)
    assert kinds(dst.session.set_enabled(False, 10)) == ["disabled"]
    assert dst.session.stats.last_error == DISABLED and dst.session.next_due_ms() is None
    assert dst.session.tick(100_000) == [] and dst.message(1, data(B, 0)) == []
    assert dst.links.links[SiteId("b")].state is LinkState.DOWN
    assert kinds(dst.session.set_enabled(True, 20)) == ["healed", "OpenStream"]


# -- topic metadata over a link ------------------------------------------------------------------

FILTERED = """
[sites.a]
nodes = ["127.0.0.1:1"]
[sites.b]
nodes = ["127.0.0.1:2"]
[[links]]
src = "a"
dst = "b"
topics = ["orders/**"]
"""


def test_topic_sync_creates_what_the_link_carries_and_reports_conflicts() -> None:
    [link] = parse_topology(FILTERED).links
    remote = [
        RemoteTopic("orders/eu", 3, {"retention_ms": "60000", "made_up": "1"}),
        RemoteTopic("orders/us", 2),
        RemoteTopic("orders/asia", 4),
        RemoteTopic("payments", 1),  # not carried by this link
    ]
    plan = plan_topic_sync(link, remote, {"orders/us": 4, "orders/asia": 4})
    assert plan.create == [RemoteTopic("orders/eu", 3, {"retention_ms": "60000"})]
    assert list(plan.conflicts) == ["orders/us"]
    assert "4 partitions at site b but 2 at site a" in plan.conflicts["orders/us"]
    assert plan.cleared == ["orders/asia"]


# -- what a site reports upstream ----------------------------------------------------------------


def test_held_reports_go_one_at_a_time_and_leave_out_the_upstreams_own_entries() -> None:
    table, reporter = HeldTable(), HeldReporter("b")
    assert reporter.next_report(table) is None
    table.update("a", "t", 0, VectorOffset({A: 2}))
    table.update("b", "t", 0, VectorOffset({B: 2}))
    first = reporter.next_report(table)
    assert first is not None and [key for key, _ in first] == [("a", "t", 0)]
    table.update("a", "t", 0, VectorOffset({A: 4}))
    assert reporter.next_report(table) is None and reporter.in_flight  # in flight: the change waits
    reporter.failed()
    again = reporter.next_report(table)
    assert again is not None and again[0][1] == VectorOffset({A: 4})  # a failure resends, with what grew
    reporter.acked()
    assert reporter.next_report(table) is None
    reporter.reset()  # the upstream reconnected: it may have forgotten everything
    assert reporter.next_report(table) is not None


# -- a damaged batch at the source -------------------------------------------------------------


def test_a_source_waits_at_a_quarantined_batch_its_dst_needs_and_holds_its_vector_back() -> None:
    log = MemoryLog()
    for seq in (0, 2, 4):
        data = origin_batch(B, seq)
        log.append(parse_header(data), [memoryview(data)[24:]], 5_000)
    log.flush()
    damaged = log.corrupt(2)
    source = ReplicaSource({KEY: log}, {KEY: ({}, ("b",))})
    [chunk] = source.next_chunks(1 << 20)
    assert [h.base_origin_seq for h in iter_headers(chunk.batches)] == [0]  # never past the damage
    assert chunk.src_vector == {B: 2}  # what it can serve: the dst routes the rest around it
    assert source.next_chunks(1 << 20) == [] and not source.has_more()
    assert source.heartbeat()[0].src_vector == {B: 2}
    log.repair(damaged.base_offset, origin_batch(B, 2))
    assert source.has_more()
    [chunk] = source.next_chunks(1 << 20)
    assert [h.base_origin_seq for h in iter_headers(chunk.batches)] == [2, 4] and chunk.src_vector == {B: 6}
    # a dst that does not want the damaged batch's origin, or has it, never waits for it
    other = ReplicaSource({KEY: log}, {KEY: ({B: 4}, ("b",))})
    log.corrupt(2)
    [chunk] = other.next_chunks(1 << 20)
    assert [h.base_origin_seq for h in iter_headers(chunk.batches)] == [4]


# -- repairing from peers ------------------------------------------------------------------------


def test_repairs_ask_each_peer_in_turn_then_back_off() -> None:
    log = MemoryLog()
    data = origin_batch(B, 0)
    log.append(parse_header(data), [memoryview(data)[24:]], 5_000)
    d = log.corrupt(0)
    queue = RepairQueue(["b", "c"], retry_min_ms=100, retry_max_ms=400)
    [ask] = queue.due({KEY: [d]}, 0)
    assert ask.peer == "b" and queue.due({KEY: [d]}, 0) == []  # one ask at a time per batch
    queue.failed(ask, "NOT_FOUND", 0)
    [ask] = queue.due({KEY: [d]}, 0)
    assert ask.peer == "c"
    queue.failed(ask, "unreachable", 10)  # a whole round failed: wait
    assert queue.due({KEY: [d]}, 109) == [] and queue.due({KEY: [d]}, 110)[0].peer == "b"
    assert queue.last_error(KEY, 0) == "c: unreachable"
    assert queue.due({}, 200) == []  # repaired some other way: forgotten
    assert RepairQueue([]).due({KEY: [d]}, 0) == []  # a site alone has no one to ask


def test_a_peer_hands_out_a_batch_by_its_coordinate_only_when_it_holds_it_durably() -> None:
    log = MemoryLog()
    for seq in (0, 3):
        data = origin_batch(B, seq, n=3)
        log.append(parse_header(data), [memoryview(data)[24:]], 5_000)
    log.flush_to(3)
    assert parse_header(batch_by_coordinate(log, B, 2)).base_origin_seq == 0
    with pytest.raises(NotHeld):
        batch_by_coordinate(log, B, 4)  # not fsynced yet
    with pytest.raises(NotHeld):
        batch_by_coordinate(log, A, 0)
    log.corrupt(0)
    with pytest.raises(BatchDamaged):
        batch_by_coordinate(log, B, 1)
