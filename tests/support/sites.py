"""Several ``georep node`` processes, one per site, on the ports a generated topology file names.

The checks here read what each site's log holds and assert the invariants of
ARCHITECTURE.md:

* I1 the same coordinate has the same key, value, headers and timestamp everywhere;
* I2 no site holds a coordinate twice;
* I3 within a site's log, each origin's records are in origin-seq order;
* I4 every site holds every record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from georep.auth.principal import site_principal
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, decode_records, encode_batch, iter_headers
from georep.security import dev_ca
from georep.security.tls import TlsConfig
from georep.server.first_sync import SYNC_FILE
from georep.server.process import NodeProcess
from offsets.coordinates import Origin
from tests.support.channels import open_channel
from tests.support.ports import free_ports


def origin_batch(origin: Origin, base_seq: int, n: int = 2, tag: bytes = b"") -> bytes:
    records = [
        RecordInput(b"k%d" % (base_seq + i), tag + b"v%d" % (base_seq + i), (), 1_000 + base_seq + i) for i in range(n)
    ]
    return encode_batch(records, origin=origin, base_origin_seq=base_seq)


def topology_toml(
    ports: dict[str, int],
    links: list[tuple[str, str]],
    site_lines: dict[str, list[str]] | None = None,
    link_lines: dict[tuple[str, str], list[str]] | None = None,
) -> str:
    """``site_lines``: more lines of a site's table (``auto_create = [...]``); ``link_lines``: of a link's
    (``mode = "interest"``)."""
    lines = []
    for site, port in ports.items():
        lines += [f"[sites.{site}]", f'nodes = ["127.0.0.1:{port}"]', *(site_lines or {}).get(site, []), ""]
    for src, dst in links:
        lines += ["[[links]]", f'src = "{src}"', f'dst = "{dst}"', *(link_lines or {}).get((src, dst), []), ""]
    return "\n".join(lines)


TRIANGLE = [("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "b"), ("a", "c")]


class Sites:
    """One node per site, on the ports the topology names."""

    def __init__(
        self,
        root: Path,
        sites: list[str],
        links: list[tuple[str, str]],
        stall_ms: int = 1000,
        extra_args: list[str] | None = None,
        tls_dir: Path | None = None,
        site_lines: dict[str, list[str]] | None = None,
        clients: tuple[str, ...] = (),
        link_lines: dict[tuple[str, str], list[str]] | None = None,
    ) -> None:
        # tls_dir: mutual TLS with a development CA there (site:<s> per node, client:admin for the test's calls, and
        # client:<c> for each of clients)
        self.tls: TlsConfig | None = None
        if tls_dir is not None:
            dev_ca.init(tls_dir, dev_ca.plan(sites, {}, clients))
            self.tls = TlsConfig.from_dir(tls_dir)
        self.ports = dict(zip(sites, free_ports(len(sites)), strict=True))
        self.links = list(links)
        self.topology = root / "topology.toml"
        self.topology.write_text(topology_toml(self.ports, links, site_lines, link_lines))
        self.nodes = {
            s: NodeProcess(
                site=s,
                data_dir=root / s,
                listen=f"127.0.0.1:{self.ports[s]}",
                extra_args=["--topology", str(self.topology), "--stall-ms", str(stall_ms), *(extra_args or [])],
                tls=None if tls_dir is None else TlsConfig.from_dir(tls_dir, site_principal(s)),
            )
            for s in sites
        }
        self.channels: dict[str, grpc.Channel] = {}

    def start(self, *sites: str) -> None:
        for s in sites or tuple(self.nodes):
            self.nodes[s].start()

    def stub(self, site: str) -> pbg.NodeStub:
        if site not in self.channels:
            self.channels[site] = open_channel(self.nodes[site].address or f"127.0.0.1:{self.ports[site]}", self.tls)
        return pbg.NodeStub(self.channels[site])

    def address(self, site: str) -> str:
        return f"127.0.0.1:{self.ports[site]}"

    def status(self, site: str) -> pb.SiteStatusResponse:
        return self.stub(site).SiteStatus(pb.SiteStatusRequest(partitions=True), timeout=5)

    def vectors(self, site: str, topic: str) -> dict[int, dict[str, int]]:
        try:
            desc = self.stub(site).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
        except grpc.RpcError:
            return {}
        return {
            ps.partition: {f"{e.site}@{e.epoch}": e.next_seq for e in ps.vector.entries} for ps in desc.partition_states
        }

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        for node in self.nodes.values():
            node.kill9()


async def until(what: str, cond: Callable[[], object], timeout_s: float = 20.0) -> None:
    """:func:`wait_until` inside an event loop: it waits without blocking the loop the condition depends on."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")
        await asyncio.sleep(0.05)


def wait_until(what: str, cond: Callable[[], object], timeout_s: float = 30.0, poll_s: float = 0.1) -> None:
    """Returns once ``cond()`` holds; raises AssertionError after ``timeout_s``. A condition that costs the nodes
    more than a little (one over thousands of partitions) takes a longer ``poll_s``: its polls compete for the
    CPU with the work they wait on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")


def streams_opened(sites: Sites) -> dict[tuple[str, str], int]:
    """Pull streams opened so far on each link ``(src, dst)`` (SiteStatus's summary: no per-partition rows)."""
    return {
        (link.src, link.dst): link.streams_opened
        for s in sites.nodes
        for link in sites.stub(s).SiteStatus(pb.SiteStatusRequest(), timeout=30).links
    }


def settled(
    sites: Sites, quiet_s: float = 3.0, timeout_s: float = 60.0, poll_s: float = 0.2
) -> tuple[dict[tuple[str, str], int], float]:
    """Each link's streams opened once none was opened for ``quiet_s``, and the seconds from the call until the last
    one opened (0: none did). Raises AssertionError after ``timeout_s`` of streams still opening.

    A create's last step: a site holds a new topic's partitions before its pullers' topic sync (once a second) has
    learnt that each upstream holds the topic too, and learning it changes what the link may pull, which reopens
    its stream once, by design."""
    start = time.monotonic()
    opened, since = streams_opened(sites), start
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() - start < timeout_s, f"streams still opening {timeout_s:g} s after the create: {opened}"
        time.sleep(poll_s)
        now = streams_opened(sites)
        if now != opened:
            opened, since = now, time.monotonic()
    return opened, since - start


def converged(sites: Sites, names: list[str], topic: str, expect_total: int | None = None) -> bool:
    vectors = [sites.vectors(s, topic) for s in names]
    if not vectors[0] or any(v != vectors[0] for v in vectors):
        return False
    return expect_total is None or sum(sum(p.values()) for p in vectors[0].values()) == expect_total


def read_site(
    sites: Sites, site: str, topic: str, partitions: Iterable[int] | None = None
) -> dict[int, list[tuple[str, int, bytes | None, bytes | None, int]]]:
    """Every record of every partition (or of ``partitions``) at ``site``, in log order: (origin, origin seq, key,
    value, timestamp)."""
    stub = sites.stub(site)
    desc = stub.DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=30)
    out: dict[int, list[tuple[str, int, bytes | None, bytes | None, int]]] = {}
    wanted = None if partitions is None else set(partitions)
    for ps in desc.partition_states:
        if wanted is not None and ps.partition not in wanted:
            continue
        records: list[tuple[str, int, bytes | None, bytes | None, int]] = []
        end = ps.log_end_offset
        if end:
            stream = stub.Fetch(pb.FetchRequest(topic=topic, partition=ps.partition, offset=0, max_wait_ms=100))
            for resp in stream:
                data = resp.batches
                pos = 0
                for h in iter_headers(data, verify=True):
                    for r in decode_records(data[pos : pos + h.size_bytes], h):
                        records.append((str(r.origin), r.origin_seq, r.key, r.value, r.timestamp_ms))
                    pos += h.size_bytes
                if resp.next_offset >= end:
                    stream.cancel()
                    break
        out[ps.partition] = records
    return out


def check_invariants(sites: Sites, names: list[str], topic: str, expected: set[tuple[bytes, bytes]]) -> None:
    held = {s: read_site(sites, s, topic) for s in names}
    by_coord: dict[tuple[int, str, int], tuple[bytes | None, bytes | None, int]] = {}
    for s, parts in held.items():
        for p, records in parts.items():
            coords = [(r[0], r[1]) for r in records]
            assert len(coords) == len(set(coords)), f"I2: site {s} partition {p} holds a coordinate twice"
            last: dict[str, int] = {}
            for origin, seq, key, value, ts in records:
                after = last.get(origin, -1)
                assert seq == after + 1, f"I3/I1: site {s} p{p} {origin} seq {seq} follows {after}"
                last[origin] = seq
                prev = by_coord.setdefault((p, origin, seq), (key, value, ts))
                assert prev == (key, value, ts), f"I1: {origin}:{seq} differs at site {s}"
    for s, parts in held.items():
        got = {(r[2], r[3]) for records in parts.values() for r in records}
        assert got == expected, f"I4: site {s} lacks {len(expected - got)} records, has {len(got - expected)} extra"
        assert sum(len(r) for r in parts.values()) == len(by_coord), f"I4: site {s} does not hold every coordinate"


async def produce(
    address: str, topic: str, prefix: str, n: int, value_bytes: int = 0, tls: TlsConfig | None = None
) -> set[tuple[bytes, bytes]]:
    """Send ``n`` keyed records (values padded to ``value_bytes``) and wait for every ack; returns what was sent."""
    sent = set()
    async with Producer(address, linger_ms=2, batch_size=4096, tls=tls) as producer:
        futures = []
        for i in range(n):
            key, value = f"{prefix}-k{i}".encode(), f"{prefix}-v{i}".encode() * 3
            value = value.ljust(value_bytes, b"x")
            futures.append(producer.send(topic, value, key=key))
            sent.add((key, value))
            if i % 200 == 0:
                await asyncio.sleep(0.01)
        await producer.flush()
        await asyncio.gather(*futures)
    return sent


def catalog_synced(data_dir: Path) -> list[str]:
    """The upstreams whose topic catalog the node of ``data_dir`` has synced with once: it creates topics only once
    all of its upstreams are listed (``georep/server/first_sync.py``)."""
    path = data_dir / SYNC_FILE
    return list(json.loads(path.read_text())["synced"]) if path.exists() else []
