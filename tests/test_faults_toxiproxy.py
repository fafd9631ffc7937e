"""Network faults between sites and between clients and nodes, injected through the Toxiproxy API with the
unmodified toxiproxy-python client: georep's fault proxy, or a real Toxiproxy when TOXIPROXY_URL is set.

Two sites a and b, linked both ways, each behind a proxy that the topology names as its address: b pulls from a
through a's proxy (the data flows downstream from it, b's requests upstream), and the other way round. Each test
writes its own topic at both sites, injects a fault while records flow, removes it, and then reads every site:
every acknowledged record is held exactly once, with the same coordinates and bytes, each origin's records in
origin-seq order (I1-I4). Clients go through a proxy of their own where the fault is on their side; there a
consumer that moves from a to b with its vector offset reads the rest exactly once (I5). Every connection is
mutual TLS, as ``georep up`` runs sites: the proxies relay TLS records, cut, sliced and reset.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from toxiproxy import Toxiproxy
from toxiproxy.api import APIConsumer
from toxiproxy.proxy import Proxy

from georep.client import Consumer, Producer
from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites, check_invariants, converged, produce, read_site, wait_until
from tests.support.toxiproxy import create_proxy, proxy_sites, toxiproxy_server

SITES = ["a", "b"]


class Pair:
    """Sites a and b behind their proxies, shared by the module's tests (starting nodes costs seconds)."""

    def __init__(self, client: Toxiproxy, root: Path) -> None:
        self.client = client
        self.api = (APIConsumer.host, APIConsumer.port)  # the client's API address is global to the process
        # Mutual TLS, as georep up runs: the proxies relay TLS records, and a sliced or reset one must fail cleanly.
        self.sites = Sites(root, SITES, [("a", "b"), ("b", "a")], stall_ms=1000, tls_dir=root / "certs")
        self.tls = self.sites.tls
        self.proxies = proxy_sites(client, self.sites, f"pair-{root.name}")
        self.sites.start()

    def topic(self, name: str) -> str:
        self.sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=name, partitions=2), timeout=5)
        wait_until(f"b has topic {name}", lambda: len(self.sites.vectors("b", name)) == 2, 20)
        return name

    def link_state(self, src: str, dst: str) -> str:
        return next(link.state for link in self.sites.status(dst).links if link.src == src)

    def converge(self, topic: str, sent: set[tuple[bytes, bytes]], timeout_s: float = 30) -> None:
        wait_until(f"{topic} converges", lambda: converged(self.sites, SITES, topic, len(sent)), timeout_s)
        check_invariants(self.sites, SITES, topic, sent)


@pytest.fixture(scope="module")
def toxiproxy() -> Iterator[Toxiproxy]:
    with toxiproxy_server() as client:
        yield client


@pytest.fixture(scope="module")
def pair(toxiproxy: Toxiproxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(toxiproxy, tmp_path_factory.mktemp("faults"))
    yield p
    p.sites.close()


@pytest.fixture
def clean(pair: Pair) -> Iterator[Pair]:
    """Every toxic a test added is removed, even when it fails, so the next test starts on a healthy pair."""
    pair.client.update_api_consumer(*pair.api)
    yield pair
    pair.client.reset()


def both(pair: Pair, topic: str, n: int, value_bytes: int = 0, tag: str = "") -> set[tuple[bytes, bytes]]:
    """``n`` records written at each site at once, every one acknowledged."""

    async def run() -> list[set[tuple[bytes, bytes]]]:
        return await asyncio.gather(
            *(produce(pair.sites.address(s), topic, f"{s}{tag}", n, value_bytes, pair.tls) for s in SITES)
        )

    a, b = asyncio.run(run())
    return a | b


def add_both_ways(proxy: Proxy, **toxic: object) -> None:
    for stream in ("upstream", "downstream"):
        proxy.add_toxic(stream=stream, name=f"{toxic['type']}-{stream}", **toxic)


class Writer:
    """Writes waves of records at a site in a thread until stopped; ``sent`` is what was acknowledged."""

    def __init__(self, pair: Pair, site: str, topic: str) -> None:
        self.address, self.topic, self.prefix, self.tls = pair.sites.address(site), topic, site, pair.tls
        self.sent: set[tuple[bytes, bytes]] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        wave = 0
        while not self.stop.is_set():
            self.sent |= asyncio.run(produce(self.address, self.topic, f"{self.prefix}{wave}", 40, tls=self.tls))
            wave += 1

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the writer did not finish"


def test_replication_under_latency_with_jitter(clean: Pair) -> None:
    topic = clean.topic("latency")
    for p in clean.proxies.values():
        add_both_ways(p, type="latency", attributes={"latency": 60, "jitter": 40})
    sent = both(clean, topic, 150)
    clean.converge(topic, sent)


def test_replication_over_a_throttled_link(clean: Pair) -> None:
    topic = clean.topic("throttled")
    clean.proxies["a"].add_toxic(type="bandwidth", attributes={"rate": 100})  # a -> b data: 100 KB/s
    sent = both(clean, topic, 100, value_bytes=1000)  # about 100 KB each way
    clean.converge(topic, sent)


def test_replication_with_sliced_frames(clean: Pair) -> None:
    topic = clean.topic("sliced")
    for p in clean.proxies.values():
        add_both_ways(p, type="slicer", attributes={"average_size": 200, "size_variation": 150, "delay": 50})
    sent = both(clean, topic, 150, value_bytes=300)
    clean.converge(topic, sent)


def test_replication_resets_in_mid_stream_and_resumes_with_nothing_lost_or_doubled(clean: Pair) -> None:
    topic = clean.topic("resets")
    with Writer(clean, "a", topic) as wa, Writer(clean, "b", topic) as wb:
        wait_until("records flow", lambda: len(wa.sent) >= 40 and len(wb.sent) >= 40, 20)
        for p in clean.proxies.values():  # the streams now open are reset at their next bytes, and every new one
            p.add_toxic(type="reset_peer", stream="downstream", attributes={"timeout": 100})
        wait_until("a reset takes b's link down", lambda: clean.link_state("a", "b") != "streaming", 10)
        for p in clean.proxies.values():
            p.destroy_toxic("reset_peer_downstream")
        wait_until("b streams from a again", lambda: clean.link_state("a", "b") == "streaming", 15)
    clean.converge(topic, wa.sent | wb.sent)


def test_a_link_that_times_out_comes_back_and_catches_up(clean: Pair) -> None:
    topic = clean.topic("timeout")
    with Writer(clean, "a", topic) as wa:
        wait_until("records flow", lambda: len(wa.sent) >= 40, 20)
        clean.proxies["a"].add_toxic(type="timeout", stream="downstream", attributes={"timeout": 1000})
        wait_until("b's link from a times out", lambda: clean.link_state("a", "b") != "streaming", 15)
        wait_until("a goes on accepting writes", lambda: len(wa.sent) >= 200, 20)
        clean.proxies["a"].destroy_toxic("timeout_downstream")
        wait_until("b streams from a again", lambda: clean.link_state("a", "b") == "streaming", 15)
    clean.converge(topic, wa.sent)


def test_geo_acks_under_latency_promise_the_second_site(clean: Pair) -> None:
    topic = clean.topic("geo")
    for p in clean.proxies.values():
        add_both_ways(p, type="latency", attributes={"latency": 50, "jitter": 20})

    async def run() -> set[tuple[bytes, bytes]]:
        sent = set()
        async with Producer(clean.sites.address("a"), acks="geo:2", linger_ms=5, tls=clean.tls) as producer:
            futures = []
            for i in range(60):
                key, value = b"g%d" % i, b"geo-%d" % i
                futures.append(producer.send(topic, value, key=key))
                sent.add((key, value))
            await producer.flush()
            await asyncio.gather(*futures)
        return sent

    sent = asyncio.run(run())
    # Acknowledged at geo:2 means b holds it already: read b at once, before any convergence wait.
    at_b = {(r[2], r[3]) for records in read_site(clean.sites, "b", topic).values() for r in records}
    assert sent <= at_b, f"b lacks {len(sent - at_b)} records acknowledged with acks=geo:2"
    clean.converge(topic, sent)


def test_clients_through_a_faulty_link_write_and_fail_over_exactly_once(clean: Pair) -> None:
    topic = clean.topic("clients")
    to_a = create_proxy(clean.client, f"client-a-{topic}", clean.sites.address("a"))
    to_b = create_proxy(clean.client, f"client-b-{topic}", clean.sites.address("b"))
    try:
        for p in (to_a, to_b):
            add_both_ways(p, type="latency", attributes={"latency": 30, "jitter": 20})
            p.add_toxic(type="slicer", attributes={"average_size": 300, "size_variation": 200, "delay": 20})
        asyncio.run(client_run(clean, topic, to_a, to_b))
    finally:
        to_a.destroy()
        to_b.destroy()


async def client_run(pair: Pair, topic: str, to_a: Proxy, to_b: Proxy) -> None:
    sent: set[tuple[bytes, bytes]] = set()
    async with Producer(to_a.listen, linger_ms=2, batch_size=4096, retry_backoff_ms=50, tls=pair.tls) as producer:
        futures = []
        for i in range(300):
            if i == 100:  # the producer's connection is reset under it: it retries, idempotently
                to_a.add_toxic(type="reset_peer", stream="upstream", name="reset", attributes={"timeout": 0})
                await asyncio.sleep(0.3)
                to_a.destroy_toxic("reset")
            key, value = b"c%d" % i, b"client-%d" % i
            futures.append(producer.send(topic, value, key=key, partition=0))
            sent.add((key, value))
            await asyncio.sleep(0.002)
        await producer.flush()
        await asyncio.gather(*futures)
    pair.converge(topic, sent)
    got: list[tuple[str, int]] = []
    tp = (topic, 0)
    async with Consumer(to_a.listen, auto_offset_reset="earliest", max_wait_ms=100, tls=pair.tls) as at_a:
        at_a.assign([tp])
        while len(got) < 120:
            got += [(str(r.origin), r.origin_seq) for r in await at_a.poll(timeout_ms=200, max_records=7)]
        vector = at_a.vector(tp)
    async with Consumer(to_b.listen, auto_offset_reset="earliest", max_wait_ms=100, tls=pair.tls) as at_b:
        at_b.assign([tp])
        at_b.seek_to_vector(tp, vector)  # fail over to b at the vector offset
        for _ in range(200):
            if len(got) >= len(sent):
                break
            got += [(str(r.origin), r.origin_seq) for r in await at_b.poll(timeout_ms=200)]
        assert not await at_b.poll(timeout_ms=300)  # and nothing more
    assert len(got) == len(set(got)) == len(sent), "I5: the failover read a record twice or missed one"
