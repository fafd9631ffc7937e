"""Follower reads: what a node that does not lead a partition may serve of it (cluster/follower_reads.py), checked
against recovery's own rule, and the rule carried out over real segment copies (``FollowerLog``).

The safety claim: nothing a follower serves can be cut by a new leader's recovery. Recovery seals the open
segment at the highest end of some ``E - AQ + 1`` fenced members, so the lowest seal it can ever choose is the
``(E - AQ + 1)``-th smallest member end, which is the LAC (the AQ-th largest). A follower serves the open
segment only up to a LAC its leader announced, so below every seal recovery could choose."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.follower_reads import FollowerBound, SegmentBounds, follower_bound
from georep.client.consumer import Consumer
from georep.client.errors import InvalidRequest
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import decode_records, iter_headers
from georep.storage.api import OffsetOutOfRange
from georep.storage.chain_log import ChainSegment, FollowerLog, SegmentElsewhere
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import LocalOffset, OriginSeq
from offsets.vector import VectorOffset
from tests.support.chains import EPOCH, KEY, A
from tests.support.channels import open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import TOPIC, ClusterSite, consume_all, produce, read_partition, status, wait_for
from tests.support.examples import examples
from tests.support.segments import make_batch
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))


def seg(sid: int, base: int, end: int | None, *ensemble: NodeId) -> SegmentBounds:
    return SegmentBounds(SegmentId(sid), base, end, tuple(ensemble))


CHAIN = [seg(0, 0, 10, N1, N2, N3), seg(1, 10, 25, N2, N3, N4), seg(2, 25, None, N3, N1, N2)]


def test_a_member_serves_the_open_segment_up_to_the_announced_lac_and_its_own_copy() -> None:
    assert follower_bound(CHAIN, N1, open_copy_end=40, announced_lac=31) == FollowerBound(
        31, True, "the LAC of the open segment 2 the leader announced"
    )
    assert follower_bound(CHAIN, N1, open_copy_end=28, announced_lac=31).end == 28, "its copy is behind the LAC"
    assert follower_bound(CHAIN, N1, open_copy_end=40, announced_lac=None).end == 25, "no LAC yet: sealed only"
    assert follower_bound(CHAIN, N1, open_copy_end=40, announced_lac=20).end == 25, "a LAC below the base"


def test_a_node_outside_the_open_ensemble_serves_the_sealed_segments_then_sends_readers_to_the_leader() -> None:
    bound = follower_bound(CHAIN, N4, open_copy_end=None, announced_lac=None)
    assert (bound.end, bound.grows) == (25, False) and "not on this node" in bound.why
    assert bound.serves(24) and not bound.serves(25)
    member_without_copy = follower_bound(CHAIN, N2, open_copy_end=None, announced_lac=31)
    assert (member_without_copy.end, member_without_copy.grows) == (25, False), "no copy: nothing of it is served"


def test_between_a_seal_and_the_next_open_everything_is_final() -> None:
    sealed = [*CHAIN[:2], seg(2, 25, 33, N3, N1, N2)]
    assert follower_bound(sealed, N4, None, None) == FollowerBound(
        33, True, "segment 2 is sealed there, and no later segment is known to this node yet"
    )
    assert follower_bound([], N1, None, None).end == 0


def test_a_chain_with_a_gap_or_an_open_segment_inside_is_refused() -> None:
    with pytest.raises(ValueError, match="does not follow"):
        follower_bound([seg(0, 0, 10, N1), seg(1, 11, None, N1)], N1, 20, 15)
    with pytest.raises(ValueError, match="is open but"):
        follower_bound([seg(0, 0, None, N1), seg(1, 10, None, N1)], N1, 20, 15)


@st.composite
def open_segments(draw: st.DrawFn) -> tuple[list[int], int, int, int, int]:
    """An open segment at base 100 written by one leader: each member's end (a prefix of one stream), the ack
    quorum, this member's index, and a LAC the leader announced (at most the LAC now: announcements lag)."""
    members = draw(st.integers(1, 5))
    aq = draw(st.integers(1, members))
    ends = [100 + draw(st.integers(0, 50)) for _ in range(members)]
    lac = sorted(ends, reverse=True)[aq - 1]  # the AQ-th largest fsynced end
    announced = draw(st.integers(0, lac))
    me = draw(st.integers(0, members - 1))
    return ends, aq, me, lac, announced


@given(open_segments())
@settings(max_examples=examples(300), deadline=None)
def test_a_follower_never_serves_what_any_recovery_could_cut(case: tuple[list[int], int, int, int, int]) -> None:
    ends, aq, me, lac, announced = case
    ensemble = tuple(NodeId(i + 1) for i in range(len(ends)))
    chain = [seg(0, 0, 100, N1), SegmentBounds(SegmentId(1), 100, None, ensemble)]
    bound = follower_bound(chain, ensemble[me], ends[me], announced)
    # Every seal recovery may choose: the max end of some E - AQ + 1 members; the lowest is the (E-AQ+1)-th smallest.
    lowest_seal = sorted(ends)[len(ends) - aq]
    assert lowest_seal == lac
    assert bound.end <= lowest_seal, "served past a point a recovery may seal at"
    assert bound.end <= max(ends[me], 100), "served past this node's own copy"
    # And it serves all it may: every sealed offset, and the open segment up to both the LAC and its copy.
    assert bound.end == max(100, min(announced, ends[me])) and bound.grows
    # Reference: an offset is served iff sealed, or below both the announced LAC and this copy's end.
    for offset in range(0, 151, 7):
        assert bound.serves(offset) == (offset < 100 or (offset < announced and offset < ends[me]))


@given(st.integers(0, 60), st.integers(0, 60), st.integers(0, 60))
def test_the_bound_only_grows_as_the_lac_and_the_copy_grow(lac: int, copy: int, more: int) -> None:
    base = [seg(0, 0, 10, N1), seg(1, 10, None, N1, N2)]
    before = follower_bound(base, N2, copy, lac).end
    assert follower_bound(base, N2, copy + more, lac).end >= before
    assert follower_bound(base, N2, copy, lac + more).end >= before
    sealed_later = [seg(0, 0, 10, N1), seg(1, 10, max(10, lac, copy) + more, N1, N2)]
    assert follower_bound(sealed_later, N2, None, None).end >= before, "a seal is at or above any LAC announced"


# -- the rule carried out over real copies ---------------------------------------------------------------------


def follower_store(tmp_path: Path) -> tuple[ReplicaStore, list[ChainSegment], bytes]:
    """This node (2) holds sealed segment 0 (offsets 0..2) with a tail past its seal not cut yet, and open
    segment 1 from offset 2, three batches long (2..5, 5..8, 8..11)."""
    store = ReplicaStore(tmp_path, now_ms=0)
    store.open_segment(KEY, EPOCH, SegmentId(0), 0, {}, 0)
    for seq, values in ((0, [b"x", b"y"]), (2, [b"cut"])):
        b = make_batch(A, seq, values)
        store.append_batch(KEY, EPOCH, SegmentId(0), b.header, b.body, 5)
    store.open_segment(KEY, EPOCH, SegmentId(1), 2, {A: OriginSeq(2)}, 0)
    for seq in (2, 5, 8):
        b = make_batch(A, seq, [b"1", b"2", b"3"])
        store.append_batch(KEY, EPOCH, SegmentId(1), b.header, b.body, 10)
    chain = [
        ChainSegment(SegmentId(0), 0, 2, VectorOffset({A: 2}), (N1, N2)),
        ChainSegment(SegmentId(1), 2, None, None, (N1, N2, N3)),
    ]
    sealed = store.read(KEY, SegmentId(0), LocalOffset(0), 1 << 20, 2).data
    return store, chain, sealed


def test_a_follower_log_serves_sealed_bytes_to_the_seal_and_the_open_segment_to_the_announced_lac(
    tmp_path: Path,
) -> None:
    store, chain, sealed = follower_store(tmp_path)
    try:
        log = FollowerLog(KEY, store, chain, N2)
        assert log.flushed_offset == 2, "no LAC announced yet: the sealed segment only"
        got = log.read(LocalOffset(0), 1 << 20)
        assert got.data == sealed and got.next_offset == 2, "the tail past the seal is never read"
        assert log.log_end_offset == 2 and log.known_end() == 11 and log.vector() == {A: 11}
        assert store.lacs.announce(KEY, SegmentId(1), 5) and log.flushed_offset == 5
        assert not store.lacs.announce(KEY, SegmentId(1), 4), "an older announcement changes nothing"
        assert store.lacs.announce(KEY, SegmentId(0), 11) and log.flushed_offset == 5, "another segment's LAC"
        store.lacs.announce(KEY, SegmentId(1), 20)
        assert log.flushed_offset == 11, "a LAC past this node's copy: served to the copy's end"
        with pytest.raises(Exception, match="takes no appends"):
            b = make_batch(A, 11, [b"z"])
            log.append(b.header, b.body, 0)
    finally:
        store.close()


def test_outside_the_open_ensemble_a_follower_log_stops_at_the_open_base_and_reads_sealed_ones_elsewhere(
    tmp_path: Path,
) -> None:
    holder, chain, sealed = follower_store(tmp_path / "holder")
    store = ReplicaStore(tmp_path / "other", now_ms=0)
    try:
        log = FollowerLog(KEY, store, chain, N4)
        bound = log.bound()
        assert (bound.end, bound.grows) == (2, False)
        assert log.log_end_offset == log.known_end() == 2 and log.vector() == {A: 2}
        with pytest.raises(SegmentElsewhere):
            log.read(LocalOffset(0), 1 << 20)  # sealed and not held here: a member serves it
        log.cache_remote(SegmentId(0), 0, sealed)
        assert log.read(LocalOffset(0), 1 << 20).data == sealed
        with pytest.raises(OffsetOutOfRange):
            log.read(LocalOffset(2), 1 << 20)  # never the open segment from another node's copy
        assert LeaderEpoch(0) == log.epoch
    finally:
        store.close()
        holder.close()


def test_a_follower_log_of_a_chain_trimmed_to_its_open_segment_has_the_chains_start_vector(tmp_path: Path) -> None:
    """Retention dropped every sealed segment; this node is outside the open one's ensemble: its vector is where the
    chain starts now (the metadata's start vector), not empty, which would claim the partition holds nothing."""
    store = ReplicaStore(tmp_path, now_ms=0)
    try:
        chain = [ChainSegment(SegmentId(1), 2, None, None, (N1, N2, N3))]
        log = FollowerLog(KEY, store, chain, N4, VectorOffset({A: 2}))
        assert log.vector() == {A: 2} and log.log_start_offset == log.log_end_offset == 2
    finally:
        store.close()


# -- a real three-node site ------------------------------------------------------------------------------------


def read_replica(address: str, offset: int = 0) -> tuple[list[tuple[str, int, bytes]], bool]:
    """Every record of ``TOPIC``-0 the node at ``address`` serves with READ_FROM_REPLICA from ``offset``, and
    whether every response said it came from a follower."""
    out: list[tuple[str, int, bytes]] = []
    followers = True
    with open_channel(address) as channel:
        for _ in range(10_000):
            request = pb.FetchRequest(
                topic=TOPIC,
                partition=0,
                offset=offset,
                max_bytes=1 << 20,
                max_wait_ms=200,
                read_from=pb.READ_FROM_REPLICA,
            )
            response = next(iter(pbg.NodeStub(channel).Fetch(request, timeout=10)))
            followers = followers and response.follower_read
            if not response.batches:
                return out, followers
            at = 0
            for h in iter_headers(response.batches):
                out.extend(
                    (str(h.origin), r.origin_seq, bytes(r.value or b""))
                    for r in decode_records(response.batches[at : at + h.size_bytes], h)
                )
                at += h.size_bytes
            offset = response.next_offset
    raise AssertionError("the follower's read did not end")


def follower_matches_leader(site: ClusterSite, follower: int, leader: int) -> bool | str:
    expected = read_partition(site.address(leader), TOPIC, 0)
    got, followers = read_replica(site.address(follower))
    if not followers:
        return f"node {follower} did not serve as a follower"
    return True if got == expected else f"node {follower} serves {len(got)} records, the leader {len(expected)}"


@pytest.mark.slow
def test_a_follower_serves_exactly_what_the_leader_does_and_a_follower_consumer_reads_it_across_a_leader_kill(
    tmp_path: Path,
) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "8192"])
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
        leader = site.wait_leader(TOPIC)
        follower = next(n for n in (1, 2, 3) if n != leader)
        with open_channel(site.address(follower)) as channel:
            with pytest.raises(grpc.RpcError) as refused:  # the default: only the leader serves
                next(iter(pbg.NodeStub(channel).Fetch(pb.FetchRequest(topic=TOPIC, partition=0, offset=0), timeout=10)))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        produce(site, 30, "before")  # ~30 KiB: a few 8 KiB segments sealed, one open
        wait_for(
            f"node {follower} serving what leader {leader} does",
            lambda: follower_matches_leader(site, follower, leader),
            timeout_s=30,
        )

        async def read_through_the_kill() -> list[tuple[str, int, bytes]]:
            """A follower-reads consumer at ``follower`` reads while its leader is killed and writes go on."""
            reader = asyncio.create_task(consume_all(site.address(follower), site.address(follower), 50))
            await asyncio.sleep(0.5)
            site.nodes[leader].kill9()
            await asyncio.get_running_loop().run_in_executor(None, produce, site, 20, "after")
            return (await reader)[0]

        during = asyncio.run(read_through_the_kill())
        new_leader = site.wait_leader(TOPIC, not_node=leader)
        other = next(n for n in site.live() if n != new_leader)
        wait_for(
            f"node {other} serving what the new leader {new_leader} does",
            lambda: follower_matches_leader(site, other, new_leader),
            timeout_s=30,
        )
        expected = read_partition(site.address(new_leader), TOPIC, 0)
        assert len(expected) == 50 and len({(o, s) for o, s, _ in expected}) == 50, "a record lost or doubled"
        assert during == expected, "read at a follower while its leader died: a record the site does not hold"
        got, from_follower = asyncio.run(consume_all(site.address(new_leader), site.address(other), len(expected)))
        assert got == expected, "a consumer reading from a follower does not get what the leader gives"
        assert from_follower > 0, "the consumer read everything from the leader, not from the preferred follower"
        # The preferred node is the killed one: the consumer falls back to the leader and misses nothing.
        got, from_follower = asyncio.run(consume_all(site.address(new_leader), site.address(leader), len(expected)))
        assert got == expected and from_follower == 0, "a consumer whose preferred node is down did not fall back"
        printed = ok(
            georep(
                "consume",
                TOPIC,
                "--from-beginning",
                "--read-from",
                "follower",
                "--prefer",
                site.address(other),
                "--json",
                "--max",
                "50",
                "--timeout",
                "10",
                "--bootstrap",
                site.address(new_leader),
            )
        )
        values = [json.loads(line)["value"] for line in printed.splitlines()]
        assert values == [v.decode() for _, _, v in expected], "georep consume --read-from follower differs"
    finally:
        site.close()


def test_a_consumer_refuses_an_unknown_read_from_and_a_prefer_without_follower_reads() -> None:
    with pytest.raises(InvalidRequest, match="use 'leader'"):
        Consumer("127.0.0.1:1", read_from="nearest")
    with pytest.raises(InvalidRequest, match="with read_from='follower'"):
        Consumer("127.0.0.1:1", prefer="127.0.0.1:2")
    result = georep("consume", "t", "--prefer", "127.0.0.1:2", "--bootstrap", "127.0.0.1:1")
    assert result.returncode == 1 and b"add --read-from follower" in result.stderr, result.stderr  # as --commit-acks


def pull_all(address: str, count: int) -> list[tuple[str, int, bytes]]:
    """What a destination site pulling ``TOPIC``-0 from scratch over ``Replicate`` at ``address`` gets, up to
    ``count`` records (or what came before the stream stalled for 10 s)."""
    want = pb.PullWant(topic=TOPIC, partition=0, have=pb.VectorOffset(), origin_sites=["a"])
    out: list[tuple[str, int, bytes]] = []
    with open_channel(address) as channel:
        call = pbg.NodeStub(channel).Replicate(
            pb.ReplicateRequest(dst_site="b", wants=[want], max_bytes=4096, max_wait_ms=200), timeout=10
        )
        for response in call:
            for chunk in response.chunks:
                at = 0
                for h in iter_headers(chunk.batches):
                    out.extend(
                        (str(h.origin), r.origin_seq, bytes(r.value or b""))
                        for r in decode_records(chunk.batches[at : at + h.size_bytes], h)
                    )
                    at += h.size_bytes
            if len(out) >= count:
                call.cancel()
                break
    return out


def lacking(site: ClusterSite, node: int) -> list[int]:
    """The segments of ``TOPIC``-0 the metadata lists that ``node`` holds no copy of."""
    with open_channel(site.address(node)) as channel:
        held = pbg.SegmentsStub(channel).ListSegments(pb.ListSegmentsRequest(), timeout=5)
    segments = next(p.segments for p in status(site).partitions if p.topic == TOPIC)
    return sorted(set(range(segments)) - {h.segment.segment_id for h in held.segments if h.segment.topic == TOPIC})


@pytest.mark.slow
def test_a_cross_site_pull_at_a_leader_lacking_a_sealed_segment_reads_it_from_a_member(tmp_path: Path) -> None:
    """Four nodes, replication factor 3: each segment leaves one node out, and a leader holds every segment it
    wrote. Leaders are killed (the previous one restarted first, to keep the Raft majority) until one leads that
    lacks a sealed segment; a site pulling from scratch through it gets that segment all the same (it was
    UNAVAILABLE before), read from a member."""
    site = ClusterSite(
        tmp_path,
        4,
        extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "4096", "--repair-delay-ms", "600000"],
    )
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
        site.wait_leader(TOPIC)
        produce(site, 30, "spread")  # ~30 KiB: several 4 KiB segments, their ensembles rotating over the nodes
        dead: int | None = None
        for _ in range(3):
            leader = site.wait_leader(TOPIC, not_node=dead)
            missing = lacking(site, leader)
            if missing:
                break
            if dead is not None:
                site.nodes[dead].start(60)
            site.nodes[leader].kill9()
            dead = leader
        assert missing, "no leader lacked a sealed segment: nothing was read elsewhere"
        expected = read_partition(site.address(leader), TOPIC, 0)
        assert len(expected) == 30
        assert pull_all(site.address(leader), len(expected)) == expected, (
            f"the pull through node {leader}, which lacks segments {missing}, differs from its log"
        )
    finally:
        site.close()
