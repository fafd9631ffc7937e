"""``georep demo``: the main job on the embedded default, run by ``make demo``.

Three sites ``a``, ``b`` and ``c`` on 127.0.0.1, linked in a cycle plus the
reverse edges, each a real ``georep node`` process with its own data dir.
The demo:

1. creates a topic at ``a`` and watches it appear at ``b`` and ``c``;
2. writes at all three sites at once (multi-master);
3. shows every site converging on identical per-origin sequences;
4. cuts the link ``c -> a`` and shows ``c``'s new records reaching ``a``
   around it, through ``b``; then heals it;
5. SIGKILLs site ``a`` during a produce that fsyncs every batch, restarts it,
   and proves that every acknowledged record is held exactly once, everywhere;
6. runs a DR drill (``georep drill``): kill ``a`` under producers and a consumer group;
7. starts a site of three nodes (``docs/cluster.md``) and SIGKILLs the node leading
   a partition while producers write at ``acks=all``: a new leader recovers the
   segment from the quorum, and every acknowledged record is there, once;
8. then audits the running sites live with Spark (a cut, then batch digests over
   mutual TLS), flips a byte at one site and catches it, and plots replication
   delays (:mod:`spark_jobs.demo_audit`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from georep.cli.admin_token import find_token
from georep.cli.drill import add_arguments as add_drill_arguments
from georep.cli.drill import drill, render
from georep.cli.link import set_link as set_link_rpc
from georep.cli.status import vector_text
from georep.cli.topology_arg import load_topology
from georep.cli.up import ensure_certs, site_processes, stop_restarted
from georep.client import Admin, Consumer, ConsumerRecord, Producer, RecordMetadata
from georep.client.tls_args import certs_dir
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import ADMIN, TlsConfig, client_channel
from georep.server.process import NodeProcess
from topology.model import Topology, default_topology

TOPIC = "demo/orders"
PARTITIONS = 3
CONVERGE_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=Path(".georep/demo"), help="wiped and reused by each run")
    parser.add_argument("--records", type=int, default=5_000, help="records each site writes in step 2")


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(args.data_dir, args.records))


def say(text: str = "") -> None:
    print(text, flush=True)


def record_json(r: ConsumerRecord) -> str:
    return json.dumps(
        {
            "key": r.key.decode() if r.key is not None else None,
            "value": r.value.decode() if r.value is not None else None,
            "partition": r.partition,
            "offset": r.offset,
            "origin": str(r.origin),
            "origin_seq": r.origin_seq,
            "timestamp": r.timestamp_ms,
        }
    )


def client_tls(node: NodeProcess) -> TlsConfig | None:
    """The demo's client certificate (``client:admin``) beside the node's own: plaintext for a plaintext node."""
    return None if node.tls is None else TlsConfig.from_dir(node.tls.ca.parent, ADMIN)


async def consume_all(
    bootstrap: str, topic: str, expected: int, timeout_s: float = 60.0, tls: TlsConfig | None = None
) -> list[ConsumerRecord]:
    """Every record of ``topic`` from the beginning, until ``expected`` arrived."""
    out: list[ConsumerRecord] = []
    async with Consumer(bootstrap, tls=tls) as consumer:
        consumer.subscribe([topic])
        consumer.seek_to_beginning()
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(await consumer.poll(timeout_ms=500, max_records=10_000))
    return out


async def site_status(node: NodeProcess) -> pb.SiteStatusResponse:
    async with client_channel(node.address, client_tls(node)) as channel:
        return await pbg.NodeStub(channel).SiteStatus(pb.SiteStatusRequest(partitions=True), timeout=5)


async def vectors(nodes: list[NodeProcess], topic: str) -> dict[str, dict[int, str]]:
    out = {}
    for node in nodes:
        status = await site_status(node)
        out[node.site] = {p.partition: vector_text(p.vector) for p in status.partitions if p.topic == topic}
    return out


async def wait_converged(nodes: list[NodeProcess], topic: str, timeout_s: float = CONVERGE_TIMEOUT_S) -> float:
    """Seconds until every site holds the same vector for every partition of ``topic``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        seen = await vectors(nodes, topic)
        if len({json.dumps(v, sort_keys=True) for v in seen.values()}) == 1 and all(seen.values()):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise TimeoutError(f"sites did not converge on {topic} within {timeout_s}s: {await vectors(nodes, topic)}")


def per_origin_sequences(records: list[ConsumerRecord]) -> dict[tuple[int, str], list[tuple[int, bytes | None]]]:
    """(partition, origin) -> [(origin seq, value)] in the order the site's log holds them."""
    out: dict[tuple[int, str], list[tuple[int, bytes | None]]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        out.setdefault((r.partition, str(r.origin)), []).append((r.origin_seq, r.value))
    return out


@dataclass
class CrashReport:
    sent: int
    acked: int
    present: int
    duplicates: int
    missing_acked: int
    kill_after_acked: int

    @property
    def ok(self) -> bool:
        return self.duplicates == 0 and self.missing_acked == 0 and self.acked == self.sent


async def produce_through_crash(node: NodeProcess, topic: str, records: int, kill_after_acked: int) -> CrashReport:
    """Produce ``records`` values; SIGKILL and restart the node once ``kill_after_acked`` are acked.

    The producer keeps going through the outage (it retries with the same
    producer id and sequences), so the node must store every record once.
    """
    acked: list[RecordMetadata] = []
    at_kill = -1
    async with Producer(
        node.address, acks="leader", linger_ms=2, batch_size=16_384, retry_backoff_ms=50, tls=client_tls(node)
    ) as producer:
        futures = []
        for i in range(records):
            fut = producer.send(topic, b"crash-%d" % i, key=b"k%d" % (i % 97))
            fut.add_done_callback(lambda f: acked.append(f.result()) if not f.exception() else None)
            futures.append(fut)
            if i % 500 == 0:
                await asyncio.sleep(0.005)  # a sustained stream, not one burst
            if at_kill < 0 and len(acked) >= kill_after_acked:
                at_kill = len(acked)
                node.kill9()
                await asyncio.sleep(0.3)
                node.start()
        await producer.flush()
    if at_kill < 0:
        at_kill = len(acked)
        node.kill9()
        node.start()
    got = await consume_all(node.address, topic, records, tls=client_tls(node))
    values = Counter(r.value for r in got)
    acked_values = {b"crash-%d" % i for i, f in enumerate(futures) if not f.exception()}
    return CrashReport(
        sent=records,
        acked=len(acked_values),
        present=len(values),
        duplicates=sum(n - 1 for n in values.values() if n > 1),
        missing_acked=len(acked_values - set(values)),
        kill_after_acked=at_kill,
    )


async def set_link(dst: NodeProcess, src: str, enabled: bool) -> None:
    """An authenticated admin call, with the token ``georep up`` (here: ``site_processes``) created."""
    await set_link_rpc(dst.address, src, enabled, find_token(None, dst.data_dir.parent), client_tls(dst))


async def produce_at(node: NodeProcess, topic: str, count: int, tag: str) -> None:
    async with Producer(node.address, acks="leader", tls=client_tls(node)) as producer:
        for i in range(count):
            producer.send(topic, b"%s-%d" % (tag.encode(), i), key=b"customer-%d" % (i % 50))
        await producer.flush()


async def run(data_dir: Path, records: int) -> int:
    shutil.rmtree(data_dir, ignore_errors=True)
    topology = default_topology()
    say(f"== georep demo: the default topology, 3 sites in a cycle plus reverse links, data under {data_dir}/")
    nodes = site_processes(topology, None, data_dir, [], ensure_certs(topology, data_dir))
    say(f"   mutual TLS everywhere: a development CA and certificates in {certs_dir(data_dir)}/ ('georep certs init')")
    by_site = {n.site: n for n in nodes}
    failures: list[str] = []
    try:
        for node in nodes:
            node.start()
            say(
                f"  site {node.site}: node on {node.address} (pid {node.pid}), metrics http://{node.metrics_address}/metrics"
            )
        await _create_everywhere(by_site)
        failures += await _write_at_every_site(nodes, records)
        failures += await _route_around_a_cut(nodes, by_site)
        failures += await _crash_and_restart(nodes, by_site)
        failures += await _dr_drill(data_dir)
        failures += await cluster_site_step(data_dir / "three-nodes")
        failures += await _audit_live(data_dir, topology, by_site)
        say("\ndemo " + ("passed" if not failures else "FAILED: " + "; ".join(failures)))
        return 0 if not failures else 1
    finally:
        for node in nodes:
            node.stop()
        stop_restarted(nodes)


async def _audit_live(data_dir: Path, topology: Topology, by_site: dict[str, NodeProcess]) -> list[str]:
    """Steps 8-10, while the sites run: the live audit, a flipped byte caught, the delays."""
    from spark_jobs.demo_audit import run_demo_audit  # Spark loads for this last step only

    tls = client_tls(by_site["a"])
    # In a thread: the audit takes its cuts with asyncio.run, and Spark blocks; the sites are other processes.
    audited = await asyncio.to_thread(run_demo_audit, data_dir, topology, data_dir / "audit", by_site, tls, say)
    return [] if audited else ["the live audit did not pass"]


async def _create_everywhere(by_site: dict[str, NodeProcess]) -> None:
    """Step 1: a topic created at one site exists at every site."""
    say(f"\n1. create {TOPIC} ({PARTITIONS} partitions) at site a; topic metadata replicates")
    async with Admin(by_site["a"].address, tls=client_tls(by_site["a"])) as admin:
        await admin.create_topic(TOPIC, PARTITIONS)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        present = [s for s, n in by_site.items() if TOPIC in await _topics(n)]
        if len(present) == 3:
            break
        await asyncio.sleep(0.1)
    say(f"   the topic exists at sites: {', '.join(present)}")


async def _write_at_every_site(nodes: list[NodeProcess], records: int) -> list[str]:
    """Step 2 and 3: writes at every site at once converge to the same per-origin sequences everywhere."""
    say(f"\n2. write {records} records at each of a, b and c at the same time")
    started = time.perf_counter()
    await asyncio.gather(*(produce_at(n, TOPIC, records, f"from-{n.site}") for n in nodes))
    say(f"   {3 * records} records acknowledged in {time.perf_counter() - started:.2f}s")

    took = await wait_converged(nodes, TOPIC)
    say(f"\n3. every site converged {took:.2f}s after the last ack; vector per partition:")
    for site, parts in (await vectors(nodes, TOPIC)).items():
        say(f"   {site}: " + "  ".join(f"p{p}={v}" for p, v in sorted(parts.items())))
    sequences = {}
    for node in nodes:
        got = await consume_all(node.address, TOPIC, 3 * records, tls=client_tls(node))
        sequences[node.site] = per_origin_sequences(got)
        say(f"   consumed {len(got)} records at site {node.site}; first: {record_json(got[0])}")
    identical = sequences["a"] == sequences["b"] == sequences["c"]
    say(f"   identical per-origin sequences (coordinates and values) at a, b and c: {identical}")
    return [] if identical else ["per-origin sequences differ between sites"]


async def _route_around_a_cut(nodes: list[NodeProcess], by_site: dict[str, NodeProcess]) -> list[str]:
    """Step 4: with the link c -> a cut, a pulls c's records through b."""
    failures = []
    say("\n4. cut the link c -> a; c's new records must reach a through b")
    await set_link(by_site["a"], "c", enabled=False)
    await produce_at(by_site["c"], TOPIC, 1_000, "after-cut")
    took = await wait_converged(nodes, TOPIC)
    status = await site_status(by_site["a"])
    links = {f"{lk.src}->{lk.dst}": lk.state for lk in status.links}
    upstreams = sorted(
        {
            (lag.origin, lag.upstream)
            for p in status.partitions
            if p.topic == TOPIC
            for lag in p.lags
            if lag.origin.startswith("c@")
        }
    )
    say(
        f"   a's links: {links}; a now pulls {upstreams[0][0] if upstreams else 'c'} from: "
        f"{', '.join(sorted({u for _, u in upstreams})) or '-'}"
    )
    say(f"   converged again {took:.2f}s after the last ack, around the cut link")
    if links.get("c->a") != "down" or any(u != "b" for _, u in upstreams):
        failures.append(f"after the cut, a should pull c's records from b: {upstreams}, links {links}")
    await set_link(by_site["a"], "c", enabled=True)
    say("   link c -> a healed")
    return failures


async def _crash_and_restart(nodes: list[NodeProcess], by_site: dict[str, NodeProcess]) -> list[str]:
    """Step 5: a site killed during a produce loses no acknowledged record, and replicates all of them."""
    failures = []
    say("\n5. SIGKILL site a during a produce that fsyncs every batch, then restart it")
    async with Admin(by_site["a"].address, tls=client_tls(by_site["a"])) as admin:
        await admin.create_topic("demo/crash", 1)
    report = await produce_through_crash(by_site["a"], "demo/crash", 20_000, kill_after_acked=6_000)
    say(
        f"   killed after {report.kill_after_acked} acks; after restart: {report.acked}/{report.sent} acked, "
        f"{report.present} distinct present, {report.duplicates} duplicates, "
        f"{report.missing_acked} acked records missing"
    )
    if not report.ok:
        failures.append(f"crash recovery: {report}")
    took = await wait_converged(nodes, "demo/crash")
    counts = [len(await consume_all(n.address, "demo/crash", 20_000, tls=client_tls(n))) for n in nodes]
    say(f"   replicated to every site {took:.2f}s later: records at a, b, c = {counts}")
    if counts != [20_000] * 3:
        failures.append(f"demo/crash counts per site: {counts}")
    return failures


async def _dr_drill(data_dir: Path) -> list[str]:
    """Step 6: ``georep drill``'s site kill, with its report."""
    say("\n6. DR drill: producers at every site (acks=leader and acks=geo:2), a consumer group at a;")
    say("   SIGKILL a, the consumers fail over to b, a restarts and rejoins")
    drill_args = argparse.Namespace(
        **{**vars(drill_defaults()), "data_dir": data_dir, "report": data_dir / "drill-report.json"}
    )
    doc = await drill(drill_args, out=lambda line: say(f"   {line}"))
    drill_args.report.write_text(json.dumps(doc, indent=2) + "\n")
    say("\n" + "\n".join(f"   {line}" for line in render(doc).splitlines()))
    say(f"   report: {drill_args.report}")
    return [] if doc["ok"] else ["drill: " + "; ".join(doc["promises_broken"])]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


async def _leader_of(nodes: list[NodeProcess], topic: str, partition: int) -> NodeProcess | None:
    """The node serving ``topic``-``partition`` (its DescribeTopic lists the partition's state)."""
    for node in nodes:
        if not node.alive():
            continue
        try:
            async with client_channel(node.address, client_tls(node)) as channel:
                d = await pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
        except grpc.aio.AioRpcError:
            continue
        if any(ps.partition == partition for ps in d.partition_states):
            return node
    return None


async def cluster_site_step(root: Path, topic: str = "demo/cluster") -> list[str]:
    """Step 7: a site of three nodes loses the node leading a partition under acks=all producers."""
    say("\n7. a site of three nodes, d (replication factor 3, min-insync 2): SIGKILL the node leading a partition")
    say("   while two producers write at acks=all, then restart it")
    grpc_ports, raft_ports = _free_ports(3), _free_ports(3)
    root.mkdir(parents=True, exist_ok=True)
    topology_file = root / "topology.toml"
    members = ", ".join(
        f'{{ id = {i + 1}, address = "127.0.0.1:{g}", raft = "127.0.0.1:{r}" }}'
        for i, (g, r) in enumerate(zip(grpc_ports, raft_ports, strict=True))
    )
    topology_file.write_text(f"[sites.d]\nnodes = [{members}]\n")
    topology = load_topology(topology_file)
    nodes = site_processes(
        topology,
        topology_file,
        root,
        ["--session-timeout-ms", "1500", "--segment-bytes-max", "262144"],
        ensure_certs(topology, root),
    )
    tls = client_tls(nodes[0])
    failures: list[str] = []
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready(60)
        say("   " + ", ".join(f"node {n.node_id} on {n.address}" for n in nodes))
        async with Admin(nodes[0].address, tls=tls) as admin:
            await admin.create_topic(topic, 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any([await _leader_of(nodes, topic, p) is None for p in range(3)]):
            await asyncio.sleep(0.1)
        writes = LeaderKillWrites(topic, tls)
        victim = await writes.kill_the_leader(nodes)
        if not writes.first_ack_after_kill:
            failures.append("three-node site: partition 0 took no write within 30 s of its leader's death")
        acked = writes.acked
        values = await _read_back(nodes[0].address, topic, tls, acked)
        missing = len(acked - set(values))
        duplicates = sum(n - 1 for n in values.values() if n > 1)
        say(
            f"   {len(acked)} records acknowledged at acks=all; read back from the leaders: {len(values)} distinct, "
            f"{missing} acknowledged records missing, {duplicates} duplicates"
        )
        if victim is None:
            failures.append("three-node site: no leader of partition 0 to kill")
        if missing or duplicates or not acked:
            failures.append(f"three-node site: {missing} acked records missing, {duplicates} duplicates")
    finally:
        for node in nodes:
            node.stop()
    return failures


class LeaderKillWrites:
    """Two producers at acks=all through the site's other nodes, while the leader of partition 0 is killed and
    restarted: what was acknowledged, and when partition 0 took a write again."""

    def __init__(self, topic: str, tls: TlsConfig | None) -> None:
        self.topic, self.tls = topic, tls
        self.acked: set[bytes] = set()
        self.first_ack_after_kill: list[float] = []  # of a partition-0 write, sent after the kill
        self.killed_at = float("inf")
        self.stop = asyncio.Event()

    async def produce(self, tag: str, bootstrap: str) -> None:
        n = 0
        async with Producer(bootstrap, acks="all", linger_ms=2, batch_size=4096, tls=self.tls) as producer:
            while not self.stop.is_set():
                values = [f"{tag}-{n + i}".encode() for i in range(50)]
                sent_at = time.monotonic()
                futures = [producer.send(self.topic, v, key=v) for v in values]
                for value, result in zip(values, await asyncio.gather(*futures, return_exceptions=True), strict=True):
                    if not isinstance(result, BaseException):
                        self.acked.add(value)
                        if result.partition == 0 and sent_at > self.killed_at and not self.first_ack_after_kill:
                            self.first_ack_after_kill.append(time.monotonic())
                n += 50

    async def kill_the_leader(self, nodes: list[NodeProcess]) -> NodeProcess | None:
        """Write, kill partition 0's leader, wait for a write to it, restart the node, stop writing; the victim."""
        topic = self.topic
        producers = [
            asyncio.create_task(self.produce("p1", nodes[1].address)),
            asyncio.create_task(self.produce("p2", nodes[2].address)),
        ]
        await asyncio.sleep(2.0)
        victim = await _leader_of(nodes, topic, 0)
        if victim is not None:
            victim.kill9()
            self.killed_at = time.monotonic()
            say(
                f"   SIGKILL node {victim.node_id} (pid {victim.pid}), the leader of {topic}-0, after "
                f"{len(self.acked)} acks"
            )
        while not self.first_ack_after_kill and time.monotonic() - self.killed_at < 30:
            await asyncio.sleep(0.01)
        if self.first_ack_after_kill:
            say(
                f"   {topic}-0 acknowledged writes again {self.first_ack_after_kill[0] - self.killed_at:.2f}s after "
                "the kill (a new leader detected the death, recovered the open segment and opened the next "
                "one)"
            )
        await asyncio.sleep(1.0)
        if victim is not None:
            victim.start(60)
            say(f"   node {victim.node_id} restarted; it rejoins as a member of new segments")
        await asyncio.sleep(1.0)
        self.stop.set()
        await asyncio.gather(*producers)
        return victim


async def _read_back(bootstrap: str, topic: str, tls: TlsConfig | None, acked: set[bytes]) -> Counter[bytes | None]:
    """Every value of ``topic`` (with its count), read until every acknowledged one is seen (or a minute)."""
    values: Counter[bytes | None] = Counter()
    async with Consumer(bootstrap, tls=tls) as consumer:  # it reads each partition at its leader
        consumer.subscribe([topic])
        consumer.seek_to_beginning()
        deadline = time.monotonic() + 60
        while not acked <= set(values) and time.monotonic() < deadline:
            values.update(r.value for r in await consumer.poll(timeout_ms=500, max_records=10_000))
        values.update(r.value for r in await consumer.poll(timeout_ms=500, max_records=10_000))
    return values


def drill_defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_drill_arguments(parser)
    return parser.parse_args([])


async def _topics(node: NodeProcess) -> set[str]:
    async with Admin(node.address, tls=client_tls(node)) as admin:
        return {t.name for t in await admin.list_topics()}
