"""The issue's real-process scenario on five sites: a ring both ways plus the chords a -> c and c -> e.

Writers at every site at once, site c ``kill -9``-ed in mid-stream and
restarted, then one link cut with ``georep link cut`` so data must route
around it, then healed. At the end every site holds every acknowledged record
exactly once (I1-I4 of ARCHITECTURE.md) and all vectors are identical.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

import pytest

from georep.client.producer import Producer, RecordMetadata
from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites, check_invariants, converged, produce, wait_until

NAMES = ["a", "b", "c", "d", "e"]
RING = [(x, y) for i, x in enumerate(NAMES) for y in (NAMES[i - 1], NAMES[(i + 1) % len(NAMES)])]
LINKS = [*RING, ("a", "c"), ("c", "e")]
TOPIC = "events"
N = 400  # records per producer and wave

Sent = set[tuple[bytes, bytes]]


def georep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=60)


def origin_totals(sites: Sites, site: str) -> dict[str, int]:
    """Records of each origin site that ``site`` holds, over all partitions (epochs folded together)."""
    totals: dict[str, int] = {}
    for vector in sites.vectors(site, TOPIC).values():
        for origin, next_seq in vector.items():
            name = origin.split("@")[0]
            totals[name] = totals.get(name, 0) + next_seq
    return totals


def upstreams(sites: Sites, site: str, origin_site: str) -> set[str]:
    """The upstreams ``site`` pulls ``origin_site``'s records from, over all partitions."""
    return {
        lag.upstream
        for ps in sites.status(site).partitions
        if ps.topic == TOPIC
        for lag in ps.lags
        if lag.origin.startswith(origin_site + "@")
    }


async def paced(address: str, prefix: str, n: int, acked: list[int], every: int = 8) -> Sent:
    """Like ``produce``, but spread over ~0.5 s so a kill lands mid-stream; ``acked[0]`` counts acks."""

    def count(fut: asyncio.Future[RecordMetadata]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            acked[0] += 1

    sent: Sent = set()
    async with Producer(address, linger_ms=2, batch_size=4096) as producer:
        futures = []
        for i in range(n):
            key, value = f"{prefix}-k{i}".encode(), f"{prefix}-v{i}".encode() * 3
            fut = producer.send(TOPIC, value, key=key)
            fut.add_done_callback(count)
            futures.append(fut)
            sent.add((key, value))
            if i % every == every - 1:
                await asyncio.sleep(0.01)
        await producer.flush()
        await asyncio.gather(*futures)  # raises if any record was not acknowledged
    return sent


@pytest.mark.slow
def test_ring5_kill9_and_cut_link_converge_exactly_once(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(NAMES, LINKS)
    sites.start()
    sites.stub("d").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=3))
    wait_until("the topic exists at every site", lambda: all(sites.vectors(s, TOPIC) for s in NAMES), 15)
    c = sites.nodes["c"]
    others = [s for s in NAMES if s != "c"]

    # -- 1 + 2: five concurrent writers; c is killed -9 in mid-stream and restarted --------------------------
    async def writers_and_kill9() -> Sent:
        acked = {s: [0] for s in NAMES}
        tasks = {s: asyncio.ensure_future(paced(sites.address(s), f"{s}1", N, acked[s])) for s in NAMES}
        while acked["c"][0] < N // 4:  # c has acknowledged a quarter of its records, and is still writing
            assert not tasks["c"].done(), "c's producer finished before the kill; pace it slower"
            await asyncio.sleep(0.005)
        c.kill9()
        killed_at = acked["c"][0]
        assert killed_at < N, "the kill did not land in mid-stream"
        assert any(acked[s][0] < N for s in others), "the other writers finished before c was killed"
        # the other four keep writing (and replicating among themselves) while c is down
        sent = set().union(*await asyncio.gather(*(tasks[s] for s in others)))
        assert not c.alive() and acked["c"][0] < N
        return sent | await restart_c(tasks["c"])

    async def restart_c(c_writer: asyncio.Future[Sent]) -> Sent:
        # a, b, d, e converge without c: d gets b's records over e, b gets d's over a
        four_origins = {s: N for s in others}

        def four_converged() -> bool:
            totals = [origin_totals(sites, s) for s in others]
            return all({o: t.get(o, 0) for o in others} == four_origins for t in totals) and converged(
                sites, others, TOPIC
            )

        await asyncio.to_thread(wait_until, "a, b, d, e converge while c is down", four_converged, 20)
        assert upstreams(sites, "d", "b") == {"e"}, "d should pull b's records over e while c is down"
        await asyncio.to_thread(c.start)
        # c's producer reconnects and re-sends what was unanswered; every one of its records gets acked
        return await asyncio.wait_for(c_writer, 30)

    expected = asyncio.run(writers_and_kill9())
    assert len(expected) == len(NAMES) * N
    expected |= asyncio.run(produce(sites.address("c"), TOPIC, "c2", N))  # c writes again after its restart
    wait_until("all hold all after c restarts", lambda: converged(sites, NAMES, TOPIC, len(expected)), 30)
    assert origin_totals(sites, "a") == {s: N for s in others} | {"c": 2 * N}, "c's retried records were stored twice"

    # -- 3: cut b -> c; c must pull b's records over a (b -> a -> c), then heal ------------------------------
    assert upstreams(sites, "c", "b") == {"b"}
    cut = georep("link", "cut", "b", "c", "--topology", str(sites.topology))
    assert cut.returncode == 0, cut.stderr
    assert "link b -> c: cut (state down)" in cut.stdout

    async def everyone(tag: str) -> Sent:
        return set().union(*await asyncio.gather(*(produce(sites.address(s), TOPIC, f"{s}{tag}", N) for s in NAMES)))

    expected |= asyncio.run(everyone("3"))
    wait_until("every site converges with b -> c cut", lambda: converged(sites, NAMES, TOPIC, len(expected)), 30)
    links = {lk.src: lk for lk in sites.status("c").links}
    assert links["b"].state == "down" and "georep link heal" in links["b"].last_error
    assert upstreams(sites, "c", "b") == {"a"}, "with b -> c cut, c should pull b's records over a"

    heal = georep("link", "heal", "b", "c", "--topology", str(sites.topology))
    assert heal.returncode == 0, heal.stderr
    wait_until("c pulls b directly again", lambda: upstreams(sites, "c", "b") == {"b"}, 15)
    expected |= asyncio.run(everyone("4"))
    wait_until("every site converges after the heal", lambda: converged(sites, NAMES, TOPIC, len(expected)), 30)

    # -- 4: consume at every site ------------------------------------------------------------------------------
    check_invariants(sites, NAMES, TOPIC, expected)
    vectors = {s: sites.vectors(s, TOPIC) for s in NAMES}
    assert all(v == vectors["a"] for v in vectors.values()), vectors
    assert sum(sum(p.values()) for p in vectors["a"].values()) == len(expected) == (3 * len(NAMES) + 1) * N
    for s in NAMES:
        status = sites.status(s)
        assert not status.conflicts, (s, status.conflicts)
        assert all(lk.state == "streaming" for lk in status.links), (s, status.links)
