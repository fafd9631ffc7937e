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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from georep.cli.admin_token import TOKEN_ENV, find_token
from georep.cli.link import set_link
from georep.cli.topology_file import TopologyFileError, load_topology
from georep.cli.up import DEFAULT_DATA_DIR
from georep.client.consumer import Consumer, ConsumerRecord
from georep.client.errors import GeorepError
from georep.client.producer import Producer, parse_acks
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_from_proto
from georep.server.process import NODE_INFO
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId
from topology.model import Topology, UnknownSite

EXIT_BROKEN = 1
EXIT_USAGE = 2
RPC_TIMEOUT_S = 5.0
CONVERGE_TIMEOUT_S = 60.0


class DrillError(Exception):
    """The drill cannot run (usage, unreachable sites); exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: the embedded a, b, c)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="where 'georep up' keeps DATA_DIR/<site>/node.json and admin.token "
                             "(default .georep)")  # fmt: skip
    parser.add_argument("--report", type=Path, help="write the report as JSON to this file")
    parser.add_argument("--site", help="the site to fail (default: the topology's first site)")
    parser.add_argument("--failover-to", help="where the consumers go (default: the next site)")
    parser.add_argument("--mode", choices=("kill", "isolate"), default="kill",
                        help="kill: SIGKILL the site's node (local); isolate: cut all its links (any deployment)")
    parser.add_argument("--acks", default="leader,geo:2", help="ack levels, one producer per site each")
    parser.add_argument("--rate", type=float, default=200.0, help="records/s per producer (default 200)")
    parser.add_argument("--consumers", type=int, default=2, help="consumers in the group (default 2)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the drill topic (default 4)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the event (default 3)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of producing after it (default 3)")
    parser.add_argument("--commit-interval-ms", type=int, default=200, help="consumer commit interval")
    parser.add_argument("--commit-acks", default="geo:2", help="ack level of the commits (default geo:2)")
    parser.add_argument("--no-restart", action="store_true", help="leave the site down (or isolated)")
    parser.add_argument("--admin-token", help=f"admin token for isolate (default ${TOKEN_ENV}, DATA_DIR/admin.token)")


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


def _now() -> float:
    return time.time()


# --- sites -------------------------------------------------------------------------


@dataclass
class Site:
    name: str
    address: str

    async def stub_call(self, method: str, request: Any) -> Any:
        async with grpc.aio.insecure_channel(self.address) as channel:
            return await getattr(pbg.NodeStub(channel), method)(request, timeout=RPC_TIMEOUT_S)


async def vectors(site: Site, topic: str) -> dict[int, VectorOffset]:
    desc = await site.stub_call("DescribeTopic", pb.DescribeTopicRequest(name=topic))
    return {ps.partition: vector_from_proto(ps.vector) for ps in desc.partition_states}


async def wait_for(what: str, cond: Callable[[], Any], timeout_s: float,
                   state: Callable[[], str] | None = None) -> None:  # fmt: skip
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
    producer = Producer(site.address, acks=level, linger_ms=5, request_timeout_ms=10_000, delivery_timeout_ms=20_000)
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


async def consume_loop(run: Run, consumer: Consumer, name: str, commit_interval_s: float, stop: asyncio.Event) -> None:
    next_commit = time.monotonic() + commit_interval_s
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
        if time.monotonic() >= next_commit:
            next_commit = time.monotonic() + commit_interval_s
            await commit(run, consumer)


def _delivery(name: str, origin: str, r: ConsumerRecord, at: float) -> Delivery:
    value = (r.value or b"").decode(errors="replace")
    return Delivery(name, origin, r.partition, str(r.origin), r.origin_seq, value, at)


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


async def set_links(topology: Topology, victim: str, sites: Mapping[SiteId, Site], enabled: bool,
                    token: str | None) -> None:  # fmt: skip
    for link in topology.links_sorted():
        if victim not in (link.src, link.dst):
            continue
        try:
            await set_link(sites[link.dst].address, link.src, enabled, token)
        except grpc.aio.AioRpcError as exc:
            where = f"SetLink {link.src} -> {link.dst} at {sites[link.dst].address}"
            raise DrillError(f"{where}: {exc.details()}") from None


def restart_node(info: dict[str, Any], data_dir: Path, site: str) -> None:
    command = info.get("command")
    if not command:
        raise DrillError(f"{data_dir / site / NODE_INFO} has no 'command': restart site {site} by hand")
    with open(data_dir / site / "node.log", "ab") as log:
        # A session of its own: the restarted node outlives the drill, like the one it replaces.
        subprocess.Popen(command, cwd=info.get("cwd"), stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


# --- the drill ------------------------------------------------------------------------


async def drill(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    try:
        topology = load_topology(args.topology)
    except TopologyFileError as exc:
        raise DrillError(str(exc)) from None
    names = list(topology.site_ids())
    if len(names) < 2:
        raise DrillError("a drill needs a topology of at least 2 sites")
    victim = args.site or names[0]
    target = args.failover_to or next(n for n in names if n != victim)
    try:
        topology.site(victim)
        topology.site(target)
    except UnknownSite as exc:
        raise DrillError(str(exc)) from None
    if victim == target:
        raise DrillError("--failover-to must be another site than --site")
    levels = [a.strip() for a in args.acks.split(",") if a.strip()]
    for level in (*levels, args.commit_acks):
        try:
            parse_acks(level)
        except GeorepError as exc:
            raise DrillError(exc.message) from None
    if args.rate <= 0 or args.consumers < 1 or args.partitions < 1:
        raise DrillError("--rate, --consumers and --partitions must be positive")
    sites = {n: Site(n, topology.site(n).nodes[0]) for n in names}
    for s in sites.values():
        try:
            await s.stub_call("Health", pb.HealthRequest())
        except grpc.aio.AioRpcError as exc:
            raise DrillError(f"site {s.name} at {s.address} does not answer ({exc.code().name}): start the "
                             "topology first ('georep up')") from None  # fmt: skip
    info = node_info(args.data_dir, victim) if args.mode == "kill" else {}
    token = find_token(args.admin_token, args.data_dir)

    stamp = int(time.time() * 1000)
    run = Run(topic=f"drill-{stamp}", group=f"drill-{stamp}")
    out(f"drill: {args.mode} site {victim}, consumers fail over to {target}; topic {run.topic}, ack levels "
        f"{', '.join(levels)}, {args.rate:g} records/s per producer, commits {args.commit_acks}")  # fmt: skip
    await sites[victim].stub_call("CreateTopic", pb.CreateTopicRequest(name=run.topic, partitions=args.partitions))

    async def everywhere() -> bool:
        for s in sites.values():
            await vectors(s, run.topic)
        return True

    await wait_for(f"topic {run.topic} exists at every site (do the link filters carry 'drill-*'?)", everywhere, 15)

    stop_producers = asyncio.Event()
    producer_tasks = {
        (s, level): asyncio.create_task(produce_loop(run, sites[s], level, args.rate, stop_producers))
        for s in names for level in levels
    }  # fmt: skip
    stop_consumers = asyncio.Event()
    consumers: list[Consumer] = []
    consumer_tasks: list[asyncio.Task[None]] = []

    async def start_consumers(bootstrap: str, tag: str) -> None:
        for i in range(args.consumers):
            c = Consumer(bootstrap, group_id=run.group, auto_offset_reset="earliest", enable_auto_commit=False,
                         commit_acks=args.commit_acks, client_id=f"drill-{i}", session_timeout_ms=6000)  # fmt: skip
            await c.start()
            c.subscribe([run.topic])
            consumers.append(c)
            consumer_tasks.append(asyncio.create_task(
                consume_loop(run, c, f"{tag}{i}", args.commit_interval_ms / 1000, stop_consumers)))  # fmt: skip

    await start_consumers(f"{sites[victim].address},{sites[target].address}", "c")
    await asyncio.sleep(args.warmup)

    # -- the event
    out(f"drill: {args.mode} {victim} after {args.warmup:g}s warm-up "
        f"({len(run.acked)} records acked, {len(run.deliveries)} delivered, {run.commit_count} commits)")
    for level in levels:  # producers at the victim stop with it
        producer_tasks[(victim, level)].cancel()
    if args.mode == "kill":
        run.event_at = _now()
        os.kill(int(info["pid"]), signal.SIGKILL)
    else:
        run.event_at = _now()
        await set_links(topology, victim, sites, False, token)
        # The application at the victim is abandoned, as if it crashed; a new one starts at the target.
        stop_consumers.set()
        for t in consumer_tasks:
            t.cancel()
        for c in consumers:
            c._closed = True
            with contextlib.suppress(Exception):
                await c._connection.close()
        consumers.clear()
        consumer_tasks.clear()
        stop_consumers = asyncio.Event()
        await start_consumers(sites[target].address, "r")
    event = run.event_at
    target_origin = (await sites[target].stub_call("Health", pb.HealthRequest()))
    target_origin = f"{target_origin.site}@{target_origin.epoch}"

    async def first_at_target() -> bool:
        for t in consumer_tasks:  # a consumer that died would leave the wait to time out with no reason
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise DrillError(f"a consumer failed while failing over to {target}: {t.exception()!r}")
        return any(d.site_origin == target_origin and d.at >= event for d in run.deliveries)

    restored = False

    async def restore() -> None:
        nonlocal restored
        if not restored and not args.no_restart:
            restored = True
            if args.mode == "kill":
                restart_node(info, args.data_dir, victim)
            else:
                await set_links(topology, victim, sites, True, token)

    try:
        await wait_for(f"a consumer reads at {target}", first_at_target, 60,
                       lambda: "; ".join(c.describe() for c in consumers))  # fmt: skip
    except BaseException:
        # The drill cannot finish: still give the operator the site back.
        with contextlib.suppress(Exception):
            await restore()
        raise
    rto_ms = (min(d.at for d in run.deliveries if d.site_origin == target_origin and d.at >= event) - event) * 1000
    out(f"drill: first record consumed at {target} {rto_ms:.0f} ms after the {args.mode}")
    await asyncio.sleep(args.after)
    stop_producers.set()
    await asyncio.gather(*(t for t in producer_tasks.values() if not t.done()), return_exceptions=True)

    # -- what the survivors hold
    survivors = [n for n in names if n != victim]

    async def survivors_converged() -> bool:
        held = [await vectors(sites[s], run.topic) for s in survivors]
        return all(h == held[0] for h in held)

    with contextlib.suppress(DrillError):
        await wait_for("the surviving sites converge", survivors_converged, CONVERGE_TIMEOUT_S)
    held_by_survivors = await merged_vectors([sites[s] for s in survivors], run.topic)
    lost = [a for a in run.acked.values() if not covers(held_by_survivors, a)]

    # -- rejoin
    lost_after: list[Acked] = []
    rejoined = False
    if not args.no_restart:
        await restore()

        async def all_converged() -> bool:
            held = [await vectors(sites[s], run.topic) for s in names]
            return all(h == held[0] for h in held)

        await wait_for(f"site {victim} rejoins and every site converges", all_converged, CONVERGE_TIMEOUT_S)
        rejoined = True
        held_all = await vectors(sites[target], run.topic)
        lost_after = [a for a in run.acked.values() if not covers(held_all, a)]

    # -- drain the consumers, then account for every record
    final = await vectors(sites[target], run.topic)
    total = sum(sum(seq for _, seq in v.items()) for v in final.values())

    async def drained() -> bool:
        return len({(d.partition, d.origin, d.origin_seq) for d in run.deliveries}) >= total

    with contextlib.suppress(DrillError):
        await wait_for("the consumers read every record", drained, 30)
    stop_consumers.set()
    await asyncio.gather(*consumer_tasks, return_exceptions=True)
    for c in consumers:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await c.close()
    return report(run, args, victim, target, target_origin, levels, lost, lost_after, rejoined, rto_ms, final)


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
    run: Run, args: argparse.Namespace, victim: str, target: str, target_origin: str, levels: list[str],
    lost: list[Acked], lost_after: list[Acked], rejoined: bool, rto_ms: float, final: dict[int, VectorOffset],
) -> dict[str, Any]:  # fmt: skip
    event = run.event_at
    seen: dict[tuple[int, str, int], int] = {}
    for d in run.deliveries:
        key = (d.partition, d.origin, d.origin_seq)
        seen[key] = seen.get(key, 0) + 1
    dup_vs_commit = [
        d for d in run.deliveries
        if d.at >= event and d.partition in run.commits
        and run.commits[d.partition][1].covers(Origin.parse(d.origin), d.origin_seq)
    ]  # fmt: skip
    in_topic = {
        (p, str(o), s) for p, v in final.items() for o, n in v.items() for s in range(n)
    }  # fmt: skip
    never = sorted(in_topic - set(seen))
    per_level: dict[str, Any] = {}
    for level in levels:
        acked = [a for a in run.acked.values() if a.level == level]
        lost_l = [a for a in lost if a.level == level]
        per_level[level] = {
            "sent": sum(n for k, n in run.sent.items() if k.endswith(f"|{level}")),
            "acked": len(acked),
            "failed": sum(n for k, n in run.errors.items() if k.endswith(f"|{level}")),
            "acked_at_victim": sum(1 for a in acked if a.site == victim),
            "rpo_lost": len(lost_l),
            "rpo_window_ms": round((event - min(a.acked_at for a in lost_l)) * 1000) if lost_l else 0,
            "lost_after_rejoin": sum(1 for a in lost_after if a.level == level),
        }
    broken = []
    for level, figures in per_level.items():
        n = parse_acks(level)[1]
        if n >= 2 and figures["rpo_lost"]:
            broken.append(f"{figures['rpo_lost']} records acked with acks={level} are at no surviving site")
        if figures["lost_after_rejoin"]:
            broken.append(f"{figures['lost_after_rejoin']} records acked with acks={level} are lost for good")
    if dup_vs_commit:
        broken.append(f"{len(dup_vs_commit)} records delivered again after the failover were covered by a commit")
    if never:
        broken.append(f"{len(never)} records in the topic were never delivered")
    doc = {
        "mode": args.mode, "victim": victim, "failover_to": target, "failover_origin": target_origin,
        "topic": run.topic, "group": run.group, "rejoined": rejoined,
        "records_in_topic": len(in_topic), "records_sent": sum(run.sent.values()),
        "records_acked": len(run.acked),
        "delivered": len(run.deliveries), "delivered_unique": len(seen),
        "duplicates_total": sum(n - 1 for n in seen.values()),
        "duplicates_vs_commit": len(dup_vs_commit), "never_delivered": len(never),
        "never_delivered_first": [list(k) for k in never[:5]],
        "duplicates_vs_commit_first": [
            [d.consumer, d.partition, d.origin, d.origin_seq, d.site_origin, round((d.at - event) * 1000)]
            for d in dup_vs_commit[:5]
        ],
        "rto_ms": round(rto_ms), "commits": run.commit_count, "commit_errors": run.commit_errors,
        "commit_acks": args.commit_acks, "acks": per_level, "promises_broken": broken, "ok": not broken,
        "partitions_final": {str(p): v.to_text() for p, v in sorted(final.items())},
    }  # fmt: skip
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"DR drill: {doc['mode']} site {doc['victim']}, consumers failed over to {doc['failover_to']}"
        f"{' (site rejoined)' if doc['rejoined'] else ''}",
        f"  topic {doc['topic']}: {doc['records_in_topic']} records; {doc['records_acked']} of "
        f"{doc['records_sent']} sent were acked",
        f"  {'ACKS':<10} {'SENT':>7} {'ACKED':>7} {'FAILED':>7} {'RPO LOST':>9} {'WINDOW':>9} "
        f"{'LOST AFTER REJOIN':>18}",
    ]
    for level, f in doc["acks"].items():
        lines.append(f"  {level:<10} {f['sent']:>7} {f['acked']:>7} {f['failed']:>7} {f['rpo_lost']:>9} "
                     f"{str(f['rpo_window_ms']) + ' ms':>9} {f['lost_after_rejoin']:>18}")  # fmt: skip
    lines += [
        f"  RTO (event to first record consumed at {doc['failover_to']}): {doc['rto_ms']} ms",
        f"  delivered {doc['delivered']} ({doc['delivered_unique']} distinct); duplicates relative to the last "
        f"commit: {doc['duplicates_vs_commit']}; redelivered in all: {doc['duplicates_total']}; "
        f"never delivered: {doc['never_delivered']}",
        f"  commits: {doc['commits']} at acks={doc['commit_acks']} ({doc['commit_errors']} failed)",
    ]
    if doc["promises_broken"]:
        lines.append("  PROMISES BROKEN:")
        lines += [f"    - {b}" for b in doc["promises_broken"]]
    else:
        lines.append("  every promise kept")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        doc = asyncio.run(drill(args))
    except DrillError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    print(render(doc))
    if args.report is not None:
        args.report.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"report written to {args.report}")
    return 0 if doc["ok"] else EXIT_BROKEN



