"""Interest-based links on real nodes (issue 25): a chain a -> b -> c of links in mode "interest". Nothing moves
until a reader at c subscribes; then b and c pull only the topics it reads, history first, with every coordinate
as a holds it; when the reader leaves, pulling stops after the linger. A report that could not come from its
sender is refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from georep.client.consumer import Consumer
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites, wait_until

INTEREST = ['mode = "interest"']
LINGER = ["interest_linger_ms = 500"]
TOPICS = ("orders/eu/x", "orders/us/y", "metrics/z")


@pytest.fixture
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    net = Sites(
        tmp_path_factory.mktemp("interest"),
        ["a", "b", "c"],
        [("a", "b"), ("b", "c")],
        site_lines={"b": LINGER, "c": LINGER},
        link_lines={("a", "b"): INTEREST, ("b", "c"): INTEREST},
    )
    try:
        net.start()
        for topic in TOPICS:
            net.stub("a").CreateTopic(pb.CreateTopicRequest(name=topic, partitions=2), timeout=10)
        wait_until("c knows every topic", lambda: all(_known(net, "c", t) for t in TOPICS))
        yield net
    finally:
        net.close()


def _known(net: Sites, site: str, topic: str) -> bool:
    try:
        net.stub(site).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
    except grpc.RpcError:
        return False
    return True


def _records(net: Sites, site: str, topic: str) -> int:
    return sum(n for v in net.vectors(site, topic).values() for n in v.values())


async def _produce(net: Sites, topic: str, n: int, tag: str) -> None:
    async with Producer(net.address("a"), linger_ms=1) as producer:
        await asyncio.gather(*(producer.send(topic, f"{tag}{i}".encode(), key=f"{tag}{i}".encode()) for i in range(n)))


@pytest.mark.slow  # node processes through several steps: make test runs it, test-quick does not
def test_an_interest_link_pulls_only_what_a_reader_behind_it_reads_history_first_and_stops_after_it_leaves(
    chain: Sites,
) -> None:
    for topic in TOPICS:
        asyncio.run(_produce(chain, topic, 20, "before"))
    time.sleep(1.5)  # a window in which an "all" link would have moved everything (the test waits on no condition)
    assert all(_records(chain, s, t) == 0 for s in "bc" for t in TOPICS), "nothing is read: nothing moves"

    async def read_at_c() -> list[str]:
        async with Consumer(
            chain.address("c"), group_id="eu", auto_offset_reset="earliest", metadata_max_age_ms=200
        ) as consumer:
            consumer.subscribe(pattern="orders/eu/**")
            got: list[str] = []
            deadline = time.monotonic() + 30
            while len(got) < 20 and time.monotonic() < deadline:
                got += [(r.value or b"").decode() for r in await consumer.poll(timeout_ms=200)]
            return got

    got = asyncio.run(read_at_c())
    assert sorted(got) == sorted(f"before{i}" for i in range(20)), got  # the history, from the earliest
    assert chain.vectors("c", "orders/eu/x") == chain.vectors("a", "orders/eu/x")  # the same coordinates
    assert chain.vectors("b", "orders/eu/x") == chain.vectors("a", "orders/eu/x")
    for site in "bc":
        assert _records(chain, site, "orders/us/y") == 0 and _records(chain, site, "metrics/z") == 0
    assert "orders/eu/x for site c (via c,b)" in _link(chain, "a").interests  # what b asks a, for whom
    # The reader left: once the linger (0.5 s) ran out at b and c, nothing more of the topic moves.
    wait_until(
        "b and c pull nothing more", lambda: not _link(chain, "a").interest_topics + _link(chain, "b").interest_topics
    )
    assert not _link(chain, "b").interests
    asyncio.run(_produce(chain, "orders/eu/x", 5, "after"))
    time.sleep(1.5)  # a window in which a pull would have moved them
    assert _records(chain, "c", "orders/eu/x") == 20 and _records(chain, "b", "orders/eu/x") == 20


def _link(net: Sites, src: str) -> pb.LinkStatus:
    """The status of the link from ``src`` (at the site it leads to)."""
    dst = {"a": "b", "b": "c"}[src]
    (link,) = [li for li in net.status(dst).links if li.src == src]
    return link


def test_a_report_that_could_not_come_from_its_sender_is_refused(chain: Sites) -> None:
    stub = chain.stub("a")
    good = pb.InterestEntry(filter="orders/**", site="b", path=["b"])
    with pytest.raises(grpc.RpcError, match="no link a -> c"):
        stub.ReportInterest(pb.ReportInterestRequest(reporter="c", entries=[good], lease_ms=5000), timeout=5)
    forged = pb.InterestEntry(filter="orders/**", site="c", path=["c", "a", "b"])
    with pytest.raises(grpc.RpcError, match="has the path"):
        stub.ReportInterest(pb.ReportInterestRequest(reporter="b", entries=[forged], lease_ms=5000), timeout=5)
    bad_filter = pb.InterestEntry(filter="orders*", site="b", path=["b"])
    with pytest.raises(grpc.RpcError, match="wildcard"):
        stub.ReportInterest(pb.ReportInterestRequest(reporter="b", entries=[bad_filter], lease_ms=5000), timeout=5)
    with pytest.raises(grpc.RpcError, match="lease_ms"):
        stub.ReportInterest(pb.ReportInterestRequest(reporter="b", entries=[good], lease_ms=0), timeout=5)


class _Replicator:
    """What InterestLinks reads of a node's replicator: its topology, site, links and clock."""

    def __init__(self, toml: str, site: str) -> None:
        from georep.replication.links import LinkManager
        from topology.model import parse_topology

        self.topology = parse_topology(toml)
        self.site = site
        self.links = LinkManager(self.topology, site)
        self.pullers = {link.src: _Puller() for link in self.topology.links if link.dst == site}

    def now_ms(self) -> int:
        return 1_000


class _Puller:
    """A puller's side InterestLinks drives: it is asked to tick its session at once."""

    def __init__(self) -> None:
        self.ticks_asked = 0

    def tick_soon(self) -> None:
        self.ticks_asked += 1


def test_a_new_reader_is_an_interest_at_the_next_tick_not_a_second_later() -> None:
    """A site takes its readers again every LOCAL_S, and at once (the next tick, every 0.2 s) when a group member
    joins or a topic gets its first fetch: that is the first hop of a new subscription's first record (issue 25's
    target, 2 s over a chain of two interest links). Planted: without the service's signal, the reader waits."""
    from georep.server.interest_links import InterestLinks

    toml = '[sites.a]\nnodes = ["127.0.0.1:1"]\n[sites.b]\nnodes = ["127.0.0.1:2"]\n'
    toml += '[[links]]\nsrc = "a"\ndst = "b"\nmode = "interest"\n'
    links = InterestLinks(_Replicator(toml, "b"))  # type: ignore[arg-type]
    readers: set[str] = set()
    moved = [0]
    links.local, links.local_moved = lambda: set(readers), lambda: moved[0]
    links.tick(0.0)
    assert links.table.advert_for("a") == frozenset()
    readers.add("orders/eu/x")
    links.tick(0.2)  # nothing said a reader came: taken again only after LOCAL_S
    assert links.table.advert_for("a") == frozenset()
    moved[0] += 1
    asked = links.r.pullers["a"].ticks_asked  # type: ignore[index]
    links.tick(0.4)
    assert [e[0] for e in links.table.advert_for("a")] == ["orders/eu/x"]
    # and the pull from a starts now, not at the session's next tick (planted: no tick_soon, this fails)
    assert links.r.pullers["a"].ticks_asked == asked + 1  # type: ignore[index]
    # The watch loop takes a reader that came within WATCH_S, with no replicator tick at all.
    readers.add("orders/eu/y")
    moved[0] += 1

    async def watched() -> None:
        task = asyncio.create_task(links.watch_loop())
        try:
            async with asyncio.timeout(5):
                while len(links.table.advert_for("a")) < 2:
                    await asyncio.sleep(0.005)
        finally:
            task.cancel()

    asyncio.run(watched())
    assert sorted(e[0] for e in links.table.advert_for("a")) == ["orders/eu/x", "orders/eu/y"]
