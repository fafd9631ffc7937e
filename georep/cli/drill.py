"""``georep drill``: a DR drill against a running topology, with numbers.

1. Create a fresh topic ``drill-<ms>`` and wait until every site has it.
2. Start one producer per (site, ack level) at ``--rate`` records/s. Each
   record's value names its producer and sequence number, so every record is
   accounted for.
3. Start ``--consumers`` consumers in a fresh group at the victim site, with
   the failover site second in their bootstrap list. They commit every
   ``--commit-interval-ms`` with ``--commit-acks``.
4. After ``--warmup`` seconds: ``kill`` sends SIGKILL to the victim's node
   (its pid from ``DATA_DIR/<site>/node.json``, so a local run); ``isolate``
   cuts every link into and out of the victim with authenticated ``SetLink``
   calls, which also works against a remote deployment.
5. Fail the consumers over. After a kill they move by themselves, to the next
   site of their bootstrap list, from their in-memory vectors. After an
   isolation the victim still answers, so the drill abandons them, as a
   crashed application would, and starts new consumers in the same group at
   the failover site, which resume from the committed vectors.
6. ``--after`` seconds later the producers stop. The drill measures what the
   survivors hold. With ``--restart`` (the default), it then restarts the
   victim (``kill``: with the command in its ``node.json``; ``isolate``: heals
   the links), waits for every site to converge, and lets the consumers drain.

What it measures (per ack level where that makes sense):

* **RPO**: records acked but held by no surviving site after the event
  (and the age of the oldest such record at the event);
* **lost after rejoin**: records acked but held by no site once the victim is
  back; nothing acked may ever be lost for good;
* **duplicates relative to the last commit**: records delivered after the
  failover that the last commit acked before the event already covered;
* **never delivered**: records the topic holds that no consumer received;
* **RTO**: the time from the event to the first record consumed from the
  failover site.

It exits 1 when a promise was broken: any RPO loss at ``acks=geo:N`` with
N >= 2, any record lost after the rejoin, any duplicate relative to the
commits, or any record never delivered. Exit 2 is a usage error.

``--mode node-kill`` fails one node of a multi-node site instead of a site
(docs/cluster.md): it SIGKILLs the node leading partition 0 of the drill
topic (or ``--node N``; its pid from ``DATA_DIR/<site>/<node id>/node.json``)
while producers write at ``acks=all`` and ``acks=leader`` through the site's
nodes and one consumer reads every partition with ``assign()`` (no group: the
drill measures the partition leaders' failover alone). The RTO is the time until a partition the
node led acknowledges a write again (and until such a record is consumed);
the RPO is what the site lost of what it had acknowledged: nothing at
``acks=all``, and at ``acks=leader`` at most the tail that only the killed
leader held. Then it restarts the node, waits until the site is whole and
every site converged, and checks that nothing acknowledged is lost for good
and that the consumer saw every record once, with no gap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from georep.cli.admin_token import TOKEN_ENV, find_token
from georep.cli.drill_sites import DrillSitesError, drill_sites
from georep.cli.link import set_link
from georep.cli.topology_arg import load_topology
from georep.cli.up import DEFAULT_DATA_DIR
from georep.client.connection import CHANNEL_OPTIONS
from georep.client.consumer import Consumer, ConsumerRecord, decode_response
from georep.client.errors import GeorepError
from georep.client.producer import Producer, parse_acks
from georep.client.tls_args import TlsArgsError, client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_from_proto
from georep.record.batch import CorruptBatch
from georep.record.compression import DecompressionError
from georep.security.tls import TlsConfig, client_channel
from georep.server.first_sync import CREATE_WAIT_S
from georep.server.process import NODE_INFO
from georep.storage.private import append_private
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.file import TopologyFileError
from topology.ids import SiteId
from topology.model import Topology, UnknownSite

EXIT_BROKEN = 1
EXIT_USAGE = 2
RPC_TIMEOUT_S = 5.0
CONVERGE_TIMEOUT_S = 60.0
FAILOVER_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 30.0
CREATE_TIMEOUT_S = 60.0  # for the drill topic's create: a fresh site's first catalog sync (create_topic_at)
CREATE_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MODES = ("kill", "isolate", "node-kill")
# A node of a multi-node site is lost, not the site: acks=all is the promise that survives it, acks=leader the one
# that may not.
DEFAULT_ACKS = {"kill": "leader,geo:2", "isolate": "leader,geo:2", "node-kill": "all,leader"}


class DrillError(Exception):
    """The drill cannot run (usage, unreachable sites); exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: the embedded a, b, c)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="where 'georep up' keeps DATA_DIR/<site>/node.json and admin.token (default .georep)",
    )
    parser.add_argument("--report", type=Path, help="write the report as JSON to this file")
    parser.add_argument(
        "--site",
        help="the site to fail (default: the topology's first site; node-kill: its first site of several nodes)",
    )
    parser.add_argument("--failover-to", help="where the consumers go (default: the next site)")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="kill",
        help="kill: SIGKILL the site's node (local); isolate: cut all its links (any deployment); "
        "node-kill: SIGKILL one node of a multi-node site (local)",
    )
    parser.add_argument(
        "--node", type=int, help="node-kill: the node id to kill (default: the leader of the drill topic's partition 0)"
    )
    parser.add_argument(
        "--acks", help="ack levels, one producer per site each (default leader,geo:2; node-kill: all,leader)"
    )
    parser.add_argument("--rate", type=float, default=200.0, help="records/s per producer (default 200)")
    parser.add_argument("--consumers", type=int, default=2, help="consumers in the group (default 2)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the drill topic (default 4)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the event (default 3)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of producing after it (default 3)")
    parser.add_argument("--commit-interval-ms", type=int, default=200, help="consumer commit interval")
    parser.add_argument("--commit-acks", default="geo:2", help="ack level of the commits (default geo:2)")
    parser.add_argument("--no-restart", action="store_true", help="leave the site down (or isolated)")
    parser.add_argument(
        "--client",
        choices=("georep", "kafka"),
        default="georep",
        help="kafka: producers and a consumer group of unmodified Kafka clients (confluent-kafka) "
        "on the sites' Kafka ports, failing over from a killed site (docs/kafka.md)",
    )
    parser.add_argument("--admin-token", help=f"admin token for isolate (default ${TOKEN_ENV}, DATA_DIR/admin.token)")
    add_client_tls_arguments(parser)


# --- what the drill records --------------------------------------------------------


@dataclass
class Acked:
    level: str
    site: str
    origin: str
    origin_seq: int
    partition: int
    acked_at: float


@dataclass
class Delivery:
    consumer: str
    site_origin: str
    partition: int
    origin: str
    origin_seq: int
    value: str
    at: float
    offset: int = -1  # the local offset at the site read from


@dataclass
class Run:
    topic: str
    group: str
    acked: dict[str, Acked] = field(default_factory=dict)  # value -> ack
    sent: dict[str, int] = field(default_factory=dict)  # "site|level" -> records sent
    errors: dict[str, int] = field(default_factory=dict)  # "site|level" -> records failed
    deliveries: list[Delivery] = field(default_factory=list)
    # the last commit acked before the event, per partition
    commits: dict[int, tuple[float, VectorOffset]] = field(default_factory=dict)
    commit_count: int = 0
    commit_errors: int = 0
    event_at: float = 0.0
    # "site|level" -> records sent before the event: a record numbered from there was sent after it
    sent_before_event: dict[str, int] = field(default_factory=dict)

    def sent_after_event(self, value: str) -> bool:
        """Whether the drill's record ``value`` (``<site>|<level>|<n>``) was sent after the event."""
        site, _, rest = value.partition("|")
        level, _, n = rest.partition("|")
        return n.isdigit() and int(n) >= self.sent_before_event.get(f"{site}|{level}", 0)


def _now() -> float:
    return time.time()


# --- sites -------------------------------------------------------------------------


@dataclass
class Site:
    name: str
    address: str  # the first node: the one the drill asks
    nodes: tuple[str, ...] = ()  # every node of the site, in topology order
    tls: TlsConfig | None = None  # the drill's client certificate (None: plaintext)

    @property
    def bootstrap(self) -> str:
        return ",".join(self.nodes or (self.address,))

    async def stub_call(
        self, method: str, request: Any, address: str | None = None, timeout_s: float = RPC_TIMEOUT_S
    ) -> Any:
        async with client_channel(address or self.address, self.tls) as channel:
            return await getattr(pbg.NodeStub(channel), method)(request, timeout=timeout_s)

    async def any_call(self, method: str, request: Any, timeout_s: float = RPC_TIMEOUT_S) -> Any:
        """The first node of the site that answers (a multi-node site with one node down still does)."""
        error: grpc.aio.AioRpcError | None = None
        for address in self.nodes or (self.address,):
            try:
                return await self.stub_call(method, request, address, timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = exc
        assert error is not None
        raise error


async def create_topic_at(site: Site, request: pb.CreateTopicRequest, timeout_s: float = CREATE_TIMEOUT_S) -> None:
    """Create the drill's topic at ``site``, once the site may create topics.

    A data dir that has not yet listed each upstream's topic catalog holds a create back for up to ``CREATE_WAIT_S``,
    then answers UNAVAILABLE (georep/server/first_sync.py). Right after ``georep up`` that is the usual case, and on
    a loaded machine the first sync can take longer than a call's ``RPC_TIMEOUT_S``: so each call is given the
    server's wait plus a round trip, UNAVAILABLE and DEADLINE_EXCEEDED are retried until ``timeout_s``, and a retry
    that finds the topic (made by a call whose answer was lost; the name is the drill's own) is done."""
    deadline = time.monotonic() + timeout_s
    retried = False
    while True:
        try:
            await site.any_call("CreateTopic", request, CREATE_WAIT_S + RPC_TIMEOUT_S)
            return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if retried and code == grpc.StatusCode.ALREADY_EXISTS:
                return
            if code not in CREATE_RETRIED or time.monotonic() >= deadline:
                raise DrillError(
                    f"cannot create topic {request.name} at site {site.name} ({code.name}: {exc.details()})"
                ) from None
        retried = True
        await asyncio.sleep(0.5)


async def served_partitions(site: Site, topic: str) -> dict[int, tuple[str, pb.PartitionState]]:
    """Each partition of ``topic`` as the node serving it describes it, with that node's address.

    A node of a multi-node site describes only the partitions it leads, so the drill asks every node and takes
    each partition from the leader of the highest leader epoch any of them names; a partition whose leader does
    not serve it (yet) is left out."""
    if len(site.nodes) <= 1:
        desc = await site.stub_call("DescribeTopic", pb.DescribeTopicRequest(name=topic))
        return {ps.partition: (site.address, ps) for ps in desc.partition_states}
    answers: dict[str, pb.TopicDescription] = {}
    error: grpc.aio.AioRpcError | None = None
    for address in site.nodes:
        try:
            answers[address] = await site.stub_call("DescribeTopic", pb.DescribeTopicRequest(name=topic), address)
        except grpc.aio.AioRpcError as exc:
            error = exc  # a dead node
    if not answers:
        assert error is not None
        raise error
    out: dict[int, tuple[str, pb.PartitionState]] = {}
    for partition, leader in current_leaders(answers.values()).items():
        listing = {
            address: ps
            for address, answer in answers.items()
            for ps in answer.partition_states
            if ps.partition == partition
        }
        if leader.address in listing:
            out[partition] = (leader.address, listing[leader.address])
        elif len(listing) == 1:  # the metadata spells the leader's address otherwise than the topology
            out[partition] = next(iter(listing.items()))
    return out


def current_leaders(descriptions: Iterable[pb.TopicDescription]) -> dict[int, pb.PartitionLeader]:
    """Each partition's leader, as the answer of the highest leader epoch names it (a node's view can lag)."""
    out: dict[int, pb.PartitionLeader] = {}
    for desc in descriptions:
        for leader in desc.leaders:
            if leader.node_id and (
                leader.partition not in out or leader.leader_epoch > out[leader.partition].leader_epoch
            ):
                out[leader.partition] = leader
    return out


async def vectors(site: Site, topic: str) -> dict[int, VectorOffset]:
    return {p: vector_from_proto(ps.vector) for p, (_, ps) in (await served_partitions(site, topic)).items()}


async def every_vector(site: Site, topic: str, partitions: int, timeout_s: float = 30.0) -> dict[int, VectorOffset]:
    """Every partition's vector, once a node serves each: right after a node's restart and the repair it starts, a
    partition can be between leaders for a moment, and a report must not leave it out."""
    got: dict[int, VectorOffset] = {}

    async def whole() -> bool:
        got.clear()
        got.update(await vectors(site, topic))
        return len(got) >= partitions

    await wait_for(f"a node serves every partition of {topic} again", whole, timeout_s)
    return got


async def wait_for(
    what: str, cond: Callable[[], Any], timeout_s: float, state: Callable[[], str] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if await cond():
                return
        await asyncio.sleep(0.05)
    raise DrillError(f"timed out after {timeout_s:g}s waiting until {what}" + (f" ({state()})" if state else ""))


# --- workload ----------------------------------------------------------------------


async def produce_loop(run: Run, site: Site, level: str, rate: float, stop: asyncio.Event) -> None:
    key = f"{site.name}|{level}"
    interval = 1.0 / rate
    producer = Producer(
        site.bootstrap, acks=level, linger_ms=5, request_timeout_ms=10_000, delivery_timeout_ms=20_000, tls=site.tls
    )
    try:
        await producer.start()
    except GeorepError:
        run.errors[key] = run.errors.get(key, 0) + 1
        return
    i = 0
    pending: set[asyncio.Future[Any]] = set()
    next_at = time.monotonic()
    try:
        while not stop.is_set():
            value = f"{site.name}|{level}|{i}"
            fut = producer.send(run.topic, value.encode(), key=f"{site.name}-{i}".encode())
            pending.add(fut)
            fut.add_done_callback(functools.partial(_acked, run, key, level, site.name, value, pending=pending))
            run.sent[key] = run.sent.get(key, 0) + 1
            i += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    finally:
        with contextlib.suppress(GeorepError, TimeoutError):
            async with asyncio.timeout(5):
                await producer.flush()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await producer.close()


def _acked(run: Run, key: str, level: str, site: str, value: str, fut: asyncio.Future[Any], pending: set[Any]) -> None:
    pending.discard(fut)
    if fut.cancelled() or fut.exception() is not None:
        run.errors[key] = run.errors.get(key, 0) + 1
        return
    meta = fut.result()
    run.acked[value] = Acked(level, site, str(meta.origin), meta.origin_seq, meta.partition, _now())


async def consume_loop(
    run: Run, consumer: Consumer, name: str, commit_interval_s: float | None, stop: asyncio.Event
) -> None:
    """Poll until ``stop``, noting every record; commit every ``commit_interval_s`` (None: a consumer without a
    group, which keeps its position itself)."""
    next_commit = time.monotonic() + (commit_interval_s or 0.0)
    while not stop.is_set():
        try:
            records = await consumer.poll(timeout_ms=100)
        except GeorepError:
            await asyncio.sleep(0.05)
            continue
        origin = consumer.site_origin
        at = _now()
        for r in records:
            run.deliveries.append(_delivery(name, origin, r, at))
        if commit_interval_s is not None and time.monotonic() >= next_commit:
            next_commit = time.monotonic() + commit_interval_s
            await commit(run, consumer)


def _delivery(name: str, origin: str, r: ConsumerRecord, at: float) -> Delivery:
    value = (r.value or b"").decode(errors="replace")
    return Delivery(name, origin, r.partition, str(r.origin), r.origin_seq, value, at, r.offset)


async def commit(run: Run, consumer: Consumer) -> None:
    positions = {tp: consumer.vector(tp) for tp in consumer.assignment()}
    try:
        await consumer.commit(positions)
    except GeorepError:
        run.commit_errors += 1
        return
    run.commit_count += 1
    at = _now()
    if not run.event_at:
        for (_, partition), vector in positions.items():
            run.commits[partition] = (at, vector)


# --- the event -----------------------------------------------------------------------


def node_info(data_dir: Path, site: str) -> dict[str, Any]:
    path = data_dir / site / NODE_INFO
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrillError(
            f"--mode kill needs the node's pid from {path} ({exc}): run the drill on the machine and with the "
            "--data-dir of 'georep up', or use --mode isolate"
        ) from None
    return info


async def set_links(
    topology: Topology, victim: str, sites: Mapping[SiteId, Site], enabled: bool, token: str | None
) -> None:
    for link in topology.links_sorted():
        if victim not in (link.src, link.dst):
            continue
        try:
            await set_link(sites[link.dst].address, link.src, enabled, token, sites[link.dst].tls)
        except grpc.aio.AioRpcError as exc:
            where = f"SetLink {link.src} -> {link.dst} at {sites[link.dst].address}"
            raise DrillError(f"{where}: {exc.details()}") from None


def restart_node(info: dict[str, Any], node_dir: Path, what: str) -> None:
    """Run the command in ``node_dir``'s node.json again, its output appended to ``node_dir/node.log``."""
    command = info.get("command")
    if not command:
        raise DrillError(f"{node_dir / NODE_INFO} has no 'command': restart {what} by hand")
    with append_private(node_dir / "node.log") as log:
        # A session of its own: the restarted node outlives the drill, like the one it replaces.
        subprocess.Popen(
            command,
            cwd=info.get("cwd"),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


# --- the drill ------------------------------------------------------------------------


async def drill(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    try:
        topology = load_topology(args.topology)
    except TopologyFileError as exc:
        raise DrillError(str(exc)) from None
    if args.client == "kafka":
        return await _kafka_drill(args, topology, out)
    levels = _ack_levels(args)
    if args.rate <= 0 or args.consumers < 1 or args.partitions < 1:
        raise DrillError("--rate, --consumers and --partitions must be positive")
    tls = _client_tls(args)
    sites = {n: Site(n, topology.site(n).nodes[0], topology.site(n).nodes, tls) for n in topology.site_ids()}
    if args.mode == "node-kill":
        return await node_kill(args, topology, sites, levels, out)
    if args.node is not None:
        raise DrillError("--node is for --mode node-kill, which kills one node of a multi-node site")
    try:
        victim, target = drill_sites(topology, args.site, args.failover_to)
    except DrillSitesError as exc:
        raise DrillError(str(exc)) from None
    for s in sites.values():
        try:
            await s.stub_call("Health", pb.HealthRequest())
        except grpc.aio.AioRpcError as exc:
            raise DrillError(
                f"site {s.name} at {s.address} does not answer ({exc.code().name}): start the "
                "topology first ('georep up')"
            ) from None
    return await SiteDrill(args, topology, sites, levels, victim, target, out).drill()


async def _kafka_drill(args: argparse.Namespace, topology: Topology, out: Callable[[str], None]) -> dict[str, Any]:
    from georep.cli.kafka_drill import KafkaDrillError, kafka_drill

    if args.mode != "kill":
        raise DrillError("--client kafka drills --mode kill (a site's node killed)")
    tls = _client_tls(args)
    try:
        return await asyncio.to_thread(kafka_drill, args, topology, out, tls)
    except KafkaDrillError as exc:
        raise DrillError(str(exc)) from None


def _ack_levels(args: argparse.Namespace) -> list[str]:
    """The producers' ack levels (``--acks``, else the mode's), each checked, as is ``--commit-acks``."""
    levels = [a.strip() for a in (args.acks or DEFAULT_ACKS[args.mode]).split(",") if a.strip()]
    if not levels:
        raise DrillError("--acks names no ack level: give one or more of leader, all, geo:N")
    for level in (*levels, args.commit_acks):
        try:
            parse_acks(level)
        except GeorepError as exc:
            raise DrillError(exc.message) from None
    return levels


def _client_tls(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return client_tls(args)
    except TlsArgsError as exc:
        raise DrillError(exc.message) from None


class SiteDrill:
    """One drill of a site (``--mode kill`` or ``isolate``): the workload, the event, the consumers' failover,
    what the survivors hold, the rejoin, and the accounting of every record (the module's docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        topology: Topology,
        sites: dict[SiteId, Site],
        levels: list[str],
        victim: SiteId,
        target: SiteId,
        out: Callable[[str], None],
    ) -> None:
        self.args, self.topology, self.sites, self.levels, self.out = args, topology, sites, levels, out
        self.victim, self.target = victim, target
        self.names = list(sites)
        self.info = node_info(args.data_dir, victim) if args.mode == "kill" else {}
        self.token = find_token(args.admin_token, args.data_dir)
        stamp = int(time.time() * 1000)
        self.run = Run(topic=f"drill-{stamp}", group=f"drill-{stamp}")
        self.stop_producers = asyncio.Event()
        self.producer_tasks: dict[tuple[SiteId, str], asyncio.Task[None]] = {}
        self.stop_consumers = asyncio.Event()
        self.consumers: list[Consumer] = []
        self.consumer_tasks: list[asyncio.Task[None]] = []
        self.target_origin = ""
        self.restored = False

    async def drill(self) -> dict[str, Any]:
        args, run, victim, target = self.args, self.run, self.victim, self.target
        self.out(
            f"drill: {args.mode} site {victim}, consumers fail over to {target}; topic {run.topic}, ack "
            f"levels {', '.join(self.levels)}, {args.rate:g} records/s per producer, commits "
            f"{args.commit_acks}"
        )
        await self.create_topic()
        self.producer_tasks = {
            (s, level): asyncio.create_task(produce_loop(run, self.sites[s], level, args.rate, self.stop_producers))
            for s in self.names
            for level in self.levels
        }
        await self.start_consumers(f"{self.sites[victim].address},{self.sites[target].address}", "c")
        await asyncio.sleep(args.warmup)
        await self.event()
        rto_ms = await self.failover()
        await asyncio.sleep(args.after)
        self.stop_producers.set()
        await asyncio.gather(*(t for t in self.producer_tasks.values() if not t.done()), return_exceptions=True)
        lost = await self.lost_by_survivors()
        rejoined, lost_after = await self.rejoin()
        final = await self.drain()
        return report(
            run, args, victim, target, self.target_origin, self.levels, lost, lost_after, rejoined, rto_ms, final
        )

    async def create_topic(self) -> None:
        topic = self.run.topic
        request = pb.CreateTopicRequest(name=topic, partitions=self.args.partitions)
        await create_topic_at(self.sites[self.victim], request)

        async def everywhere() -> bool:
            for s in self.sites.values():
                await vectors(s, topic)
            return True

        await wait_for(f"topic {topic} exists at every site (do the link filters carry 'drill-*'?)", everywhere, 15)

    async def start_consumers(self, bootstrap: str, tag: str) -> None:
        args = self.args
        for i in range(args.consumers):
            c = Consumer(
                bootstrap,
                group_id=self.run.group,
                auto_offset_reset="earliest",
                enable_auto_commit=False,
                commit_acks=args.commit_acks,
                client_id=f"drill-{i}",
                session_timeout_ms=6000,
                tls=self.sites[self.target].tls,
            )
            await c.start()
            c.subscribe([self.run.topic])
            self.consumers.append(c)
            loop = consume_loop(self.run, c, f"{tag}{i}", args.commit_interval_ms / 1000, self.stop_consumers)
            self.consumer_tasks.append(asyncio.create_task(loop))

    async def event(self) -> None:
        """Kill the victim's node or cut its links; after a cut, abandon its consumers for new ones at the target."""
        args, run, victim = self.args, self.run, self.victim
        self.out(
            f"drill: {args.mode} {victim} after {args.warmup:g}s warm-up "
            f"({len(run.acked)} records acked, {len(run.deliveries)} delivered, {run.commit_count} commits)"
        )
        for level in self.levels:  # producers at the victim stop with it
            self.producer_tasks[(victim, level)].cancel()
        run.event_at = _now()
        if args.mode == "kill":
            os.kill(int(self.info["pid"]), signal.SIGKILL)
        else:
            await set_links(self.topology, victim, self.sites, False, self.token)
            # The application at the victim is abandoned, as if it crashed; a new one starts at the target.
            self.stop_consumers.set()
            for t in self.consumer_tasks:
                t.cancel()
            for c in self.consumers:
                c._closed = True
                with contextlib.suppress(Exception):
                    await c._connection.close()
            self.consumers.clear()
            self.consumer_tasks.clear()
            self.stop_consumers = asyncio.Event()
            await self.start_consumers(self.sites[self.target].address, "r")
        health = await self.sites[self.target].stub_call("Health", pb.HealthRequest())
        self.target_origin = f"{health.site}@{health.epoch}"

    async def failover(self) -> float:
        """Wait until a consumer reads at the target; the RTO in ms. The victim is given back if that fails."""
        run, event, target = self.run, self.run.event_at, self.target

        async def first_at_target() -> bool:
            for t in self.consumer_tasks:  # a consumer that died would leave the wait to time out with no reason
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise DrillError(f"a consumer failed while failing over to {target}: {t.exception()!r}")
            return any(d.site_origin == self.target_origin and d.at >= event for d in run.deliveries)

        try:
            await wait_for(
                f"a consumer reads at {target}",
                first_at_target,
                60,
                lambda: "; ".join(c.describe() for c in self.consumers),
            )
        except BaseException:
            # The drill cannot finish: still give the operator the site back.
            with contextlib.suppress(Exception):
                await self.restore()
            raise
        first = min(d.at for d in run.deliveries if d.site_origin == self.target_origin and d.at >= event)
        rto_ms = (first - event) * 1000
        self.out(f"drill: first record consumed at {target} {rto_ms:.0f} ms after the {self.args.mode}")
        return rto_ms

    async def restore(self) -> None:
        """Restart the victim's node or heal its links, once (unless ``--no-restart``)."""
        if self.restored or self.args.no_restart:
            return
        self.restored = True
        if self.args.mode == "kill":
            restart_node(self.info, self.args.data_dir / self.victim, f"site {self.victim}")
        else:
            await set_links(self.topology, self.victim, self.sites, True, self.token)

    async def converged(self, names: list[SiteId]) -> bool:
        held = [await vectors(self.sites[s], self.run.topic) for s in names]
        return all(h == held[0] for h in held)

    async def lost_by_survivors(self) -> list[Acked]:
        """The acknowledged records no surviving site holds, once the survivors converged (or gave up)."""
        survivors = [n for n in self.names if n != self.victim]
        with contextlib.suppress(DrillError):
            await wait_for("the surviving sites converge", lambda: self.converged(survivors), CONVERGE_TIMEOUT_S)
        held_by_survivors = await merged_vectors([self.sites[s] for s in survivors], self.run.topic)
        return [a for a in self.run.acked.values() if not covers(held_by_survivors, a)]

    async def rejoin(self) -> tuple[bool, list[Acked]]:
        """Give the victim back and wait until every site converges: whether it did, and what is lost for good."""
        if self.args.no_restart:
            return False, []
        await self.restore()
        await wait_for(
            f"site {self.victim} rejoins and every site converges",
            lambda: self.converged(self.names),
            CONVERGE_TIMEOUT_S,
        )
        held_all = await vectors(self.sites[self.target], self.run.topic)
        return True, [a for a in self.run.acked.values() if not covers(held_all, a)]

    async def drain(self) -> dict[int, VectorOffset]:
        """Let the consumers read every record the target holds (or give up), stop them; the target's vectors."""
        run = self.run
        final = await vectors(self.sites[self.target], run.topic)
        total = sum(sum(seq for _, seq in v.items()) for v in final.values())

        async def drained() -> bool:
            return len({(d.partition, d.origin, d.origin_seq) for d in run.deliveries}) >= total

        with contextlib.suppress(DrillError):
            await wait_for("the consumers read every record", drained, 30)
        self.stop_consumers.set()
        await asyncio.gather(*self.consumer_tasks, return_exceptions=True)
        for c in self.consumers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await c.close()
        return final


def covers(held: dict[int, VectorOffset], a: Acked) -> bool:
    return held.get(a.partition, VectorOffset()).covers(Origin.parse(a.origin), a.origin_seq)


async def merged_vectors(sites: list[Site], topic: str) -> dict[int, VectorOffset]:
    out: dict[int, VectorOffset] = {}
    for s in sites:
        with contextlib.suppress(grpc.aio.AioRpcError):
            for p, v in (await vectors(s, topic)).items():
                out[p] = out.get(p, VectorOffset()).merge(v)
    return out


def report(
    run: Run,
    args: argparse.Namespace,
    victim: str,
    target: str,
    target_origin: str,
    levels: list[str],
    lost: list[Acked],
    lost_after: list[Acked],
    rejoined: bool,
    rto_ms: float,
    final: dict[int, VectorOffset],
) -> dict[str, Any]:
    event = run.event_at
    seen: dict[tuple[int, str, int], int] = {}
    for d in run.deliveries:
        key = (d.partition, d.origin, d.origin_seq)
        seen[key] = seen.get(key, 0) + 1
    dup_vs_commit = [
        d
        for d in run.deliveries
        if d.at >= event
        and d.partition in run.commits
        and run.commits[d.partition][1].covers(Origin.parse(d.origin), d.origin_seq)
    ]
    in_topic = {(p, str(o), s) for p, v in final.items() for o, n in v.items() for s in range(n)}
    never = sorted(in_topic - set(seen))
    per_level = {level: _level_figures(run, level, victim, lost, lost_after) for level in levels}
    broken = _broken_ack_promises(per_level)
    if dup_vs_commit:
        broken.append(f"{len(dup_vs_commit)} records delivered again after the failover were covered by a commit")
    if never:
        broken.append(f"{len(never)} records in the topic were never delivered")
    doc = {
        "mode": args.mode,
        "victim": victim,
        "failover_to": target,
        "failover_origin": target_origin,
        "topic": run.topic,
        "group": run.group,
        "rejoined": rejoined,
        "records_in_topic": len(in_topic),
        "records_sent": sum(run.sent.values()),
        "records_acked": len(run.acked),
        "delivered": len(run.deliveries),
        "delivered_unique": len(seen),
        "duplicates_total": sum(n - 1 for n in seen.values()),
        "duplicates_vs_commit": len(dup_vs_commit),
        "never_delivered": len(never),
        "never_delivered_first": [list(k) for k in never[:5]],
        "duplicates_vs_commit_first": [
            [d.consumer, d.partition, d.origin, d.origin_seq, d.site_origin, round((d.at - event) * 1000)]
            for d in dup_vs_commit[:5]
        ],
        "rto_ms": round(rto_ms),
        "commits": run.commit_count,
        "commit_errors": run.commit_errors,
        "commit_acks": args.commit_acks,
        "acks": per_level,
        "promises_broken": broken,
        "ok": not broken,
        "partitions_final": {str(p): v.to_text() for p, v in sorted(final.items())},
    }
    return doc


def _level_figures(run: Run, level: str, victim: str, lost: list[Acked], lost_after: list[Acked]) -> dict[str, Any]:
    """One ack level's figures: sent, acked, failed, and what the failover lost of what it acked."""
    event = run.event_at
    acked = [a for a in run.acked.values() if a.level == level]
    lost_l = [a for a in lost if a.level == level]
    return {
        "sent": sum(n for k, n in run.sent.items() if k.endswith(f"|{level}")),
        "acked": len(acked),
        "failed": sum(n for k, n in run.errors.items() if k.endswith(f"|{level}")),
        "acked_at_victim": sum(1 for a in acked if a.site == victim),
        "rpo_lost": len(lost_l),
        "rpo_window_ms": round((event - min(a.acked_at for a in lost_l)) * 1000) if lost_l else 0,
        "lost_after_rejoin": sum(1 for a in lost_after if a.level == level),
    }


def _broken_ack_promises(per_level: dict[str, Any]) -> list[str]:
    """The ack levels whose promise the failover broke: geo:N (N >= 2) lost at the failover, any lost for good."""
    broken = []
    for level, figures in per_level.items():
        n = parse_acks(level)[1]
        if n >= 2 and figures["rpo_lost"]:
            broken.append(f"{figures['rpo_lost']} records acked with acks={level} are at no surviving site")
        if figures["lost_after_rejoin"]:
            broken.append(f"{figures['lost_after_rejoin']} records acked with acks={level} are lost for good")
    return broken


def render(doc: dict[str, Any]) -> str:
    if doc["mode"] == "node-kill":
        return render_node_kill(doc)
    lines = [
        f"DR drill: {doc['mode']} site {doc['victim']}, consumers failed over to {doc['failover_to']}"
        f"{' (site rejoined)' if doc['rejoined'] else ''}",
        f"  topic {doc['topic']}: {doc['records_in_topic']} records; {doc['records_acked']} of "
        f"{doc['records_sent']} sent were acked",
        f"  {'ACKS':<10} {'SENT':>7} {'ACKED':>7} {'FAILED':>7} {'RPO LOST':>9} {'WINDOW':>9} "
        f"{'LOST AFTER REJOIN':>18}",
    ]
    for level, f in doc["acks"].items():
        lines.append(
            f"  {level:<10} {f['sent']:>7} {f['acked']:>7} {f['failed']:>7} {f['rpo_lost']:>9} "
            f"{str(f['rpo_window_ms']) + ' ms':>9} {f['lost_after_rejoin']:>18}"
        )
    lines += [
        f"  RTO (event to first record consumed at {doc['failover_to']}): {doc['rto_ms']} ms",
        f"  delivered {doc['delivered']} ({doc['delivered_unique']} distinct); duplicates relative to the last "
        f"commit: {doc['duplicates_vs_commit']}; redelivered in all: {doc['duplicates_total']}; "
        f"never delivered: {doc['never_delivered']}",
        f"  commits: {doc['commits']} at acks={doc['commit_acks']} ({doc['commit_errors']} failed)",
    ]
    lines += promises_lines(doc["promises_broken"], "every promise kept")
    return "\n".join(lines)


def promises_lines(broken: list[str], kept: str) -> list[str]:
    """A drill report's last lines: each promise the run broke, or ``kept`` when none was."""
    if not broken:
        return [f"  {kept}"]
    return ["  PROMISES BROKEN:", *(f"    - {b}" for b in broken)]


# --- node-kill: one node of a multi-node site ---------------------------------------------------------------


@dataclass(frozen=True)
class SiteRecord:
    """A record as the site serves it to readers, read back by the drill itself rather than by its consumer."""

    offset: int
    origin: str
    origin_seq: int
    value: str


SiteContent = dict[int, list[SiteRecord]]  # partition -> its records in log order


@dataclass
class NodeKill:
    """What the drill killed, and what became of the partitions the node led."""

    site: str
    site_origin: str
    node: int
    pid: int
    address: str
    led: list[int]  # the partitions it led at the kill
    new_leaders: dict[int, int] = field(default_factory=dict)
    rto_ms: dict[int, int] = field(default_factory=dict)  # per partition it led: kill -> first write acked again
    rto_read_ms: dict[int, int] = field(default_factory=dict)  # kill -> first record written after it consumed


def cluster_node_info(data_dir: Path, site: str, node: int, address: str) -> dict[str, Any]:
    """The node.json of ``node`` of a multi-node site, checked to be the running node the topology names."""
    path = data_dir / site / str(node) / NODE_INFO
    try:
        info: dict[str, Any] = json.loads(path.read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DrillError(
            f"--mode node-kill needs node {node}'s pid from {path} ({exc!r}): run the drill on the machine that runs "
            f"site {site}'s nodes, with the --data-dir of 'georep up' (each node's data dir is "
            "DATA_DIR/<site>/<node id>/)"
        ) from None
    if str(info.get("listen", "")).rpartition(":")[2] != address.rpartition(":")[2]:
        raise DrillError(
            f"{path} is of a node listening on {info.get('listen')}, but the topology puts node "
            f"{node} of site {site} on {address}: give the --topology and --data-dir the site runs "
            "with"
        )
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise DrillError(
            f"node {node} of site {site} is not running (pid {pid}, from {path}): start the site first"
        ) from None
    except PermissionError:
        raise DrillError(
            f"pid {pid} (from {path}) is another user's: run the drill as the user that runs the site's nodes"
        ) from None
    return info


async def leaders_at(site: Site, topic: str) -> dict[int, pb.PartitionLeader]:
    answers = []
    for address in site.nodes:
        with contextlib.suppress(grpc.aio.AioRpcError):
            answers.append(await site.stub_call("DescribeTopic", pb.DescribeTopicRequest(name=topic), address))
    return current_leaders(answers)


async def read_partition(
    address: str, topic: str, partition: int, start: int, end: int, tls: TlsConfig | None = None
) -> list[SiteRecord]:
    """The records of a partition at the node that serves it, from ``start`` up to ``end`` (its log end when asked),
    in log order. A node serves readers only what the quorum confirmed: a tail that stays unconfirmed for
    ``RPC_TIMEOUT_S`` is left out, as a reader would never see it."""
    out: list[SiteRecord] = []
    offset = start
    deadline = time.monotonic() + RPC_TIMEOUT_S  # for the next confirmed batch, not for the whole read
    async with client_channel(address, tls, CHANNEL_OPTIONS) as channel:
        stub = pbg.NodeStub(channel)
        while offset < end and time.monotonic() < deadline:
            request = pb.FetchRequest(
                topic=topic, partition=partition, offset=offset, max_bytes=1 << 20, max_wait_ms=100
            )
            call = stub.Fetch(request, timeout=RPC_TIMEOUT_S)
            try:
                response = await call.read()
            finally:
                call.cancel()
            if not isinstance(response, pb.FetchResponse) or not response.batches:
                continue  # nothing confirmed past ``offset`` yet
            try:
                records = decode_response(topic, partition, response.batches, offset, None)
            except (CorruptBatch, DecompressionError) as exc:
                raise DrillError(
                    f"{topic}-{partition} at {address} served a corrupt batch near offset {offset}: "
                    f"{exc}; check the node with 'georep scrub --now'"
                ) from None
            for r in records:
                out.append(SiteRecord(r.offset, str(r.origin), r.origin_seq, (r.value or b"").decode(errors="replace")))
            offset = max(offset, response.next_offset)
            deadline = time.monotonic() + RPC_TIMEOUT_S
    return out


async def read_site(site: Site, topic: str, partitions: int) -> SiteContent:
    """Every record of every partition of ``topic``, each read at the node leading it: what the site holds."""
    content: SiteContent = {}

    async def read_all() -> bool:
        served = await served_partitions(site, topic)
        if len(served) < partitions:
            return False
        for p, (address, ps) in sorted(served.items()):
            content[p] = await read_partition(address, topic, p, ps.log_start_offset, ps.log_end_offset, site.tls)
        return True

    await wait_for(f"every partition of {topic} can be read at site {site.name}", read_all, CONVERGE_TIMEOUT_S)
    return content


def by_coordinate(content: SiteContent) -> dict[tuple[int, str, int], str]:
    return {(p, r.origin, r.origin_seq): r.value for p, records in content.items() for r in records}


async def site_whole(site: Site, topic: str, partitions: int) -> bool:
    """Every node answers and is live in the site's metadata, and every partition of ``topic`` is served by a live
    leader."""
    for address in site.nodes:
        await site.stub_call("Health", pb.HealthRequest(), address)
    status = await site.any_call("ClusterStatus", pb.ClusterStatusRequest())
    if len(status.nodes) < len(site.nodes) or not all(n.live for n in status.nodes):
        return False
    led = [p for p in status.partitions if p.topic == topic and p.leader and p.leader_live]
    return len(led) >= partitions and len(await vectors(site, topic)) >= partitions


async def node_kill(
    args: argparse.Namespace,
    topology: Topology,
    sites: dict[SiteId, Site],
    levels: list[str],
    out: Callable[[str], None],
) -> dict[str, Any]:
    victim, members = _node_kill_victim(args, topology, sites)
    for s in sites.values():
        for address in s.nodes:
            try:
                await s.stub_call("Health", pb.HealthRequest(), address)
            except grpc.aio.AioRpcError as exc:
                raise DrillError(
                    f"node {address} of site {s.name} does not answer ({exc.code().name}): a drill starts "
                    "from a whole topology; start it first ('georep up')"
                ) from None
    # Every candidate's node.json now, rather than after the warm-up: the leader of partition 0 is known only then.
    infos = {
        n: cluster_node_info(args.data_dir, victim, n, members[n])
        for n in ([args.node] if args.node is not None else sorted(members))
    }
    return await NodeKillDrill(args, sites, levels, victim, members, infos, out).drill()


def _node_kill_victim(
    args: argparse.Namespace, topology: Topology, sites: dict[SiteId, Site]
) -> tuple[SiteId, dict[int, str]]:
    """The site whose node the drill kills (``--site``, else the first of several nodes) and its nodes' addresses."""
    names = list(sites)
    if args.failover_to:
        raise DrillError("--failover-to is not for --mode node-kill: the site keeps serving, and its consumer stays")
    several = [n for n in names if len(sites[n].nodes) > 1]
    victim = args.site or (several[0] if several else names[0])
    try:
        spec = topology.site(victim)
    except UnknownSite as exc:
        raise DrillError(str(exc)) from None
    if len(spec.nodes) < 2:
        raise DrillError(
            f"--mode node-kill kills one node of a site of several nodes, and site {victim} has one node: "
            "use --mode kill to kill a one-node site" + (f", or --site {several[0]}" if several else "")
        )
    members = {int(m.id): m.address for m in spec.members} or {i + 1: a for i, a in enumerate(spec.nodes)}
    if args.node is not None and args.node not in members:
        raise DrillError(
            f"site {victim} has no node {args.node}: its nodes are {', '.join(str(n) for n in sorted(members))}"
        )
    return SiteId(victim), members


class NodeKillDrill:
    """One ``--mode node-kill`` drill: the workload through the site's nodes, the kill of the node leading
    partition 0 (or ``--node``), the partitions' failover, what the site holds, the node's return, and the
    accounting of every record (the module's docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        sites: dict[SiteId, Site],
        levels: list[str],
        victim: SiteId,
        members: dict[int, str],
        infos: dict[int, dict[str, Any]],
        out: Callable[[str], None],
    ) -> None:
        self.args, self.sites, self.levels, self.out = args, sites, levels, out
        self.victim, self.members, self.infos = victim, members, infos
        self.names = list(sites)
        self.site = sites[victim]
        self.run = Run(topic=f"drill-{int(time.time() * 1000)}", group="")
        self.stop_producers = asyncio.Event()
        self.producer_tasks: list[asyncio.Task[None]] = []
        self.stop_consumer = asyncio.Event()
        # No group (the drill measures the partition leaders' failover alone): the consumer keeps its position, a
        # local offset of the site, which means the same at every node of it.
        self.consumer = Consumer(
            self.site.bootstrap, auto_offset_reset="earliest", client_id="drill-reader", tls=self.site.tls
        )
        self.consumer_task: asyncio.Task[None] | None = None
        self.info: dict[str, Any] = {}  # the killed node's node.json, once killed: what restarts it
        self.node = 0
        self.restored = False

    async def drill(self) -> dict[str, Any]:
        args, run, site, victim = self.args, self.run, self.site, self.victim
        health = await site.any_call("Health", pb.HealthRequest())
        site_origin = f"{health.site}@{health.epoch}"
        self.out(
            f"drill: node-kill at site {victim} ({len(self.members)} nodes); topic {run.topic}, ack levels "
            f"{', '.join(self.levels)}, {args.rate:g} records/s per producer at "
            f"{', '.join(self.names)}"
        )
        await self.create_topic()
        self.producer_tasks = [
            asyncio.create_task(produce_loop(run, self.sites[s], level, args.rate, self.stop_producers))
            for s in self.names
            for level in self.levels
        ]
        try:
            await self.consumer.start()
            self.consumer.assign([(run.topic, p) for p in range(args.partitions)])
            self.consumer_task = asyncio.create_task(consume_loop(run, self.consumer, "r0", None, self.stop_consumer))
            await asyncio.sleep(args.warmup)
            ev = await self.kill(site_origin)
            await self.time_failover(ev)
            await asyncio.sleep(args.after)
            self.stop_producers.set()
            await asyncio.gather(*self.producer_tasks, return_exceptions=True)
            # -- what the site holds without the node
            ev.new_leaders = {
                p: leader.node_id for p, leader in (await leaders_at(site, run.topic)).items() if p in ev.led
            }
            held = by_coordinate(await read_site(site, run.topic, args.partitions))
            lost = {v: a for v, a in run.acked.items() if a.site == victim and held.get(_coordinate(a)) != v}
            rejoined = await self.rejoin()
            final = await read_site(site, run.topic, args.partitions)
            held_final = by_coordinate(final)
            lost_after = {v: a for v, a in run.acked.items() if held_final.get(_coordinate(a)) != v} if rejoined else {}
            await self.drain(set(held_final))
            final_vectors = await every_vector(site, run.topic, self.args.partitions)
        except BaseException:
            # The drill cannot finish: still give the operator the node back.
            with contextlib.suppress(Exception):
                await self.restore()
            raise
        finally:
            await self.stop()
        return node_kill_report(run, ev, self.levels, lost, lost_after, rejoined, final, final_vectors)

    async def create_topic(self) -> None:
        topic, partitions = self.run.topic, self.args.partitions
        await create_topic_at(self.site, pb.CreateTopicRequest(name=topic, partitions=partitions))

        async def served_everywhere() -> bool:
            return all([len(await vectors(s, topic)) >= partitions for s in self.sites.values()])

        await wait_for(
            f"every site serves every partition of {topic} (do the link filters carry 'drill-*'?)",
            served_everywhere,
            30,
        )

    async def kill(self, site_origin: str) -> NodeKill:
        """SIGKILL the node leading partition 0 (or ``--node``); what it led."""
        args, run, victim = self.args, self.run, self.victim
        leaders = await leaders_at(self.site, run.topic)
        if args.node is not None:
            self.node = args.node
        elif 0 in leaders:
            self.node = leaders[0].node_id
        else:
            raise DrillError(f"partition 0 of {run.topic} has no leader at site {victim}: is the site whole?")
        node = self.node
        self.info = self.infos[node]
        led = sorted(p for p, leader in leaders.items() if leader.node_id == node)
        ev = NodeKill(victim, site_origin, node, int(self.info["pid"]), self.members[node], led)
        self.out(
            f"drill: SIGKILL node {node} of site {victim} (pid {ev.pid}), leader of {_partitions_text(led)}, "
            f"after {args.warmup:g}s warm-up ({len(run.acked)} records acked, "
            f"{len(run.deliveries)} read)"
        )
        run.sent_before_event = dict(run.sent)  # no await until the kill: whatever is numbered from here is after it
        run.event_at = _now()
        try:
            os.kill(ev.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.info = {}  # nothing to restart: it was not this drill that stopped it
            raise DrillError(f"node {node} of site {victim} (pid {ev.pid}) exited before the drill killed it") from None
        return ev

    def firsts(self, led: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Per partition the node led: the first ack, and the first record consumed, of a record sent after the
        kill (only a new leader can have stored one)."""
        run = self.run
        acked: dict[int, float] = {}
        for value, a in run.acked.items():
            if a.partition in led and a.site == self.victim and run.sent_after_event(value):
                acked[a.partition] = min(acked.get(a.partition, a.acked_at), a.acked_at)
        read: dict[int, float] = {}
        for d in run.deliveries:
            after = d.at >= run.event_at and run.sent_after_event(d.value)
            if d.partition in led and after and d.partition not in read:
                read[d.partition] = d.at
        return acked, read

    async def time_failover(self, ev: NodeKill) -> None:
        """Wait until every partition the node led takes writes and serves them again; the RTOs into ``ev``."""
        led, event, node = ev.led, self.run.event_at, ev.node
        if not led:
            self.out(f"drill: node {node} led no partition of {self.run.topic}: no failover to time")
            return

        async def failed_over() -> bool:
            if self.consumer_task is not None and self.consumer_task.done():
                raise DrillError(f"the drill's consumer stopped: {self.consumer_task.exception()!r}")
            acked, read = self.firsts(led)
            return len(acked) == len(led) and len(read) == len(led)

        def where() -> str:
            acked, read = self.firsts(led)
            return (
                f"writes acked again on {_partitions_text(sorted(acked))}, read again on "
                f"{_partitions_text(sorted(read))}; consumer {self.consumer.describe()}"
            )

        await wait_for(
            f"every partition node {node} led takes writes and serves them again",
            failed_over,
            FAILOVER_TIMEOUT_S,
            where,
        )
        acked_first, read_first = self.firsts(led)
        ev.rto_ms = {p: round((t - event) * 1000) for p, t in sorted(acked_first.items())}
        ev.rto_read_ms = {p: round((t - event) * 1000) for p, t in sorted(read_first.items())}
        self.out(
            f"drill: a partition node {node} led acked a write {min(ev.rto_ms.values())} ms after the kill "
            f"(all {len(led)}: {max(ev.rto_ms.values())} ms); first such record consumed after "
            f"{min(ev.rto_read_ms.values())} ms"
        )

    async def restore(self) -> None:
        """Restart the killed node, once (unless ``--no-restart``, or no node was killed)."""
        if self.info and not self.restored and not self.args.no_restart:
            self.restored = True
            restart_node(
                self.info, self.args.data_dir / self.victim / str(self.node), f"node {self.node} of site {self.victim}"
            )

    async def rejoin(self) -> bool:
        """Restart the node and wait until the site is whole, then until every site converges; whether the node
        came back."""
        args, run, site, partitions = self.args, self.run, self.site, self.args.partitions
        rejoined = False
        if not args.no_restart:
            await self.restore()
            await wait_for(
                f"node {self.node} is back and site {self.victim} is whole (every node live, every partition led)",
                lambda: site_whole(site, run.topic, partitions),
                CONVERGE_TIMEOUT_S,
            )
            rejoined = True

        async def all_converged() -> bool:
            held_at = [await vectors(self.sites[s], run.topic) for s in self.names]
            return all(len(h) >= partitions and h == held_at[0] for h in held_at)

        if len(self.names) > 1:
            await wait_for("every site converges", all_converged, CONVERGE_TIMEOUT_S)
        return rejoined

    async def drain(self, in_topic: set[tuple[int, str, int]]) -> None:
        """Let the consumer read every record of the topic (or give up)."""

        async def drained() -> bool:
            return in_topic <= {(d.partition, d.origin, d.origin_seq) for d in self.run.deliveries}

        with contextlib.suppress(DrillError):
            await wait_for("the consumer read every record", drained, DRAIN_TIMEOUT_S)

    async def stop(self) -> None:
        self.stop_producers.set()
        self.stop_consumer.set()
        tasks = [*self.producer_tasks, *([self.consumer_task] if self.consumer_task else [])]
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self.consumer.close()


def _coordinate(a: Acked) -> tuple[int, str, int]:
    return (a.partition, a.origin, a.origin_seq)


def _partitions_text(partitions: list[int]) -> str:
    if not partitions:
        return "no partition"
    return ("partition " if len(partitions) == 1 else "partitions ") + ", ".join(map(str, partitions))


def _deliveries_against(
    run: Run, final: SiteContent
) -> tuple[dict[tuple[int, str, int], int], list[Delivery], list[Delivery]]:
    """The consumer's deliveries against what the site holds at the end: how often each record was read, the
    reads that skipped records the site holds before them, and the reads of records the site does not hold there."""
    at_offset = {(p, r.offset): (i, r) for p, records in final.items() for i, r in enumerate(records)}
    seen: dict[tuple[int, str, int], int] = {}
    gaps: list[Delivery] = []
    misread: list[Delivery] = []
    last: dict[int, int] = {}  # partition -> index in the site's log of the last record delivered
    for d in run.deliveries:
        key = (d.partition, d.origin, d.origin_seq)
        seen[key] = seen.get(key, 0) + 1
        found = at_offset.get((d.partition, d.offset))
        if found is None or (found[1].origin, found[1].origin_seq, found[1].value) != (d.origin, d.origin_seq, d.value):
            misread.append(d)  # the site holds another record there, or none: the consumer saw what it lost
            continue
        if found[0] > last.get(d.partition, -1) + 1:
            gaps.append(d)  # records the site holds before this one were skipped
        last[d.partition] = max(found[0], last.get(d.partition, -1))
    return seen, gaps, misread


def node_kill_report(
    run: Run,
    ev: NodeKill,
    levels: list[str],
    lost: dict[str, Acked],
    lost_after: dict[str, Acked],
    rejoined: bool,
    final: SiteContent,
    final_vectors: dict[int, VectorOffset],
) -> dict[str, Any]:
    seen, gaps, misread = _deliveries_against(run, final)
    in_topic = {(p, r.origin, r.origin_seq) for p, records in final.items() for r in records}
    never = sorted(in_topic - set(seen))

    def allowed(value: str, a: Acked) -> bool:
        """acks=leader promised the leader's log only: a record sent before the kill to a partition the killed node
        led may be lost with it, if no other member held it yet."""
        return a.level == "leader" and a.site == ev.site and a.partition in ev.led and not run.sent_after_event(value)

    per_level: dict[str, Any] = {}
    broken = []
    for level in levels:
        per_level[level] = _level_figures(run, level, ev.site, list(lost.values()), list(lost_after.values()))
        bad = sum(1 for v, a in lost.items() if a.level == level and not allowed(v, a))
        if bad:
            broken.append(
                f"{bad} records acked with acks={level} at site {ev.site} were not there once node {ev.node} was dead"
            )
        bad_after = sum(1 for v, a in lost_after.items() if a.level == level and not allowed(v, a))
        if bad_after:
            broken.append(f"{bad_after} records acked with acks={level} are lost for good")
    dups = sum(n - 1 for n in seen.values())
    if dups:
        broken.append(f"the consumer read {dups} records twice")
    if gaps:
        broken.append(f"the consumer skipped records {len(gaps)} times")
    if misread:
        broken.append(f"the consumer read {len(misread)} records that the site does not hold where it read them")
    if never:
        broken.append(f"{len(never)} records in the topic were never delivered")
    first = [ms for ms in ev.rto_ms.values()]
    first_read = [ms for ms in ev.rto_read_ms.values()]
    return {
        "mode": "node-kill",
        "victim": ev.site,
        "victim_node": ev.node,
        "victim_pid": ev.pid,
        "victim_address": ev.address,
        "victim_partitions": ev.led,
        "new_leaders": {str(p): n for p, n in sorted(ev.new_leaders.items())},
        "site_origin": ev.site_origin,
        "topic": run.topic,
        "rejoined": rejoined,
        "records_in_topic": len(in_topic),
        "records_sent": sum(run.sent.values()),
        "records_acked": len(run.acked),
        "delivered": len(run.deliveries),
        "delivered_unique": len(seen),
        "duplicates_total": dups,
        "gaps": len(gaps),
        "misread": len(misread),
        "never_delivered": len(never),
        "never_delivered_first": [list(k) for k in never[:5]],
        "gaps_first": [[d.partition, d.offset, d.origin, d.origin_seq] for d in gaps[:5]],
        "misread_first": [[d.partition, d.offset, d.origin, d.origin_seq] for d in misread[:5]],
        "rto_ms": min(first) if first else None,
        "rto_ms_all": max(first) if first else None,
        "rto_ms_by_partition": {str(p): ms for p, ms in ev.rto_ms.items()},
        "rto_read_ms": min(first_read) if first_read else None,
        "acks": per_level,
        "promises_broken": broken,
        "ok": not broken,
        "partitions_final": {str(p): v.to_text() for p, v in sorted(final_vectors.items())},
    }


def render_node_kill(doc: dict[str, Any]) -> str:
    node = doc["victim_node"]
    lines = [
        f"DR drill: node-kill node {node} of site {doc['victim']} (pid {doc['victim_pid']}, leader of "
        f"{_partitions_text(doc['victim_partitions'])})"
        f"{'; node restarted, site whole again' if doc['rejoined'] else ''}",
        f"  topic {doc['topic']}: {doc['records_in_topic']} records; {doc['records_acked']} of "
        f"{doc['records_sent']} sent were acked",
        f"  {'ACKS':<10} {'SENT':>7} {'ACKED':>7} {'FAILED':>7} {'RPO LOST':>9} {'WINDOW':>9} "
        f"{'LOST AFTER REJOIN':>18}",
    ]
    for level, f in doc["acks"].items():
        lines.append(
            f"  {level:<10} {f['sent']:>7} {f['acked']:>7} {f['failed']:>7} {f['rpo_lost']:>9} "
            f"{str(f['rpo_window_ms']) + ' ms':>9} {f['lost_after_rejoin']:>18}"
        )
    if doc["rto_ms"] is None:
        lines.append(f"  RTO: none to measure, node {node} led no partition of the topic")
    else:
        by_partition = ", ".join(f"p{p} {ms} ms" for p, ms in doc["rto_ms_by_partition"].items())
        lines.append(
            f"  RTO (kill to the first write acked on a partition node {node} led): {doc['rto_ms']} ms "
            f"({by_partition}); to the first such record consumed: {doc['rto_read_ms']} ms"
        )
        moved = ", ".join(f"p{p} -> node {n}" for p, n in doc["new_leaders"].items())
        lines.append(f"  new leaders: {moved or '-'}")
    lines += [
        f"  one consumer assigned every partition at {doc['victim']}: delivered {doc['delivered']} "
        f"({doc['delivered_unique']} distinct); duplicates: {doc['duplicates_total']}; gaps: {doc['gaps']}; "
        f"misread: {doc['misread']}; never delivered: {doc['never_delivered']}"
    ]
    lines += promises_lines(doc["promises_broken"], "every promise kept")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        doc = asyncio.run(drill(args))
    except DrillError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if doc.get("client") == "kafka":
        from georep.cli.kafka_drill import render as render_kafka

        print(render_kafka(doc))
    else:
        print(render(doc))
    if args.report is not None:
        args.report.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"report written to {args.report}")
    return 0 if doc["ok"] else EXIT_BROKEN
