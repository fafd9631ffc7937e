"""The node's pure decision core (georep/broker/): origin append, fetch cursor, ack table, commit log, and the
mapping of its errors to gRPC codes. Each runs here over ``MemoryLog`` with no node, as the simulator runs it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedup.producer import InvalidSequence, OutOfOrderSequence, ProducerStateTable
from georep.broker import errors
from georep.broker.acks import AckKind, Acks, AckTable, Fail, HeldChanged, Release, StartFlush, check_acks
from georep.broker.append import append_as_origin
from georep.broker.commits import AFTER_HLC_AHEAD_MS_MAX, CommitEntry, CommitLog, check_commit_request, commit_batch
from georep.broker.fetch import AtOffset, Earliest, FetchCursor, FromVector, Latest, start_position
from georep.record.batch import BatchHeader, RecordInput, encode_batch, iter_headers, parse_header, stamp_origin
from georep.server.status import STATUS, status_of
from georep.storage.api import DiskFull, OffsetOutOfRange
from georep.storage.memory_log import MemoryLog
from offsets.commits import InvalidCommit
from offsets.coordinates import Origin
from offsets.hlc import pack
from offsets.vector import VectorOffset
from tests.support.examples import examples
from tests.support.sites import origin_batch
from topology.ids import SiteId

A = Origin(SiteId("a"), 1)
B = Origin(SiteId("b"), 1)
KEY = ("t", 0)
MAX = 1 << 20


def producer_batch(n: int = 2, *, pid: int = -1, seq: int = -1) -> bytes:
    records = [RecordInput(b"k", b"v%d" % i, (), 1_000 + i) for i in range(n)]
    return encode_batch(records, producer_id=pid, producer_epoch=0 if pid >= 0 else -1, base_sequence=seq)


def append(log: MemoryLog, table: ProducerStateTable, batch: bytes, origin: Origin = A):  # type: ignore[no-untyped-def]
    return append_as_origin(log, table, origin, batch, topic="t", max_batch_bytes=4096, now_ms=5_000)


def put(log: MemoryLog, data: bytes) -> None:
    """Append a stamped batch as replication does."""
    log.append(parse_header(data), [memoryview(data)[24:]], 5_000)


def headers(data: bytes) -> list[tuple[Origin, int, int]]:
    return [(h.origin, h.base_origin_seq, h.last_origin_seq) for h in iter_headers(data)]


# -- origin append --------------------------------------------------------------------------------


def test_origin_append_stamps_the_next_origin_seq_of_the_log() -> None:
    log, table = MemoryLog(), ProducerStateTable()
    first = append(log, table, producer_batch(3))
    second = append(log, table, producer_batch(2))
    assert (first.result.base_offset, first.result.base_origin_seq, first.result.last_origin_seq) == (0, 0, 2)
    assert (second.result.base_offset, second.result.base_origin_seq, second.end_offset) == (3, 3, 5)
    assert log.vector() == {A: 5}
    # after a restart the next seq still comes from the log, whatever the table remembers
    assert append(log, ProducerStateTable(), producer_batch(1)).result.base_origin_seq == 5


def test_a_retried_batch_answers_the_original_coordinates_and_stores_nothing() -> None:
    log, table = MemoryLog(), ProducerStateTable()
    first = append(log, table, producer_batch(2, pid=7, seq=0))
    again = append(log, table, producer_batch(2, pid=7, seq=0))
    assert again.duplicate and again.result == first.result and log.log_end_offset == 2
    with pytest.raises(errors.SequenceRejected) as info:
        append(log, table, producer_batch(2, pid=7, seq=5))
    assert isinstance(info.value.decision, OutOfOrderSequence) and log.log_end_offset == 2


@pytest.mark.parametrize(
    "mangle, error",
    [
        (lambda b: b + b, errors.MalformedBatch),  # two batches in one request
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), errors.BatchCrcMismatch),
        (lambda b: stamp_origin(b, B, 0)[0] + b[len(stamp_origin(b, B, 0)[0]) :], errors.MalformedBatch),  # stamped
        (lambda b: b + bytes(5000), errors.BatchTooLarge),
        (lambda b: b[:20], errors.MalformedBatch),
    ],
)
def test_a_bad_batch_is_refused_and_nothing_is_stored(mangle, error) -> None:  # type: ignore[no-untyped-def]
    log, table = MemoryLog(), ProducerStateTable()
    with pytest.raises(error) as info:
        append(log, table, mangle(producer_batch(2, pid=3, seq=0)))
    assert str(info.value) and log.log_end_offset == 0
    # the producer table took nothing in either: the same batch, sent right, is new
    assert not append(log, table, producer_batch(2, pid=3, seq=0)).duplicate


class FullOnce(MemoryLog):
    """A log whose next append finds the disk full."""

    full = True

    def append(self, header: BatchHeader, body: Sequence[bytes | memoryview], append_time_ms: int) -> BatchHeader:
        if self.full:
            self.full = False
            raise DiskFull("no space left on device")
        return super().append(header, body, append_time_ms)


def test_a_failed_append_leaves_nothing_so_the_retry_is_stored_once() -> None:
    log, table = FullOnce(), ProducerStateTable()
    with pytest.raises(DiskFull):
        append(log, table, producer_batch(2, pid=9, seq=0))
    stored = append(log, table, producer_batch(2, pid=9, seq=0))
    assert not stored.duplicate and log.log_end_offset == 2 and log.vector() == {A: 2}


# -- fetch cursor ---------------------------------------------------------------------------------


def three_batches() -> MemoryLog:
    """a:0-1, b:0-1, a:2-3 at offsets 0, 2, 4; the first two fsynced."""
    log = MemoryLog()
    for origin, seq in ((A, 0), (B, 0), (A, 2)):
        put(log, origin_batch(origin, seq))
    log.flush_to(4)
    return log


def test_start_positions() -> None:
    log = three_batches()
    assert start_position(log, AtOffset(3), A) == 3
    # 'latest' is the end of what readers may see, not the log end: the unfsynced a:2-3 may yet be lost, and
    # a consumer started past it would skip what is written at offsets 4-5 next
    assert start_position(log, Earliest(), A) == 0 and start_position(log, Latest(), A) == 4
    vector = VectorOffset({A: 2})
    assert start_position(log, FromVector(vector), A) == 2  # b:0 is the first record the vector lacks
    assert start_position(log, FromVector(VectorOffset({A: 2, B: 2})), A) == 4
    # a hint holds only in the log it was taken in, and is clamped into it
    assert start_position(log, FromVector(vector, A, 5), A) == 5
    assert start_position(log, FromVector(vector, A, 99), A) == 6
    assert start_position(log, FromVector(vector, B, 5), A) == 2


def test_reads_hand_out_only_fsynced_batches() -> None:
    log = three_batches()
    cursor = FetchCursor(log, Earliest(), A)
    assert headers(cursor.read(MAX)) == [(A, 0, 1), (B, 0, 1)]
    assert cursor.position == 4 and not cursor.readable and cursor.read(MAX) == b""
    log.flush_to(6)
    assert cursor.readable and headers(cursor.read(MAX)) == [(A, 2, 3)]


def test_a_vector_start_drops_whole_covered_batches_and_keeps_partly_covered_ones() -> None:
    log = three_batches()
    log.flush_to(6)
    cursor = FetchCursor(log, FromVector(VectorOffset({A: 3, B: 0})), A)
    assert cursor.position == 2
    # b:0-1 is new; a:2-3 is covered in part (a:2), so it is handed out whole and the client trims
    assert headers(cursor.read(MAX)) == [(B, 0, 1), (A, 2, 3)]
    covered = FetchCursor(log, FromVector(VectorOffset({A: 4, B: 2})), A)
    assert covered.position == 6 and covered.read(MAX) == b""


def test_a_position_outside_the_log_names_the_valid_range() -> None:
    log = three_batches()
    cursor = FetchCursor(log, AtOffset(9), A)
    with pytest.raises(OffsetOutOfRange) as info:
        cursor.check_in_range()
    assert "0" in str(info.value) and "6" in str(info.value)


# -- ack table ------------------------------------------------------------------------------------


def table(fsync_per_batch: bool = True) -> AckTable:
    t = AckTable("a", A)
    t.open_partition(KEY, fsync_per_batch, 0, VectorOffset({}))
    return t


def test_leader_acks_wait_for_an_fsync_and_share_it() -> None:
    t = table()
    assert t.wait("w1", KEY, 2, A, 1, Acks(), now_ms=0) == [StartFlush(KEY)]
    assert t.wait("w2", KEY, 4, A, 3, Acks(), now_ms=0) == []  # an fsync runs: the next one will cover w2
    assert t.wait("w3", KEY, 6, A, 5, Acks(), now_ms=0) == []
    # the running fsync covered only w1; one more fsync covers w2 and w3 together
    assert t.flush_done(KEY, 2, VectorOffset({A: 2})) == [HeldChanged(), Release("w1"), StartFlush(KEY)]
    assert t.flush_done(KEY, 6, VectorOffset({A: 6})) == [HeldChanged(), Release("w2"), Release("w3")]
    assert t.pending() == 0
    # already durable: released at once
    assert t.wait("w4", KEY, 6, A, 5, Acks(), now_ms=0) == [Release("w4")]


def test_without_fsync_per_batch_the_ack_follows_the_write() -> None:
    t = table(fsync_per_batch=False)
    assert t.wait("w", KEY, 2, A, 1, Acks(), now_ms=0) == [Release("w")]
    assert t.replicated(KEY, 4) == []  # the periodic flush covers replicated batches
    assert t.flush(KEY, 4) == [StartFlush(KEY)]


def test_geo_acks_wait_for_n_sites_to_hold_the_batch_fsynced() -> None:
    t = table()
    t.wait("w", KEY, 2, A, 1, Acks.geo(2), now_ms=0)
    assert t.flush_done(KEY, 2, VectorOffset({A: 2})) == [HeldChanged()]  # one site so far
    # another site's report of what *this* site holds proves nothing
    assert t.held_reported([("a", "t", 0, VectorOffset({A: 9}))]) == []
    assert t.held_reported([("b", "t", 0, VectorOffset({A: 1}))]) == [HeldChanged()]  # seq 1 not held
    assert t.held_reported([("b", "t", 0, VectorOffset({A: 2}))]) == [HeldChanged(), Release("w")]


def test_geo_acks_time_out_naming_where_the_batch_is() -> None:
    t = table()
    t.wait("w", KEY, 2, A, 1, Acks.geo(3), now_ms=1_000, timeout_ms=500)
    t.flush_done(KEY, 2, VectorOffset({A: 2}))
    assert t.next_deadline_ms() == 1_500 and t.tick(1_499) == []
    [fail] = t.tick(1_500)
    assert isinstance(fail, Fail) and isinstance(fail.error, errors.GeoAckTimeout)
    assert "1 site(s) (a)" in str(fail.error) and "retrying is safe" in str(fail.error)
    assert t.pending() == 0 and t.next_deadline_ms() is None


# One op: (kind, partition, value). kinds: wait a geo:2 ack with timeout value; a report from site b that it holds
# value seqs of the partition; this site's fsync of value seqs; a tick at +value ms; close one partition.
_DEADLINE_OPS = st.lists(
    st.tuples(st.sampled_from(["wait", "held", "own", "tick", "close"]), st.integers(0, 3), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=examples(300), deadline=None)
@given(_DEADLINE_OPS)
def test_geo_deadlines_fail_exactly_the_expired_waiters_in_any_order_of_events(ops: list[tuple[str, int, int]]) -> None:
    """The deadline heap keeps answered waiters until they reach its top: ``next_deadline_ms`` must still name the
    earliest waiter that waits, and ``tick`` fail exactly those past their deadline, whatever released or failed
    the others first. The model is the set of unanswered tokens, read from the effects alone."""
    t = AckTable("a", A)
    keys = [("t", i) for i in range(4)]
    for key in keys:
        t.open_partition(key, False, 0, VectorOffset({}))
    waiting: dict[int, int] = {}  # token -> deadline
    now, seqs = 0, [0, 0, 0, 0]

    def answered(effects: Sequence[object]) -> None:
        for e in effects:
            if isinstance(e, Release | Fail):
                assert e.token in waiting, f"{e} answers a waiter twice or one never made"
                del waiting[e.token]

    for n, (kind, i, value) in enumerate(ops):
        if kind == "wait" and keys[i] in t._partitions:
            seqs[i] += 1
            waiting[n] = now + value
            answered(t.wait(n, keys[i], 0, A, seqs[i] - 1, Acks.geo(2), now_ms=now, timeout_ms=value))
        elif kind == "held":
            answered(t.held_reported([("b", "t", i, VectorOffset({A: value}))]))
        elif kind == "own" and keys[i] in t._partitions:
            answered(t.flush_done(keys[i], 0, VectorOffset({A: value})))
        elif kind == "tick":
            now += value
            effects = t.tick(now)
            assert {e.token for e in effects} == {tok for tok, d in waiting.items() if d <= now}
            answered(effects)
        elif kind == "close":
            answered(t.close_partition(keys[i], errors.NodeStopping("moved")))
        assert t.next_deadline_ms() == min(waiting.values(), default=None)


def test_a_failed_fsync_fails_its_waiters_and_close_fails_the_rest() -> None:
    t = table()
    t.wait("w1", KEY, 2, A, 1, Acks(), now_ms=0)
    [fail] = t.flush_failed(KEY, "EIO")
    assert fail.token == "w1" and isinstance(fail.error, errors.FsyncFailed) and "not acked" in str(fail.error)
    assert t.wait("w2", KEY, 2, A, 1, Acks(), now_ms=0) == [StartFlush(KEY)]  # the next fsync is tried afresh
    [stopping] = t.close()
    assert isinstance(stopping, Fail) and isinstance(stopping.error, errors.NodeStopping)
    [refused] = t.wait("w3", KEY, 4, A, 3, Acks(), now_ms=0)
    assert isinstance(refused, Fail) and isinstance(refused.error, errors.NodeStopping)


def test_ack_levels_that_can_never_be_met_are_refused() -> None:
    check_acks(Acks.geo(3), "t", "a", reach=3)
    with pytest.raises(errors.InvalidAcks):
        check_acks(Acks.geo(0), "t", "a", reach=3)
    with pytest.raises(errors.GeoAcksUnreachable, match="use acks=geo:3 or less"):
        check_acks(Acks.geo(4), "t", "a", reach=3)


# -- commit log -----------------------------------------------------------------------------------


def test_commits_fold_from_the_log_whatever_their_origin() -> None:
    logs = {0: MemoryLog()}
    here, there = CommitLog(), CommitLog()
    entry = CommitEntry("t", 0, VectorOffset({A: 4}), hint_offset=4)
    stamp = there.stamp(10_000, 0, "b")
    commits = there.new_commits("g", [entry], stamp, B, now_ms=10_000)
    data = commit_batch(commits, 10_000)
    head, _ = stamp_origin(data, B, 0)
    put(logs[0], head + data[len(head) :])
    report = here.catch_up(logs)
    assert [f.won for f in report.folded] == [True] and not report.problems
    got = here.table.get("g", "t", 0)
    assert got is not None and got.vector == entry.vector and got.committed_by == B
    assert here.catch_up(logs).folded == []  # folded once
    # the next stamp here is after the folded one, whatever this site's clock says
    assert here.stamp(1, 0, "a") > stamp


def test_commit_requests_no_consumer_sends_are_refused() -> None:
    entry = CommitEntry("t", 0, VectorOffset({}))
    assert check_commit_request("g", [entry]) == "g"
    for group, entries, words in [
        ("g", [], "at least one"),
        ("g", [entry, entry], "appears twice"),
        ("g", [CommitEntry("__georep_offsets", 0, entry.vector)], "internal topic"),
        ("g", [CommitEntry("t", 0, entry.vector, metadata="x" * 10_000)], "limit"),
    ]:
        with pytest.raises(InvalidCommit, match=words):
            check_commit_request(group, entries)
    with pytest.raises(InvalidCommit, match="ahead of site a's clock"):
        CommitLog().stamp(0, pack(AFTER_HLC_AHEAD_MS_MAX + 1, 0), "a")


# -- errors to status codes -----------------------------------------------------------------------


def all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *all_subclasses(sub)]
    return out


def test_every_domain_error_has_a_status_code() -> None:
    for cls in all_subclasses(errors.BrokerError):
        assert any(c in STATUS for c in cls.__mro__), f"{cls.__name__} has no gRPC status code"
    assert status_of(errors.BatchTooLarge(10, 5, "t")) is grpc.StatusCode.INVALID_ARGUMENT  # via InvalidRequest
    assert status_of(errors.SequenceRejected(OutOfOrderSequence(0, 5, 7, 0))) is grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(errors.SequenceRejected(InvalidSequence("bad", 7, -1, 0, 1))) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(KeyError("a bug")) is None


def test_closing_a_partition_fails_its_unconfirmed_acks_and_forgets_it() -> None:
    """A multi-node site's leader rolls or loses a partition: what the quorum had not confirmed gets no ack (the
    seal may cut it), and a waiter that was already released stays released."""
    table = AckTable("a", A)
    table.open_partition(KEY, True, 0, VectorOffset(), replicated_in_site=True)
    assert table.wait("early", KEY, 10, A, 9, Acks(AckKind.ALL), 0) == [StartFlush(KEY)]
    table.wait("late", KEY, 20, A, 19, Acks(AckKind.ALL), 0)
    table.flush_done(KEY, 20, VectorOffset())
    assert table.quorum_advanced(KEY, 10, VectorOffset({A: 10})) == [HeldChanged(), Release("early")]
    why = errors.NotLeader("t", 0, "segment 0 was sealed at offset 10")
    assert table.close_partition(KEY, why) == [Fail("late", why)]
    assert table.pending() == 0
    assert table.close_partition(KEY, why) == []
