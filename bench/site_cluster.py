"""A three-node site: produce throughput at acks=all against acks=leader, and partition leader failover, in one run.

Run from the repository root::

    .venv/bin/python bench/site_cluster.py            # full run, about 3 minutes
    .venv/bin/python bench/site_cluster.py --quick    # smoke run, about 20 s

Each part starts its own site ``a`` of three ``georep node --node-id N``
processes (one topology file that lists the three nodes and no links;
replication factor 3, min-insync 2, the background scrubber off) on ports
picked free just before, under one temporary directory. What is measured
(bench/README.md explains how to read it):

* ``throughput``: ``georep.client.Producer`` (bootstrapped with all three
  nodes; it sends each partition's batches to that partition's leader)
  writes the same records to the same topic at ``acks=leader`` and at
  ``acks=all``, with the same producer settings, the two alternating, best
  of ``--repeats``; then acks=all over acks=leader (target: at least 60%).
  One topic per record size and partition count, created before the clock.
* ``failover``: a producer at ``acks=all`` sends one small record to a
  one-partition topic every ``--interval-ms`` (its batches are small: while
  the partition has no leader, the records wait in 4 KiB batches) and
  timestamps every ack. The partition's leader gets ``kill -9``; the figure
  is the time from the kill to the first ack of a record sent after the
  killed process was reaped, so the new leader acknowledged it. The killed
  node is then restarted, and the next round starts once it serves again
  and the partition's open segment is back on all three nodes (the site's
  ``ClusterStatus``): every round is one node's loss from a whole site.
  ``--rounds`` rounds; the median and the worst, printed next to
  ``--session-timeout-ms``, which the detection takes most of (target: median
  at most 1 s). Each round also shows, from the nodes' logs, when the
  controller's election committed, when the new leader took the role up and
  when it had recovered the open segment and opened the next one.

After a kill the new leader opens the partition's next segment on the two
survivors. The restarted node is back in the partition's ensemble only once
that segment rolls: by size, or when the repair rolls a short open segment
(docs/cluster.md, "Repair and decommission"). So the failover site has small
segments (``--failover-segment-bytes``, 256 KiB: a roll every few seconds at
the writer's rate) and every round waits for the roll, bounded: without it
the next kill would leave the open segment with one member of two, and the
partition would wait for the killed node to come back, which measures a
double failure.

``join``: a fourth node joins under acks=all load. Nodes cannot join a
running site's Raft group yet (it is the node list every node starts with;
docs/cluster.md, "Expansion"), so the fourth node is listed from the start
and started late. It takes segments at each partition's next roll, so the
time to its first segment is about one roll at the write rate
(``--failover-segment-bytes``), printed beside it: the figure says that no
more than a roll passes, not how fast the site is.

Every node is stopped and the temporary directory removed on exit, on an
error, on Ctrl-C and on SIGTERM.

The file is not called ``cluster.py``: Python puts ``bench/`` first on
``sys.path`` when it runs a bench script, and a ``bench/cluster.py`` would hide
the ``cluster`` package that georep imports, from every bench script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import logging
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

# bench/ is on sys.path when this file runs as a script: reuse the helpers of the other benches.
from produce import BenchError, Result, progress, settle_page_cache, size_label
from replication import free_ports

from georep.client import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel
from georep.server.process import NODE_INFO, NodeProcess, NodeStartError

SITE = "a"
NODES = (1, 2, 3)
JOIN_WAIT_S = 30.0
REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2
DEFAULT_SESSION_TIMEOUT_MS = 500  # a short in-DC session, as the failover target assumes (bench/README.md)
DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_FAILOVER_SEGMENT_BYTES = 256 << 10
FAILOVER_BATCH_BYTES = 4096  # small batches: a backlog after the outage goes out in many, each acked apart
DEFAULT_RECORD_BYTES = "100,1024"
DEFAULT_PARTITIONS = "1,3"
DEFAULT_MB = 30.0  # of record values per throughput run
QUICK_MB = 1.0
DEFAULT_BATCH_BYTES = 65536
LINGER_MS = 5
MAX_IN_FLIGHT = 5  # the producer's default, per partition
DEFAULT_ROUNDS = 7
DEFAULT_FAILOVER_RECORD_BYTES = 100
FAILOVER_TOPIC = "failover"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
LEADER_TIMEOUT_S = 60.0
FAILOVER_TIMEOUT_S = 60.0  # kill -> first ack; a round that waits longer is reported as failed
WHOLE_TIMEOUT_S = 60.0  # restart -> the open segment on every node again
RUN_TIMEOUT_S = 300.0
DELIVERY_TIMEOUT_MS = 120_000
RPC_TIMEOUT_S = 2.0
POLL_S = 0.05  # DescribeTopic and ClusterStatus polls, at most this often
VICTIMS = ("any", "partition-leader", "raft-leader")
OUTSTANDING_MAX = 20_000  # failover records sent and not yet acknowledged: the writer stops sending above


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# -- the site -------------------------------------------------------------------------------------------------------


def site_toml(grpc_ports: Sequence[int], raft_ports: Sequence[int], nodes_: Sequence[int] = NODES) -> str:
    nodes = ", ".join(
        f'{{ id = {n}, address = "127.0.0.1:{g}", raft = "127.0.0.1:{r}" }}'
        for n, g, r in zip(nodes_, grpc_ports, raft_ports, strict=True)
    )
    return f"[sites.{SITE}]\nnodes = [{nodes}]\n"


class Site:
    """The three nodes of site ``a``, each ``georep node --node-id N`` with its own data dir under ``root``."""

    def __init__(
        self, root: Path, node_args: list[str], listed: Sequence[int] = NODES, started: Sequence[int] = NODES
    ) -> None:
        """``listed``: the nodes of the topology (the site's Raft group); ``started``: those :meth:`start` runs."""
        ports = free_ports(2 * len(listed))
        self.addresses = {n: f"127.0.0.1:{ports[i]}" for i, n in enumerate(listed)}
        self.raft_nodes = {f"127.0.0.1:{ports[len(listed) + i]}": n for i, n in enumerate(listed)}
        root.mkdir(parents=True, exist_ok=True)
        topology = root / "topology.toml"
        topology.write_text(site_toml(ports[: len(listed)], ports[len(listed) :], listed))
        self.nodes = {
            n: NodeProcess(
                SITE,
                root / SITE / str(n),
                listen=self.addresses[n],
                extra_args=["--node-id", str(n), "--topology", str(topology), *node_args],
            )
            for n in listed
        }
        self.started = tuple(started)

    @property
    def bootstrap(self) -> list[str]:
        return [self.addresses[n] for n in self.started]

    def start(self) -> None:
        """Launch every node first: a node serves only once a majority of its site's nodes run."""
        for n in self.started:
            self.nodes[n].launch()
        for n in self.started:
            self.nodes[n].wait_ready(START_TIMEOUT_S)

    def live(self) -> list[int]:
        return [n for n, p in self.nodes.items() if p.alive()]

    def close(self) -> None:
        """SIGTERM to every node at once, then wait (``NodeProcess.stop`` kills one that outlasts the timeout)."""
        for node in self.nodes.values():
            if node.alive() and node.proc is not None:
                node.proc.terminate()
        for node in self.nodes.values():
            node.stop(STOP_TIMEOUT_S)

    async def restart(self, n: int) -> None:
        """Start node ``n`` again on its address and wait until it serves: it wrote ``node.json``, which it does
        once it has registered with the site's metadata and heartbeated."""
        node = self.nodes[n]
        node.launch()
        info = node.data_dir / NODE_INFO
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and node.alive():  # polled here: Ctrl-C must not wait on a thread
            with contextlib.suppress(OSError, ValueError):
                if json.loads(info.read_text()).get("pid") == node.pid:
                    break
            await asyncio.sleep(0.02)
        node.wait_ready(1.0)  # reads node.json; raises with the node's log if it exited or is not ready

    async def describe(self, topic: str, nodes: Sequence[int] | None = None) -> pb.TopicDescription:
        """The topic as the first of ``nodes`` (default: the live ones) that answers describes it."""
        for n in nodes if nodes is not None else self.live():
            with contextlib.suppress(grpc.aio.AioRpcError):
                async with client_channel(self.addresses[n], None) as ch:
                    return await pbg.NodeStub(ch).DescribeTopic(
                        pb.DescribeTopicRequest(name=topic), timeout=RPC_TIMEOUT_S
                    )
        raise BenchError(f"no node of site {SITE} describes topic {topic!r}")

    async def status(self, nodes: Sequence[int] | None = None) -> pb.ClusterStatusResponse:
        """``ClusterStatus`` from the first of ``nodes`` (default: the live ones) that answers: its view of the
        site's metadata and of the Raft group."""
        for n in nodes if nodes is not None else self.live():
            with contextlib.suppress(grpc.aio.AioRpcError):
                async with client_channel(self.addresses[n], None) as ch:
                    return await pbg.NodeStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=RPC_TIMEOUT_S)
        raise BenchError(f"no node of site {SITE} answers ClusterStatus")

    async def serving_leaders(self, topic: str, not_node: int | None = None) -> dict[int, int]:
        """partition -> node, for every partition whose leader (as the metadata names it) serves it: that node's
        own ``DescribeTopic`` lists the partition. The others are left out."""
        named = await self.describe(topic, [n for n in self.live() if n != not_node])
        out = {}
        for leader in named.leaders:
            if leader.node_id in (0, not_node) or leader.node_id not in self.live():
                continue
            with contextlib.suppress(BenchError):
                own = await self.describe(topic, [leader.node_id])
                if any(s.partition == leader.partition for s in own.partition_states):
                    out[leader.partition] = leader.node_id
        return out

    async def wait_leaders(self, topic: str, partitions: int) -> dict[int, int]:
        deadline = time.monotonic() + LEADER_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(BenchError):
                found = await self.serving_leaders(topic)
                if len(found) == partitions:
                    return found
            await asyncio.sleep(POLL_S)
        raise BenchError(f"not every partition of {topic!r} has a serving leader after {LEADER_TIMEOUT_S:g}s")

    async def wait_whole(self, topic: str, partitions: int, timeout_s: float) -> None:
        """Until every node is live and every partition of ``topic`` has a live leader and an open segment on
        ``REPLICATION_FACTOR`` nodes, as the site's metadata says."""
        deadline = time.monotonic() + timeout_s
        last = "no node answered"
        while time.monotonic() < deadline:
            with contextlib.suppress(BenchError):
                status = await self.status()
                dead = [n.node_id for n in status.nodes if not n.live]
                mine = [p for p in status.partitions if p.topic == topic]
                short = {
                    p.partition: list(p.open_ensemble)
                    for p in mine
                    if not p.leader_live or len(p.open_ensemble) < REPLICATION_FACTOR
                }
                if not dead and not short and len(mine) == partitions:
                    return
                last = f"dead nodes {dead or 'none'}, partitions not on {REPLICATION_FACTOR} nodes: {short or 'none'}"
            await asyncio.sleep(POLL_S)
        raise BenchError(f"{topic} is not whole after {timeout_s:g}s: {last}")

    async def create_topic(self, topic: str, partitions: int) -> dict[int, int]:
        async with client_channel(self.addresses[NODES[0]], None) as ch:  # any node creates it, through Raft
            await pbg.NodeStub(ch).CreateTopic(pb.CreateTopicRequest(name=topic, partitions=partitions), timeout=30)
        leaders = await self.wait_leaders(topic, partitions)
        await self.wait_whole(topic, partitions, WHOLE_TIMEOUT_S)
        return leaders


def node_args(cfg: Config, segment_bytes: int) -> list[str]:
    return [
        "--replication-factor",
        str(REPLICATION_FACTOR),
        "--min-insync-replicas",
        str(MIN_INSYNC_REPLICAS),
        "--session-timeout-ms",
        str(cfg.session_timeout_ms),
        "--segment-bytes-max",
        str(segment_bytes),
        "--scrub-bytes-per-s",
        "0",
    ]


def start_site(stack: contextlib.ExitStack, root: Path, cfg: Config, segment_bytes: int) -> Site:
    site = Site(root, node_args(cfg, segment_bytes))
    stack.callback(site.close)
    progress(f"starting nodes {', '.join(str(n) for n in NODES)} of site {SITE} in {root.name}/")
    site.start()
    return site


# -- 1. throughput --------------------------------------------------------------------------------------------------


@dataclass
class Pair:
    """One topic: the same records at both ack levels."""

    record_bytes: int
    partitions: int
    leader: Result
    all: Result
    leaders: dict[int, int] = field(default_factory=dict)  # partition -> node, when the topic was created

    @property
    def ratio(self) -> float:
        return self.all.mb_s / self.leader.mb_s


async def produce_run(
    bootstrap: list[str], topic: str, partitions: int, acks: str, records: int, value: bytes, batch_bytes: int
) -> float:
    """Send ``records`` records and wait until every one is acknowledged; the seconds that took."""
    producer = Producer(
        bootstrap,
        acks=acks,
        batch_size=batch_bytes,
        linger_ms=LINGER_MS,
        max_in_flight=MAX_IN_FLIGHT,
        delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
    )
    await producer.start()
    try:
        # Metadata, the leaders' streams, before the clock.
        await asyncio.gather(*(producer.send(topic, value, partition=p) for p in range(partitions)))
        futures = []
        async with asyncio.timeout(RUN_TIMEOUT_S):
            start = time.perf_counter()
            for _ in range(records):
                futures.append(producer.send(topic, value))
                if producer.buffered_bytes > producer.buffer_memory:
                    await producer.wait_for_buffer()
            await producer.flush()
            elapsed = time.perf_counter() - start
        await asyncio.gather(*futures)  # raises the first delivery error, if any
        return elapsed
    finally:
        await producer.close(timeout_s=10)


async def measure_throughput(site: Site, cfg: Config) -> list[Pair]:
    pairs = []
    for record_bytes in cfg.record_bytes:
        value = os.urandom(record_bytes)
        records = max(1, int(cfg.mb * 1e6 / record_bytes))
        payload = records * record_bytes
        for partitions in cfg.partitions:
            topic = f"tput-{record_bytes}b-{partitions}p"
            progress(f"creating {topic}")
            leaders = await site.create_topic(topic, partitions)
            pair = Pair(
                record_bytes,
                partitions,
                Result("acks=leader", cfg.batch_bytes, partitions, records, payload),
                Result("acks=all", cfg.batch_bytes, partitions, records, payload),
                leaders,
            )
            for i in range(cfg.repeats):
                order = (("leader", pair.leader), ("all", pair.all))
                for acks, result in order if i % 2 == 0 else order[::-1]:  # alternate which goes first
                    settle_page_cache()
                    progress(f"{topic}: acks={acks} run {i + 1}")
                    result.seconds.append(
                        await produce_run(site.bootstrap, topic, partitions, acks, records, value, cfg.batch_bytes)
                    )
            pairs.append(pair)
    return pairs


# -- 2. failover ----------------------------------------------------------------------------------------------------


@dataclass
class Round:
    number: int
    victim: int = 0
    partition: int = 0  # the partition of FAILOVER_TOPIC that the victim led, and the writer writes to
    raft_leader: int = 0  # the node whose Raft replica led the site's metadata (ran the controller) at the kill
    new_leader: int = 0
    named_s: float = float("nan")  # kill -> a survivor's DescribeTopic names another leader
    serving_s: float = float("nan")  # kill -> that leader's DescribeTopic lists the partition (it serves it)
    failover_s: float = float("nan")  # kill -> first ack of a record sent after the victim was reaped
    # From the nodes' logs (bench/README.md, "How to read it"), seconds after the kill:
    elected_s: float = float("nan")  # the controller's ElectLeader committed
    leading_s: float = float("nan")  # the new leader's node took the role up (its next look at the metadata)
    open_s: float = float("nan")  # it recovered the dead leader's open segment and opened the next one
    back_s: float = float("nan")  # the victim's restart -> it serves again
    whole_s: float = float("nan")  # the victim's restart -> the open segment is on all three nodes again
    raft_elected_s: float = float("nan")  # kill -> a survivor leads the Raft group (its log), if the victim led it
    failed: int = 0  # records whose delivery failed during the round
    # Raft elections (a node ran for leader), from the nodes' logs: one is due after the kill if the victim led the
    # Raft group, none otherwise; none while the restarted node rejoins, none while no node is down.
    elections: int = 0  # from the kill until the restart
    rejoin_elections: int = 0  # from the restart until the site is whole again
    quiet_elections: int = 0  # from the previous round's end (whole) until this kill
    killed_at: float = float("nan")  # time.time() of the kill and of the restart, to find them in the nodes' logs
    restarted_at: float = float("nan")
    error: str = ""


class Writer:
    """One small record to partition ``partition`` every ``interval_s``, at acks=all, each ack timestamped. Each round
    points it at the partition whose leader it kills, before its warm-up."""

    def __init__(self, producer: Producer, interval_s: float, record_bytes: int) -> None:
        self.producer = producer
        self.partition = 0
        self.interval_s = interval_s
        self.value = os.urandom(record_bytes)
        self.acks: list[tuple[float, float]] = []  # (sent, acknowledged), time.monotonic()
        self.failures: list[str] = []
        self.outstanding = 0
        self.stop = asyncio.Event()

    def _done(self, sent: float, fut: asyncio.Future[Any]) -> None:
        self.outstanding -= 1
        if fut.cancelled():
            self.failures.append("cancelled")
        elif (exc := fut.exception()) is not None:
            self.failures.append(f"{type(exc).__name__}: {exc}")
        else:
            self.acks.append((sent, time.monotonic()))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not self.stop.is_set():
            if self.outstanding < OUTSTANDING_MAX:
                sent = time.monotonic()
                fut = self.producer.send(FAILOVER_TOPIC, self.value, partition=self.partition)
                self.outstanding += 1
                fut.add_done_callback(functools.partial(self._done, sent))
            next_at = max(next_at + self.interval_s, loop.time())  # no burst to catch up after a stall
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), max(0.0, next_at - loop.time()))

    async def first_ack_sent_after(self, t: float, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        seen = 0  # acks already looked at: all of records sent before t
        while time.monotonic() < deadline:
            after = [acked for sent, acked in self.acks[seen:] if sent >= t]
            if after:
                return min(after)
            seen = len(self.acks)
            await asyncio.sleep(0.005)
        return None


async def watch_leader(site: Site, victim: int, since: float, rnd: Round) -> None:
    """Poll the survivors until one names a leader of ``rnd.partition`` other than ``victim`` (``rnd.named_s``) and
    that leader serves the partition (``rnd.serving_s``, ``rnd.new_leader``), in seconds after ``since``."""
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    survivors = [n for n in NODES if n != victim]
    part = rnd.partition
    while time.monotonic() < deadline:
        with contextlib.suppress(BenchError):
            named = await site.describe(FAILOVER_TOPIC, survivors)
            leader = next((x.node_id for x in named.leaders if x.partition == part and x.node_id not in (0, victim)), 0)
            if leader:
                if math.isnan(rnd.named_s):
                    rnd.named_s = time.monotonic() - since
                own = await site.describe(FAILOVER_TOPIC, [leader])
                if any(s.partition == part for s in own.partition_states):
                    rnd.serving_s = time.monotonic() - since
                    rnd.new_leader = leader
                    return
        await asyncio.sleep(POLL_S)


LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"  # georep node's log lines start with this (logging's asctime)


def log_lines(site: Site, since_wall: float) -> Iterator[tuple[float, int, str]]:
    """(wall-clock time, node, line) of every line the nodes logged at or after ``since_wall`` (time.time()). Log
    times have millisecond resolution and the local clock, as time.time() has."""
    for n, node in site.nodes.items():
        path = node.data_dir / "node.log"
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    at = datetime.datetime.strptime(line[:23], LOG_TIME_FORMAT).timestamp()
                except ValueError:
                    continue
                if at >= since_wall:
                    yield at, n, line


def log_events(site: Site, since_wall: float, leader: int, partition: int) -> dict[str, float]:
    """The failover's steps in the nodes' logs after ``since_wall``: wall-clock times of the first ElectLeader of
    the partition that a controller committed, of ``leader`` taking the role up, of ``leader`` writing the next
    segment, and of a node becoming the Raft leader (``raft_elected``)."""
    name_ = f"{FAILOVER_TOPIC}-{partition}"
    marks = {
        "elected": f"leads {name_} in epoch",  # "controller: node N leads ..." in the controller's log
        "leading": f"node {leader} leads {name_} in epoch",
        "open": f"node {leader} writes {name_} segment",
    }
    found: dict[str, float] = {}
    for at, n, line in log_lines(site, since_wall):
        if RAFT_WON in line:
            found["raft_elected"] = min(found.get("raft_elected", at), at)
        for name, text in marks.items():
            if text not in line or (name == "elected") != ("controller:" in line):
                continue
            if name != "elected" and n != leader:
                continue
            found[name] = min(found.get(name, at), at)
    return found


RAFT_RAN = "runs for leader in term"  # georep/raft/store.py logs these on every Raft state change
RAFT_WON = "leads the site's Raft group in term"


def raft_elections(site: Site, since_wall: float, until_wall: float = math.inf) -> int:
    """How many times a node ran for Raft leader between the two wall-clock times (its log says so)."""
    return sum(1 for at, _, line in log_lines(site, since_wall) if at < until_wall and RAFT_RAN in line)


async def pick_victim(site: Site, victim: str) -> tuple[int, int, int]:
    """(node to kill, the partition of FAILOVER_TOPIC it leads, the Raft leader's node) for ``--victim``:
    ``raft-leader``, the node that leads the Raft group and a partition (the lowest it leads); ``partition-leader``,
    the leader of the lowest partition whose leader does not lead the Raft group; ``any``, partition 0's leader.
    A partition per node spreads the leaders over every node, the Raft leader included (partitions move to the
    survivor that leads the fewest): raises BenchError if the wanted kind of node leads none after a while."""
    deadline = time.monotonic() + LEADER_TIMEOUT_S
    while True:
        leaders = await site.wait_leaders(FAILOVER_TOPIC, len(NODES))
        raft = site.raft_nodes.get((await site.status()).raft.leader_address, 0)
        if victim == "any":
            return leaders[0], 0, raft
        if raft:
            led = sorted(p for p, n in leaders.items() if (n == raft) == (victim == "raft-leader"))
            if led:
                return leaders[led[0]], led[0], raft
        if time.monotonic() >= deadline:
            raise BenchError(
                f"--victim {victim}: no such node after {LEADER_TIMEOUT_S:g}s (Raft leader: node "
                f"{raft or '?'}, partition leaders: {leaders})"
            )
        await asyncio.sleep(POLL_S)


async def failover_round(
    site: Site, writer: Writer, rnd: Round, cfg: Config, steady: list[float], whole_wall: float
) -> None:
    """One kill of a ``cfg.victim`` node; ``whole_wall``: when the site was last whole (time.time())."""
    _, writer.partition, _ = await pick_victim(site, cfg.victim)
    warm_from = time.monotonic()
    await asyncio.sleep(cfg.warmup_s)  # the writer writes with all three nodes up
    rnd.victim, rnd.partition, rnd.raft_leader = await pick_victim(site, cfg.victim)  # again: the Raft leader may move
    if rnd.partition != writer.partition:  # the writer must be warm on the partition that fails over
        writer.partition = rnd.partition
        warm_from = time.monotonic()
        await asyncio.sleep(cfg.warmup_s)
    node = site.nodes[rnd.victim]
    progress(
        f"round {rnd.number}: kill -9 node {rnd.victim}, the leader of {FAILOVER_TOPIC}-{rnd.partition} "
        f"(the Raft leader is node {rnd.raft_leader or '?'})"
    )
    failed_before = len(writer.failures)
    loop = asyncio.get_running_loop()
    killed = time.monotonic()
    killed_wall = time.time()
    rnd.quiet_elections = raft_elections(site, whole_wall, killed_wall)
    rnd.killed_at = killed_wall
    steady += [acked - sent for sent, acked in writer.acks if sent >= warm_from and acked < killed]
    watcher = asyncio.create_task(watch_leader(site, rnd.victim, killed, rnd))
    try:
        await loop.run_in_executor(None, node.kill9)  # SIGKILL and reap: nothing it answers can still come
        reaped = time.monotonic()
        first = await writer.first_ack_sent_after(reaped, FAILOVER_TIMEOUT_S)
        await watcher  # bounded by its own deadline
    finally:
        watcher.cancel()
    if first is None:
        rnd.error = f"no record sent after the kill was acknowledged within {FAILOVER_TIMEOUT_S:g}s"
    else:
        rnd.failover_s = first - killed
    if rnd.new_leader:
        for name, at in log_events(site, killed_wall, rnd.new_leader, rnd.partition).items():
            if name != "raft_elected" or rnd.victim == rnd.raft_leader:
                setattr(rnd, f"{name}_s", at - killed_wall)
    await asyncio.sleep(cfg.after_s)  # writes on the two survivors
    progress(f"round {rnd.number}: restarting node {rnd.victim}")
    restarted = time.monotonic()
    rnd.restarted_at = time.time()
    rnd.elections = raft_elections(site, killed_wall, rnd.restarted_at)
    await site.restart(rnd.victim)
    rnd.back_s = time.monotonic() - restarted
    await site.wait_whole(FAILOVER_TOPIC, len(NODES), WHOLE_TIMEOUT_S)  # a roll put the restarted node back in
    rnd.whole_s = time.monotonic() - restarted
    rnd.failed = len(writer.failures) - failed_before
    rnd.rejoin_elections = raft_elections(site, rnd.restarted_at)


@dataclass
class Failover:
    rounds: list[Round]
    steady_s: list[float]  # ack latency of the writes sent with three nodes up, before each kill
    acks: int
    failures: list[str]


async def measure_failover(site: Site, cfg: Config) -> Failover:
    progress(f"creating {FAILOVER_TOPIC} ({len(NODES)} partitions: one led by each node)")
    await site.create_topic(FAILOVER_TOPIC, len(NODES))
    # Every other producer setting at its default, as an application would have it: up to 5 batches in flight,
    # retries that back off from 100 ms to 1 s.
    producer = Producer(
        site.bootstrap,
        acks="all",
        linger_ms=0,
        batch_size=FAILOVER_BATCH_BYTES,
        delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
    )
    await producer.start()
    writer = Writer(producer, cfg.interval_ms / 1000, cfg.failover_record_bytes)
    task = asyncio.create_task(writer.run())
    res = Failover([], [], 0, writer.failures)
    try:
        # metadata and the leaders' streams
        await asyncio.gather(*(producer.send(FAILOVER_TOPIC, writer.value, partition=p) for p in range(len(NODES))))
        whole_wall = time.time()
        for number in range(1, cfg.rounds + 1):
            rnd = Round(number)
            res.rounds.append(rnd)
            try:
                await failover_round(site, writer, rnd, cfg, res.steady_s, whole_wall)
                whole_wall = time.time()
            except (BenchError, NodeStartError) as exc:  # not whole again: a next round would not be one kill
                rnd.error = str(exc)
                break
            if task.done():
                task.result()  # the writer's own error, if any
                raise BenchError("the failover writer stopped")
    finally:
        writer.stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await producer.close(timeout_s=10)
        res.acks = len(writer.acks)
    return res


# -- the run ----------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    record_bytes: list[int]
    partitions: list[int]
    mb: float
    batch_bytes: int
    repeats: int
    rounds: int
    session_timeout_ms: int
    segment_bytes: int
    failover_segment_bytes: int
    failover_record_bytes: int
    interval_ms: float
    warmup_s: float
    after_s: float
    victim: str = "any"  # which node each failover round kills: VICTIMS


@dataclass
class Quiet:
    """Raft elections on a site that loses no node (the throughput runs): each one stalls the metadata."""

    elections: int
    seconds: float


# -- 3. a node joining --------------------------------------------------------------------------------------------


JOIN_TOPIC = "join"
JOIN_PARTITIONS = 2


@dataclass
class Join:
    serving_s: float  # from its start to serving (it registered and heartbeated)
    first_segment_s: float  # from serving to the first segment placed on it (inf: none within the wait)
    segments: int  # segments the metadata places on it at the end
    acks: int


async def measure_join(site: Site, cfg: Config) -> Join:
    """Three of four listed nodes write ``JOIN_TOPIC`` at acks=all; the fourth starts under that load. A segment
    rolls past ``--failover-segment-bytes``, so the time to its first segment is about one roll."""
    await site.create_topic(JOIN_TOPIC, JOIN_PARTITIONS)
    stop = asyncio.Event()
    acks = 0

    async def write() -> None:
        nonlocal acks
        async with Producer(site.bootstrap, acks="all", linger_ms=LINGER_MS, batch_size=16_384) as producer:
            value = b"j" * cfg.failover_record_bytes
            while not stop.is_set():
                await asyncio.gather(*(producer.send(JOIN_TOPIC, value, key=b"%d" % i) for i in range(50)))
                acks += 50

    writer = asyncio.create_task(write())
    try:
        await asyncio.sleep(cfg.warmup_s)
        progress("starting node 4, listed in the topology, under load")
        began = time.monotonic()
        await site.restart(4)
        serving = time.monotonic()
        first = math.inf
        segments = 0
        while time.monotonic() - serving < JOIN_WAIT_S:
            with contextlib.suppress(BenchError):
                status = await site.status([1])
                segments = next((n.segments for n in status.nodes if n.node_id == 4), 0)
                if segments > 0:
                    first = time.monotonic() - serving
                    break
            await asyncio.sleep(POLL_S)
    finally:
        stop.set()
        await asyncio.gather(writer, return_exceptions=True)
    return Join(serving - began, first, segments, acks)


def throughput_table(pairs: list[Pair]) -> Iterator[str]:
    head = (
        f"{'record':>7} {'parts':>5}  {'acks':<7} {'MB/s':>7} {'records/s':>10}  {'runs MB/s':<20} "
        f"{'all/leader':>10}  leaders"
    )
    yield head
    yield "-" * len(head)
    for p in pairs:
        where = ",".join(str(p.leaders[k]) for k in sorted(p.leaders))
        for r in (p.leader, p.all):
            runs = " ".join(f"{x:.1f}" for x in r.runs_mb_s())
            ratio = f"{p.ratio * 100:.0f}%" if r is p.all else ""
            line = (
                f"{size_label(p.record_bytes):>7} {p.partitions:>5}  {r.name[5:]:<7} {r.mb_s:>7.1f} "
                f"{r.records_s:>10,.0f}  {runs:<20} {ratio:>10}  {where if r is p.leader else ''}"
            )
            yield line.rstrip()


def seconds(x: float, width: int) -> str:
    return f"{x:>{width - 1}.2f}s" if math.isfinite(x) else f"{'-':>{width}}"


def failover_table(rounds: list[Round]) -> Iterator[str]:
    head = (
        f"{'round':>5} {'killed':>6} {'part':>4} {'raft leader':>11} {'raft elected':>12} {'new leader':>10} "
        f"{'elected':>8} {'leading':>8} {'open':>7} {'named':>7} {'serving':>8} {'first ack':>9} {'back':>7} "
        f"{'whole':>7} {'elections':>9} {'failed':>6}"
    )
    yield head
    yield "-" * len(head)
    for r in rounds:
        elections = f"{r.elections}/{r.rejoin_elections}/{r.quiet_elections}"
        yield (
            f"{r.number:>5} {r.victim or '-':>6} {r.partition:>4} {r.raft_leader or '?':>11} "
            f"{seconds(r.raft_elected_s, 12)} {r.new_leader or '-':>10} "
            f"{seconds(r.elected_s, 8)} {seconds(r.leading_s, 8)} {seconds(r.open_s, 7)} "
            f"{seconds(r.named_s, 7)} {seconds(r.serving_s, 8)} {seconds(r.failover_s, 9)} "
            f"{seconds(r.back_s, 7)} {seconds(r.whole_s, 7)} {elections:>9} {r.failed:>6}"
            + (f"  {r.error}" if r.error else "")
        )


FAILOVER_TARGET_S = 0.6  # issue 21: the median at a 500 ms session, whether or not the victim leads the Raft group


def summary(
    pairs: list[Pair], fo: Failover | None, cfg: Config, join: Join | None = None, quiet: Quiet | None = None
) -> Iterator[str]:
    for p in pairs:
        verdict = "met" if p.ratio >= 0.6 else "MISSED"
        yield (
            f"acks=all / acks=leader, {size_label(p.record_bytes)} records, {p.partitions} partition(s): "
            f"{p.ratio * 100:.0f}% (target >= 60%: {verdict})"
        )
    if fo is not None:
        done = [r for r in fo.rounds if math.isfinite(r.failover_s)]
        times = [r.failover_s for r in done]
        tick_ms = min(500, cfg.session_timeout_ms // 5)
        setting = f"--session-timeout-ms {cfg.session_timeout_ms} (heartbeat every {tick_ms} ms)"
        if times:
            median = statistics.median(times)
            verdict = "met" if median <= FAILOVER_TARGET_S and len(times) == len(fo.rounds) else "MISSED"
            yield (
                f"leader failover (--victim {cfg.victim}), kill -9 -> first acks=all write acked by the new leader: "
                f"median {median:.2f}s, worst {max(times):.2f}s over {len(times)} of {len(fo.rounds)} rounds, at "
                f"{setting} (target median <= {FAILOVER_TARGET_S:g} s at 500 ms: {verdict})"
            )
            raft_too = [r for r in done if r.victim == r.raft_leader]
            not_raft = [r for r in done if r.raft_leader not in (0, r.victim)]
            for label, group in (("the Raft leader too", raft_too), ("not the Raft leader", not_raft)):
                if group:
                    g = [r.failover_s for r in group]
                    yield (
                        f"  rounds whose victim was {label}: {len(g)}, median {statistics.median(g):.2f}s, "
                        f"worst {max(g):.2f}s"
                    )
        else:
            yield f"leader failover: no round completed, at {setting}"
        if fo.steady_s:
            lat = sorted(fo.steady_s)
            yield (
                f"failover producer with three nodes up: acks=all latency p50 {lat[len(lat) // 2] * 1000:.1f} ms, "
                f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000:.1f} ms ({len(lat):,} writes); "
                f"{fo.acks:,} acks in all, {len(fo.failures)} failed"
                + (f" (first: {fo.failures[0]})" if fo.failures else "")
            )
        due = sum(1 for r in fo.rounds if r.victim == r.raft_leader)
        yield (
            f"Raft elections: {sum(r.elections for r in fo.rounds)} after the kills ({due} due: one per kill of "
            f"the Raft leader), {sum(r.rejoin_elections for r in fo.rounds)} while a restarted node rejoined, "
            f"{sum(r.quiet_elections for r in fo.rounds)} while every node was up (target: none but the due "
            "ones)"
        )
    if quiet is not None:
        yield (
            f"Raft elections during the throughput runs (no kill, {quiet.seconds:.0f}s under load): "
            f"{quiet.elections} (target: 0)"
        )
    if join is not None:
        took = (
            f"{join.first_segment_s:.2f}s" if math.isfinite(join.first_segment_s) else f"none within {JOIN_WAIT_S:g}s"
        )
        yield (
            f"a 4th node started under acks=all load (listed in the topology from the start): serving "
            f"{join.serving_s:.2f}s after its start, its first segment {took} after that (segments roll past "
            f"{cfg.failover_segment_bytes} B); {join.segments} segment(s) on it at the end "
            "(tests/test_cluster_expansion.py checks that none is older than its start)"
        )


def report_json(
    cfg: Config, pairs: list[Pair], fo: Failover | None, join: Join | None = None, quiet: Quiet | None = None
) -> dict[str, Any]:
    rounds = [
        {k: finite(v) if isinstance(v, float) else v for k, v in asdict(r).items()} for r in (fo.rounds if fo else [])
    ]
    return {
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "config": asdict(cfg),
        "nodes": len(NODES),
        "replication_factor": REPLICATION_FACTOR,
        "min_insync_replicas": MIN_INSYNC_REPLICAS,
        "throughput": [
            {
                "record_bytes": p.record_bytes,
                "partitions": p.partitions,
                "all_over_leader": p.ratio,
                "leaders": p.leaders,
                "acks_leader": p.leader.as_json(),
                "acks_all": p.all.as_json(),
            }
            for p in pairs
        ],
        "failover": {
            "rounds": rounds,
            "failover_s_median": statistics.median(t)
            if (t := [r["failover_s"] for r in rounds if r["failover_s"] is not None])
            else None,
            "failover_s_worst": max(t) if t else None,
            "steady_ack_latency_s": sorted(fo.steady_s) if fo else [],
            "acks": fo.acks if fo else 0,
            "failures": fo.failures if fo else [],
        },
        "join": None if join is None else {**asdict(join), "first_segment_s": finite(join.first_segment_s)},
        "throughput_raft_elections": None if quiet is None else asdict(quiet),
    }


def parse_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{flag} takes positive integers: {text!r}")
    return values


def _throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: 1 KiB records, 1 partition, {QUICK_MB:g} MB, one run each, one failover round",
    )
    parser.add_argument(
        "--record-bytes",
        type=lambda t: parse_list(t, "--record-bytes"),
        help=f"record value sizes, comma-separated (default {DEFAULT_RECORD_BYTES})",
    )
    parser.add_argument(
        "--partitions",
        type=lambda t: parse_list(t, "--partitions"),
        help=f"partition counts, comma-separated, a topic each (default {DEFAULT_PARTITIONS})",
    )
    parser.add_argument(
        "--mb",
        type=float,
        help=f"MB of record values per throughput run (default {DEFAULT_MB:g}, --quick "
        f"{QUICK_MB:g}; 0 skips throughput)",
    )
    parser.add_argument(
        "--batch-bytes",
        type=int,
        default=DEFAULT_BATCH_BYTES,
        help=f"the producer's batch_size (default {DEFAULT_BATCH_BYTES}); linger_ms is {LINGER_MS}",
    )
    parser.add_argument("--repeats", type=int, help="throughput runs per ack level, best kept (default 3, --quick 1)")
    parser.add_argument(
        "--segment-bytes-max",
        type=int,
        default=DEFAULT_SEGMENT_BYTES,
        help=f"the throughput site's --segment-bytes-max (default {DEFAULT_SEGMENT_BYTES})",
    )


def _failover_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=int, help=f"failover rounds (default {DEFAULT_ROUNDS}, --quick 1; 0 skips failover)"
    )
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=DEFAULT_SESSION_TIMEOUT_MS,
        help="every node's --session-timeout-ms: how long a silent node has until it counts as dead "
        f"(default {DEFAULT_SESSION_TIMEOUT_MS})",
    )
    parser.add_argument(
        "--failover-segment-bytes",
        type=int,
        default=DEFAULT_FAILOVER_SEGMENT_BYTES,
        help="the failover site's --segment-bytes-max: small, so that a roll puts a restarted node "
        f"back in the ensemble (default {DEFAULT_FAILOVER_SEGMENT_BYTES})",
    )
    parser.add_argument(
        "--victim",
        choices=VICTIMS,
        default="any",
        help="failover: which node each round kills: 'partition-leader', a partition's leader that "
        "does not lead the site's Raft group; 'raft-leader', the Raft leader, which leads a "
        "partition too; 'any', partition 0's leader, whichever it is (default)",
    )
    parser.add_argument(
        "--failover-record-bytes",
        type=int,
        default=DEFAULT_FAILOVER_RECORD_BYTES,
        help=f"failover producer: record value bytes (default {DEFAULT_FAILOVER_RECORD_BYTES})",
    )
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=5.0,
        help="failover producer: one record sent every this many ms (default 5)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        help="failover: seconds of writes on a whole site before each kill (default 2, --quick 0.5)",
    )
    parser.add_argument(
        "--after",
        type=float,
        help="failover: seconds of writes on the two survivors before the restart (default 1, --quick 0.2)",
    )
    parser.add_argument(
        "--join",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the part where a 4th node starts under load (default; --no-join skips it)",
    )
    parser.add_argument("--report", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs) on exit")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _throughput_arguments(parser)
    _failover_arguments(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    args.record_bytes = args.record_bytes or parse_list("1024" if quick else DEFAULT_RECORD_BYTES, "--record-bytes")
    args.partitions = args.partitions or parse_list("1" if quick else DEFAULT_PARTITIONS, "--partitions")
    args.mb = args.mb if args.mb is not None else (QUICK_MB if quick else DEFAULT_MB)
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    args.rounds = args.rounds if args.rounds is not None else (1 if quick else DEFAULT_ROUNDS)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if quick else 2.0)
    args.after = args.after if args.after is not None else (0.2 if quick else 1.0)
    if args.mb < 0 or args.rounds < 0 or args.warmup < 0 or args.after < 0:
        parser.error("--mb, --rounds, --warmup and --after must be 0 or more")
    if args.repeats < 1 or args.interval_ms <= 0 or args.batch_bytes < 1 or args.failover_record_bytes < 1:
        parser.error("--repeats, --interval-ms, --batch-bytes and --failover-record-bytes must be positive")
    if args.session_timeout_ms < 200:
        parser.error("--session-timeout-ms must be at least 200 (the node's own lower bound)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the exit stack stops every node and removes the directory.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.WARNING, format="  !! %(name)s: %(message)s")
    cfg = Config(
        args.record_bytes,
        args.partitions,
        args.mb,
        args.batch_bytes,
        args.repeats,
        args.rounds,
        args.session_timeout_ms,
        args.segment_bytes_max,
        args.failover_segment_bytes,
        args.failover_record_bytes,
        args.interval_ms,
        args.warmup,
        args.after,
        args.victim,
    )
    _print_header(cfg)
    started = time.monotonic()
    pairs, fo, join, quiet = _run_phases(cfg, keep=args.keep, with_join=args.join)
    _print_results(cfg, pairs, fo)
    print()
    for line in summary(pairs, fo, cfg, join, quiet):
        print(line)
    print(f"(total {time.monotonic() - started:.0f}s)")
    if args.report:
        args.report.write_text(json.dumps(report_json(cfg, pairs, fo, join, quiet), indent=2) + "\n")
        print(f"results written to {args.report}")
    return 0


def _print_header(cfg: Config) -> None:
    cores = os.cpu_count() or 1
    print(
        f"georep site cluster benchmark: {cores} cores ({platform.machine()}), Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}"
    )
    print("This machine is shared and noisy: absolute MB/s vary run to run; only the ratios are meaningful.")
    print(
        f"Site {SITE}: {len(NODES)} georep node processes on 127.0.0.1, replication factor {REPLICATION_FACTOR}, "
        f"min-insync {MIN_INSYNC_REPLICAS}, --session-timeout-ms {cfg.session_timeout_ms}; topics fsync every "
        "batch (flush_interval_ms=0)."
    )
    if cores < 4:
        print(f"Note: with {cores} cores the three nodes, the producer and the kernel compete for CPU.")


def _run_phases(
    cfg: Config, *, keep: bool, with_join: bool
) -> tuple[list[Pair], Failover | None, Join | None, Quiet | None]:
    """The throughput site, then the failover site, then the join site, each stopped before the next starts."""
    pairs: list[Pair] = []
    fo: Failover | None = None
    join: Join | None = None
    quiet: Quiet | None = None
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="georep-bench-site-cluster-"))
        if keep:
            print(f"keeping {root} (node logs: {root}/*/{SITE}/*/node.log)")
        else:
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        if cfg.mb > 0:
            with contextlib.ExitStack() as phase:  # its nodes stop before the failover site starts
                site = start_site(phase, root / "throughput", cfg, cfg.segment_bytes)
                since, since_wall = time.monotonic(), time.time()
                pairs = asyncio.run(measure_throughput(site, cfg))
                quiet = Quiet(raft_elections(site, since_wall), time.monotonic() - since)
        if cfg.rounds > 0:
            with contextlib.ExitStack() as phase:
                site = start_site(phase, root / "failover", cfg, cfg.failover_segment_bytes)
                fo = asyncio.run(measure_failover(site, cfg))
        if with_join:
            site = Site(root / "join", node_args(cfg, cfg.failover_segment_bytes), listed=(1, 2, 3, 4), started=NODES)
            stack.callback(site.close)
            progress(f"starting nodes 1, 2, 3 of site {SITE} (4 listed) in join/")
            site.start()
            join = asyncio.run(measure_join(site, cfg))
    return pairs, fo, join, quiet


def _print_results(cfg: Config, pairs: list[Pair], fo: Failover | None) -> None:
    if pairs:
        print()
        print(
            f"Throughput: georep.client.Producer(batch_size={cfg.batch_bytes}, linger_ms={LINGER_MS}, "
            f"max_in_flight={MAX_IN_FLIGHT}), {cfg.mb:g} MB of record values per run, best of {cfg.repeats}, the "
            f"two ack levels alternating; --segment-bytes-max {cfg.segment_bytes}. MB/s of record values; "
            "leaders: each partition's leader node"
        )
        for line in throughput_table(pairs):
            print(line)
    if fo is not None:
        print()
        print(
            f"Failover: one {cfg.failover_record_bytes} B record to {FAILOVER_TOPIC}-0 every {cfg.interval_ms:g} ms "
            f"at acks=all; per round {cfg.warmup_s:g}s of writes, kill -9 of the partition's leader "
            f"(--victim {cfg.victim}), {cfg.after_s:g}s, restart; --segment-bytes-max {cfg.failover_segment_bytes}. "
            "raft elected, elected, leading, open, named, serving and first ack count from the kill; back (the "
            "node serves) and whole (the open segment is on all three nodes again) from the restart; elections: "
            "the nodes that ran for Raft leader from the kill to the restart / from the restart until whole / "
            "between rounds, with every node up"
        )
        for line in failover_table(fo.rounds):
            print(line)


if __name__ == "__main__":
    sys.exit(main())
