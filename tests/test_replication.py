"""Replication (issue 3): the source and sink cores over ``MemoryLog``, then real ``georep node`` processes.

Process tests write a topology TOML naming the nodes' ports (picked free
first), start one node per site with ``--topology``, and check the invariants
of ARCHITECTURE.md over what each site's log holds:

* I1 the same coordinate has the same key, value, headers and timestamp everywhere;
* I2 no site holds a coordinate twice;
* I3 within a site's log, each origin's records are in origin-seq order;
* I4 every site holds every record.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.record.batch import iter_headers, parse_header
from georep.replication.sink import CorruptChunk, apply_chunk
from georep.replication.source import FIRST_MESSAGE_BYTES, ReplicaSource
from georep.server.process import NodeProcess, NodeStartError
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from tests.support.sites import (
    TRIANGLE,
    Sites,
    catalog_synced,
    check_invariants,
    converged,
    free_ports,
    origin_batch,
    produce,
    topology_toml,
    wait_until,
)
from topology.ids import SiteId

A1 = Origin(SiteId("a"), 1)
B1 = Origin(SiteId("b"), 1)
KEY = ("t", 0)


# -- cores over MemoryLog -------------------------------------------------------


def put(log: MemoryLog, batch: bytes, now_ms: int = 5_000) -> None:
    log.append(parse_header(batch), [memoryview(batch)[24:]], now_ms)


def coordinates(log: MemoryLog) -> list[tuple[Origin, int, int]]:
    data = log.read(log.log_start_offset, 1 << 30).data if log.log_end_offset else b""
    return [(h.origin, h.base_origin_seq, h.last_origin_seq) for h in iter_headers(data)]


def drain(source: ReplicaSource, max_bytes: int = 1 << 20) -> list[tuple[tuple[str, int], bytes]]:
    out = []
    for _ in range(1000):
        chunks = source.next_chunks(max_bytes)
        if not chunks and not source.has_more():
            break
        out.extend((c.key, c.batches) for c in chunks)
    return out


def test_source_sends_only_what_the_have_vector_lacks_for_wanted_origin_sites() -> None:
    src = MemoryLog()
    for seq in (0, 2, 4):
        put(src, origin_batch(A1, seq))
        put(src, origin_batch(B1, seq))
    src.flush()
    source = ReplicaSource({KEY: src}, {KEY: ({A1: 2}, ("a",))})
    sent = b"".join(data for _key, data in drain(source))
    assert [(h.origin, h.base_origin_seq) for h in iter_headers(sent)] == [(A1, 2), (A1, 4)]
    assert source.next_chunks(1 << 20) == [] and not source.has_more()
    beat = source.heartbeat()
    assert [(c.key, c.batches, c.src_vector) for c in beat] == [(KEY, b"", {A1: 6, B1: 6})]


def test_source_never_serves_unflushed_batches_and_resumes_after_the_flush() -> None:
    src = MemoryLog()
    put(src, origin_batch(A1, 0))
    src.flush()
    put(src, origin_batch(A1, 2))  # appended, not yet durable
    source = ReplicaSource({KEY: src}, {KEY: ({}, ("a",))})
    first = drain(source)
    assert [h.base_origin_seq for _k, d in first for h in iter_headers(d)] == [0]
    assert not source.has_more()
    src.flush()
    source.flushed(KEY)  # the driver's word: the source looks only at partitions whose durable offset moved
    assert source.has_more()
    assert [h.base_origin_seq for _k, d in drain(source) for h in iter_headers(d)] == [2]


def test_source_round_robins_partitions_and_respects_max_bytes() -> None:
    logs = {("t", p): MemoryLog() for p in range(2)}
    for log in logs.values():
        for seq in range(0, 20, 2):
            put(log, origin_batch(A1, seq))
        log.flush()
    size = len(origin_batch(A1, 0))
    source = ReplicaSource(logs, {k: ({}, ("a",)) for k in logs})
    calls = []
    for _ in range(4):
        chunks = source.next_chunks(3 * size)
        assert sum(len(c.batches) for c in chunks) <= 3 * size
        calls.append([c.key for c in chunks])
    assert {calls[0][0], calls[1][0]} == {("t", 0), ("t", 1)}  # each call starts at the next partition
    # one oversized batch still goes out whole
    assert [len(c.batches) for c in ReplicaSource(logs, {KEY: ({}, ("a",))}).next_chunks(1)] == [size]


def test_a_stream_sends_a_small_first_message_of_data_then_doubles_up_to_max_bytes() -> None:
    """A new subscription's stream hands its first partitions on at once: at 100,000-topic sites a first message
    of 1 MiB meant 1,000 cold partitions written, synced and served at each hop before the first record. Planted:
    without the cap the first message is max_bytes; without the doubling every message stays small."""
    logs = {("t", p): MemoryLog() for p in range(64)}
    for log in logs.values():
        for seq in range(0, 200, 2):
            put(log, origin_batch(A1, seq, tag=b"x" * 300))
        log.flush()
    batch = len(origin_batch(A1, 0, tag=b"x" * 300))
    total = 64 * 100 * batch
    source = ReplicaSource(logs, {k: ({}, ("a",)) for k in logs})
    assert source.step(0, 1 << 20).heartbeat  # the summary first
    sizes = []
    while sum(sizes) < total:
        serve = source.step(0, 1 << 20)
        sizes.append(sum(len(c.batches) for c in serve.chunks))
    for i, size in enumerate(sizes):
        assert 0 < size <= min(FIRST_MESSAGE_BYTES << i, 1 << 20) + batch, sizes  # doubling, never more
    assert max(sizes) > (1 << 20) - 2 * batch, sizes  # up to max_bytes
    assert len(sizes) < 10, sizes


def test_apply_appends_verbatim_skips_covered_and_stops_at_a_gap() -> None:
    src, dst = MemoryLog(), MemoryLog()
    for seq in (0, 2, 4):
        put(src, origin_batch(A1, seq))
    src.flush()
    chunk = src.read(0, 1 << 20).data
    out = apply_chunk(dst, chunk, now_ms=9_000)
    assert (out.appended_batches, out.appended_records, out.skipped_batches, out.gap) == (3, 6, 0, None)
    assert out.lag_ms == 9_000 - 1_005

    # the CRC-covered bytes are identical; only the 24-byte local prefix is the dst's
    def bodies(data: bytes) -> list[bytes]:
        out, pos = [], 0
        for h in iter_headers(data, verify=True):
            out.append(data[pos + 24 : pos + h.size_bytes])
            pos += h.size_bytes
        return out

    assert bodies(dst.read(0, 1 << 20).data) == bodies(chunk)
    again = apply_chunk(dst, chunk, now_ms=9_001)
    assert (again.appended_batches, again.skipped_batches) == (0, 3)
    gap = apply_chunk(dst, origin_batch(A1, 8) + origin_batch(A1, 10), now_ms=9_002)
    assert gap.appended_batches == 0 and gap.gap is not None and gap.gap.expected == 6
    assert coordinates(dst) == [(A1, 0, 1), (A1, 2, 3), (A1, 4, 5)]


def test_apply_rejects_a_corrupt_chunk_and_appends_nothing_of_it() -> None:
    good = origin_batch(A1, 0)
    bad = bytearray(origin_batch(A1, 2))
    bad[-1] ^= 0xFF
    dst = MemoryLog()
    with pytest.raises(CorruptChunk, match="CRC"):
        apply_chunk(dst, good + bytes(bad), now_ms=1)
    with pytest.raises(CorruptChunk, match="partial"):
        apply_chunk(dst, good + good[:50], now_ms=1)
    assert dst.log_end_offset == 0


def test_source_to_sink_over_a_cycle_holds_each_coordinate_once() -> None:
    """a and b each write, then pull from each other twice: nothing is stored twice, both converge."""
    logs = {"a": MemoryLog(), "b": MemoryLog()}
    for seq in range(0, 6, 2):
        put(logs["a"], origin_batch(A1, seq, tag=b"a"))
        put(logs["b"], origin_batch(B1, seq, tag=b"b"))
    for _round in range(2):
        for dst, src in (("a", "b"), ("b", "a")):
            logs[src].flush()
            source = ReplicaSource({KEY: logs[src]}, {KEY: (logs[dst].vector(), ("a", "b"))})
            for _key, data in drain(source):
                apply_chunk(logs[dst], data, now_ms=10)
    for log in logs.values():
        assert log.vector() == {A1: 6, B1: 6}
        coords = coordinates(log)
        assert len(coords) == len(set(coords)) == 6


# -- real processes -------------------------------------------------------------


def test_two_sites_replicate_a_topic_and_its_records(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b")])
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="orders", partitions=2, config={"segment_ms": "60000"}))
    wait_until("the topic exists at b", lambda: sites.vectors("b", "orders") != {}, 10)
    desc = sites.stub("b").DescribeTopic(pb.DescribeTopicRequest(name="orders"))
    assert desc.partitions == 2 and desc.config["segment_ms"] == "60000"
    expected = asyncio.run(produce(sites.address("a"), "orders", "a", 500))
    wait_until("b holds what a holds", lambda: converged(sites, ["a", "b"], "orders", 500), 20)
    check_invariants(sites, ["a", "b"], "orders", expected)
    status = sites.status("b")
    (link,) = status.links
    assert (link.src, link.dst, link.state) == ("a", "b", "streaming")
    assert link.applied_batches > 0 and link.applied_bytes > 0
    lags = {lag.origin: lag for ps in status.partitions if ps.topic == "orders" for lag in ps.lags}
    assert {lag.upstream for lag in lags.values()} == {"a"} and all(lag.lag_records == 0 for lag in lags.values())
    # a does not pull from b: b's writes stay at b
    asyncio.run(produce(sites.address("b"), "orders", "b", 10))
    time.sleep(1)
    assert sum(sum(v.values()) for v in sites.vectors("a", "orders").values()) == 500


@pytest.mark.slow
def test_triangle_converges_with_writes_at_every_site(make_sites: Callable[..., Sites]) -> None:
    names = ["a", "b", "c"]
    sites = make_sites(names, TRIANGLE)
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="events", partitions=3))
    wait_until("the topic reaches b and c", lambda: all(sites.vectors(s, "events") for s in ("b", "c")), 10)

    async def everyone() -> set[tuple[bytes, bytes]]:
        sets = await asyncio.gather(*(produce(sites.address(s), "events", s, 1500) for s in names))
        return set().union(*sets)

    expected = asyncio.run(everyone())
    wait_until("every site holds every record", lambda: converged(sites, names, "events", 4500), 30)
    check_invariants(sites, names, "events", expected)
    for s in names:
        status = sites.status(s)
        assert sorted(lk.state for lk in status.links) == ["streaming", "streaming"], status.links
        assert not status.conflicts
        # each origin came over about one path: a cycle costs (almost) nothing
        applied = sum(lk.applied_batches for lk in status.links)
        skipped = sum(lk.skipped_batches for lk in status.links)
        assert skipped <= applied // 2 + 5, (s, applied, skipped)


@pytest.mark.slow
def test_a_site_killed_mid_stream_restarts_and_catches_up(make_sites: Callable[..., Sites]) -> None:
    names = ["a", "b", "c"]
    sites = make_sites(names, TRIANGLE)
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="events", partitions=2))
    wait_until("the topic reaches b and c", lambda: all(sites.vectors(s, "events") for s in ("b", "c")), 10)

    async def phase() -> set[tuple[bytes, bytes]]:
        first = await asyncio.gather(*(produce(sites.address(s), "events", f"{s}1", 1000) for s in names))
        # c dies while a and b keep writing and replicating to each other
        writers = asyncio.gather(*(produce(sites.address(s), "events", f"{s}2", 3000) for s in ("a", "b")))
        await asyncio.sleep(0.2)
        sites.nodes["c"].kill9()
        second = await writers
        return set().union(*first, *second)

    expected = asyncio.run(phase())
    assert not sites.nodes["c"].alive()
    sites.nodes["c"].start()
    expected |= asyncio.run(produce(sites.address("c"), "events", "c3", 500))
    wait_until("every site holds every record", lambda: converged(sites, names, "events", len(expected)), 40)
    check_invariants(sites, names, "events", expected)


@pytest.mark.slow
def test_data_routes_around_a_stopped_site_and_the_route_comes_back(make_sites: Callable[..., Sites]) -> None:
    """a -> b -> d and a -> c -> d: with b stopped, d still gets a's records, over c."""
    names = ["a", "b", "c", "d"]
    sites = make_sites(names, [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
    wait_until("the topic reaches d", lambda: sites.vectors("d", "t") != {}, 10)
    expected = asyncio.run(produce(sites.address("a"), "t", "x", 300))
    wait_until("d holds a's records", lambda: converged(sites, names, "t", 300), 20)

    def upstream_of_a(site: str) -> str:
        (ps,) = [p for p in sites.status(site).partitions if p.topic == "t"]
        return next(lag.upstream for lag in ps.lags if lag.origin.startswith("a@"))

    # Cheapest path, ties to the lowest id; a heavy load can stall b's link for a moment, and the route then
    # comes back to b: a wait, not a first look.
    wait_until("d pulls a over b", lambda: upstream_of_a("d") == "b", 30)
    sites.nodes["b"].stop()
    expected |= asyncio.run(produce(sites.address("a"), "t", "y", 300))
    wait_until("d holds a's new records over c", lambda: converged(sites, ["a", "c", "d"], "t", 600), 20)
    status = {lk.src: lk for lk in sites.status("d").links}
    assert status["b"].state == "down" and status["b"].last_error
    assert upstream_of_a("d") == "c"
    sites.nodes["b"].start()
    expected |= asyncio.run(produce(sites.address("a"), "t", "z", 300))
    wait_until("b is back and everyone converges", lambda: converged(sites, names, "t", 900), 20)
    wait_until("d pulls a over b again", lambda: upstream_of_a("d") == "b", 10)
    check_invariants(sites, names, "t", expected)


def test_two_sites_creating_a_topic_with_different_partition_counts_converge_to_the_larger(
    make_sites: Callable[..., Sites],
) -> None:
    """Before topic entries (issue 23) unequal counts were a conflict that stopped the topic replicating; now
    the count only grows, so both sites take the larger, and every partition's records cross the link."""
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start("a", "b")  # each site creates topics once it has synced with the other (first_sync.py)
    wait_until("a and b synced", lambda: [catalog_synced(sites.nodes[s].data_dir) for s in "ab"] == [["b"], ["a"]])
    sites.nodes["b"].stop()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="x", partitions=2))
    sites.nodes["a"].stop()
    sites.start("b")
    sites.stub("b").CreateTopic(pb.CreateTopicRequest(name="x", partitions=3))
    sites.start("a")
    wait_until("a takes b's larger count", lambda: len(sites.vectors("a", "x")) == 3, 20)
    asyncio.run(produce(sites.address("a"), "x", "a", 50))
    wait_until("b holds what a holds", lambda: sites.vectors("b", "x") == sites.vectors("a", "x"), 20)
    assert sum(n for v in sites.vectors("b", "x").values() for n in v.values()) == 50
    for site in ("a", "b"):
        assert not sites.status(site).conflicts


def test_replicate_refuses_unknown_partitions_and_bad_vectors(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b")])
    sites.start("a")
    stub = sites.stub("a")
    stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))

    def first(request: pb.ReplicateRequest) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.Replicate(request, timeout=5)))
        return info.value

    missing = first(pb.ReplicateRequest(dst_site="b", wants=[pb.PullWant(topic="t", partition=5)]))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "partition 5" in missing.details()
    bad = pb.VectorOffset(entries=[pb.OriginSeq(site="Not A Site", epoch=1, next_seq=3)])
    invalid = first(pb.ReplicateRequest(dst_site="b", wants=[pb.PullWant(topic="t", partition=0, have=bad)]))
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT and "have-vector" in invalid.details()
    # a valid request is answered at once with a heartbeat: a summary of what a holds, nothing of an empty partition
    stream = stub.Replicate(pb.ReplicateRequest(dst_site="b", wants=[pb.PullWant(topic="t", partition=0)]))
    assert list(next(iter(stream)).chunks) == []
    stream.cancel()


def test_a_site_missing_from_the_topology_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    topology = tmp_path / "t.toml"
    topology.write_text(topology_toml({"a": free_ports(1)[0]}, []))
    node = NodeProcess(site="zz", data_dir=tmp_path / "zz", extra_args=["--topology", str(topology)])
    with pytest.raises(NodeStartError, match=r"site 'zz' is not in .*sites: a"):
        node.start(timeout_s=20)


def test_metrics_show_links_applied_batches_and_lag(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b")])
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="m", partitions=1))
    wait_until("the topic exists at b", lambda: sites.vectors("b", "m") != {}, 10)
    asyncio.run(produce(sites.address("a"), "m", "a", 100))
    wait_until("b holds a's records", lambda: converged(sites, ["a", "b"], "m", 100), 20)
    text = urllib.request.urlopen(f"http://{sites.nodes['b'].metrics_address}/metrics", timeout=5).read().decode()
    assert 'georep_link_state{dst="b",src="a",state="streaming"} 1.0' in text
    applied = [line for line in text.splitlines() if line.startswith("georep_replication_applied_batches_total{")]
    assert applied and float(applied[0].split()[-1]) > 0
    assert 'georep_replication_lag_seconds{origin="a@' in text and "georep_topic_conflicts 0.0" in text
