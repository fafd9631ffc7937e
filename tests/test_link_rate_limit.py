"""Issue 26: a link's bandwidth limit (``rate_limit_bytes_per_s`` in the topology): the pacer's bound as a
property, the topology's checks, and two real sites whose link moves no faster than its limit."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from georep.client import Producer
from georep.proto import georep_pb2 as pb
from georep.replication.pacing import Pacer, share
from georep.server.process import NODE_INFO
from tests.support.sites import Sites, converged, wait_until
from topology.model import RATE_LIMIT_MIN, InvalidTopology, parse_topology

RATE = 1000.0


@given(
    st.lists(
        st.tuples(st.integers(1, 3000), st.sampled_from([0.0, 0.0, 0.5, 3.0])),  # a message, then any idle time
        min_size=1,
        max_size=60,
    )
)
def test_a_paced_stream_sends_at_most_a_second_of_the_rate_beyond_it_and_waits_no_longer_than_it_must(
    messages: list[tuple[int, float]],
) -> None:
    """Sent at or after the time the pacer names: by message k's send, what was sent before it is at most a second
    of the rate plus the rate times the time since the start. And a sender that never idles is never held more than
    the rate asks: its k-th message leaves by (bytes before it - one second of the rate) / rate."""
    pacer = Pacer.start(RATE, 0.0)
    now, before, busy = 0.0, 0, True
    for size, idle in messages:
        assert before <= RATE + RATE * now + 1e-6
        if busy:
            assert now <= max(0.0, (before - RATE) / RATE) + 1e-6
        now += pacer.charge(size, now) + idle
        busy = busy and idle == 0.0
        before += size


def test_a_sites_share_is_the_limit_over_its_pulling_nodes() -> None:
    assert share(None, 3) is None
    assert share(90_000, 3) == 30_000 and share(90_000, 0) == 90_000


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("0", "must be an integer of at least"),
        ('"fast"', "must be an integer of at least"),
        ("true", "must be an integer of at least"),
        (str(RATE_LIMIT_MIN - 1), f"at least {RATE_LIMIT_MIN}"),
    ],
)
def test_a_bad_limit_is_refused_naming_the_link(value: str, error: str) -> None:
    text = (
        '[sites.a]\nnodes = ["127.0.0.1:7101"]\n[sites.b]\nnodes = ["127.0.0.1:7201"]\n'
        f'[[links]]\nsrc = "a"\ndst = "b"\nrate_limit_bytes_per_s = {value}\n'
    )
    with pytest.raises(InvalidTopology, match=r"link #1 \(a -> b\): rate_limit_bytes_per_s") as raised:
        parse_topology(text)
    assert error in str(raised.value)


def test_a_limit_is_read_per_link() -> None:
    text = (
        '[sites.a]\nnodes = ["127.0.0.1:7101"]\n[sites.b]\nnodes = ["127.0.0.1:7201"]\n'
        '[[links]]\nsrc = "a"\ndst = "b"\nrate_limit_bytes_per_s = 1250000\n[[links]]\nsrc = "b"\ndst = "a"\n'
    )
    topology = parse_topology(text)
    assert topology.link("a", "b").rate_limit_bytes_per_s == 1_250_000
    assert topology.link("b", "a").rate_limit_bytes_per_s is None


async def produce_random(address: str, records: int, value_bytes: int) -> None:
    """Records of random bytes, which compression on the wire cannot shrink: the limit counts bytes on the wire."""
    async with Producer(address, linger_ms=2, batch_size=4096) as producer:
        sent = [producer.send("t", os.urandom(value_bytes)) for _ in range(records)]
        await producer.flush()
        await asyncio.gather(*sent)


@pytest.mark.slow  # the limit holds the catch-up to about 5 s
def test_a_site_catching_up_over_a_limited_link_takes_at_least_what_the_limit_allows(tmp_path: Path) -> None:
    """b starts after a holds 400 KB of random bytes (which go as stored): a's stream to b may send a second of
    the limit at once and then the limit, plus one message of at most a second of it, so b cannot hold everything
    sooner than (bytes - 2 s of the limit) / limit after it starts pulling. A lower bound: a slow machine only
    makes it later. Planted: without the pacer's wait, b converges in well under a second."""
    limit, records, value_bytes = RATE_LIMIT_MIN, 400, 1000
    sites = Sites(tmp_path, ["a", "b"], [("a", "b")], link_lines={("a", "b"): [f"rate_limit_bytes_per_s = {limit}"]})
    try:
        sites.start("a")
        sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
        asyncio.run(produce_random(sites.address("a"), records, value_bytes))
        stored = sum(
            p.size_bytes for p in sites.stub("a").DescribeTopic(pb.DescribeTopicRequest(name="t")).partition_states
        )
        assert stored >= records * value_bytes
        sites.start("b")
        # From b's node.json, which b writes before its pullers start (the test notices it later, under load).
        started = (sites.nodes["b"].data_dir / NODE_INFO).stat().st_mtime
        wait_until("b holds a's records", lambda: converged(sites, ["a", "b"], "t", records), 120)
        took = time.time() - started
        assert took >= (stored - 2 * limit) / limit, f"{stored} bytes in {took:.2f} s over a {limit} B/s link"
    finally:
        sites.close()
