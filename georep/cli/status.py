"""``georep status``: each site's topics, links and lag, and whether the sites converged, from ``SiteStatus``.

The default is a summary per topic and per link, however many partitions there are; partitions show with
``--partitions`` (and ``--topic``). Convergence compares each topic's vector digest across the sites and asks for
the partition rows only of the topics whose digests differ, to name the partitions that differ."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from georep.cli.topology import LinkStatus
from georep.cli.topology_arg import load_topology
from georep.cli.up import DEFAULT_DATA_DIR
from georep.client.admin import damaged_text
from georep.client.connection import tls_problem
from georep.client.tls_args import TlsArgsError, client_tls, default_client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from georep.server.process import NODE_INFO
from topology.file import TopologyFileError
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology

TIMEOUT_S = 3.0


PAGE_SIZE = 1_000  # partition rows per SiteStatus answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    parser.add_argument(
        "--partitions",
        action="store_true",
        help="one row per partition (vector, lags, damage) besides the summary per topic and link",
    )
    parser.add_argument("--topic", default="", help="only this topic")
    add_client_tls_arguments(parser, data_dir=True)


def vector_text(vector: pb.VectorOffset) -> str:
    return ",".join(f"{e.site}@{e.epoch}:{e.next_seq}" for e in vector.entries) or "-"


async def _ask(stub: pbg.NodeAsyncStub, partitions: bool, topic: str) -> pb.SiteStatusResponse:
    """One site's status; with ``partitions``, every row of ``topic`` (or of every topic), page after page."""
    req = pb.SiteStatusRequest(partitions=partitions, topic=topic, page_size=PAGE_SIZE if partitions else 0)
    answer: pb.SiteStatusResponse = await stub.SiteStatus(req, timeout=TIMEOUT_S)
    while answer.more_partitions and answer.partitions:
        last = answer.partitions[-1]
        req.after_topic, req.after_partition = last.topic, last.partition
        page = await stub.SiteStatus(req, timeout=TIMEOUT_S)
        answer.partitions.extend(page.partitions)
        answer.more_partitions = page.more_partitions
    return answer


async def fetch_status(
    topology: Topology, tls: TlsConfig | None = None, partitions: bool = False, topic: str = ""
) -> dict[str, pb.SiteStatusResponse | str]:
    """Each site's status, or the reason it could not be had: a summary per topic and link, and the partition
    rows too with ``partitions``."""

    async def one(address: str) -> pb.SiteStatusResponse | str:
        async with client_channel(address, tls) as channel:
            try:
                return await _ask(pbg.NodeStub(channel), partitions, topic)
            except grpc.aio.AioRpcError as exc:
                problem = await tls_problem(address, tls) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
                return problem or f"unreachable at {address}: {exc.code().name} {exc.details()}"

    sites = topology.site_ids()
    answers = await asyncio.gather(*(one(topology.site(s).nodes[0]) for s in sites))
    return dict(zip(sites, answers, strict=True))


def as_json(statuses: dict[str, pb.SiteStatusResponse | str]) -> dict[str, Any]:
    return {
        site: ({"error": s} if isinstance(s, str) else MessageToDict(s, preserving_proto_field_name=True))
        for site, s in statuses.items()
    }


def differing_topics(statuses: dict[str, pb.SiteStatusResponse | str]) -> list[str]:
    """The users' topics whose partitions' vectors differ between the sites that hold them, or that hold a
    quarantined batch somewhere: only these need a look at their partitions."""
    seen: dict[str, set[bytes]] = {}
    damaged: set[str] = set()
    for s in statuses.values():
        if isinstance(s, str):
            continue
        for t in s.topics:
            if is_internal(t.topic):
                continue
            seen.setdefault(t.topic, set()).add(t.vector_digest)
            if t.damaged_batches:
                damaged.add(t.topic)
    return sorted(t for t, digests in seen.items() if len(digests) > 1 or t in damaged)


def convergence(statuses: dict[str, pb.SiteStatusResponse | str]) -> list[tuple[str, int, bool]]:
    """(topic, partition, whether every reachable site holds the same records) for the partition rows given.

    Each site's vector is read from its stored batches; a quarantined batch is counted in it (its slot waits for
    the repair) but is not held, so a partition with one anywhere has not converged.
    """
    vectors: dict[tuple[str, int], set[str]] = {}
    for s in statuses.values():
        if isinstance(s, str):
            continue
        for p in s.partitions:
            if is_internal(p.topic):
                continue
            held = vector_text(p.vector) if not p.damaged else f"{s.site} has {len(p.damaged)} damaged"
            vectors.setdefault((p.topic, p.partition), set()).add(held)
    return [(t, p, len(v) == 1) for (t, p), v in sorted(vectors.items())]


def converged_counts(
    statuses: dict[str, pb.SiteStatusResponse | str], rows: dict[str, dict[str, pb.SiteStatusResponse | str]]
) -> tuple[int, int, list[tuple[str, int]]]:
    """(converged partitions, partitions, the differing ones): a topic whose digests agree everywhere converged
    whole; ``rows`` holds each differing topic's partition rows from every site."""
    partitions: dict[str, int] = {}
    for s in statuses.values():
        if not isinstance(s, str):
            for t in s.topics:
                if not is_internal(t.topic):
                    partitions[t.topic] = max(partitions.get(t.topic, 0), t.partitions)
    total = sum(partitions.values())
    differs = [(t, p) for topic in sorted(rows) for t, p, ok in convergence(rows[topic]) if t == topic and not ok]
    return total - len(differs), total, differs


async def fetch_differing(
    topology: Topology, tls: TlsConfig | None, statuses: dict[str, pb.SiteStatusResponse | str]
) -> dict[str, dict[str, pb.SiteStatusResponse | str]]:
    return {t: await fetch_status(topology, tls, partitions=True, topic=t) for t in differing_topics(statuses)}


def kafka_addresses(data_dir: Path, sites: list[str]) -> dict[str, str]:
    """The Kafka listener of each site's node that runs on this machine under ``data_dir`` (its node.json), as
    'georep up' starts them; a node elsewhere is not listed."""
    out: dict[str, str] = {}
    for site in sites:
        for info in sorted((data_dir / site).glob(f"**/{NODE_INFO}")):
            with contextlib.suppress(OSError, ValueError):
                address = json.loads(info.read_text()).get("kafka", "")
                if address:
                    out[site] = ", ".join(filter(None, [out.get(site, ""), address]))
    return out


def render(
    statuses: dict[str, pb.SiteStatusResponse | str],
    kafka: dict[str, str] | None = None,
    differing: dict[str, dict[str, pb.SiteStatusResponse | str]] | None = None,
) -> str:
    lines: list[str] = []
    for site, s in statuses.items():
        if isinstance(s, str):
            lines.append(f"site {site}: {s}")
            continue
        kafka_at = f", Kafka clients at {kafka[site]}" if kafka and kafka.get(site) else ""
        lines.append(f"site {site} (origin {site}@{s.epoch}){kafka_at}")
        lines += _topic_lines(s)
        lines += _partition_lines(s)
        for link in s.links:
            err = f"  ({link.last_error})" if link.last_error else ""
            lines.append(
                f"  link {link.src} -> {link.dst}: {link.state}, applied {link.applied_batches} batches "
                f"({link.applied_bytes} bytes), skipped {link.skipped_batches}, lag {link.lag_records} records "
                f"in {link.partitions_behind} partitions, {link.lag_ms} ms{err}"
            )
            lines += [f"    asks for {i}" for i in link.interests]  # a link in mode "interest": and for whom
        for c in s.conflicts:
            lines.append(f"  CONFLICT {c.topic}: {c.message}")
        for c in s.config_conflicts:
            lines.append(f"  CONFIG CONFLICT {c.topic}: {c.message}")
    unreachable = [site for site, s in statuses.items() if isinstance(s, str)]
    same, total, differs = converged_counts(statuses, differing or {})
    if unreachable:
        lines.append(f"convergence unknown: site(s) {', '.join(unreachable)} did not answer")
    elif total:
        lines.append(f"converged partitions: {same}/{total}")
        lines += [f"  differs: {t}/{p}" for t, p in differs]
    return "\n".join(lines)


def _topic_lines(s: pb.SiteStatusResponse) -> list[str]:
    lines = []
    for t in s.topics:
        if is_internal(t.topic):
            continue
        damaged = (
            f", DAMAGED {t.damaged_batches} batches in {t.partitions_damaged} partitions" if t.damaged_batches else ""
        )
        lines.append(
            f"  topic {t.topic}: {t.partitions} partitions, end {t.log_end_offset}, lag {t.lag_records} records "
            f"(~{t.lag_bytes} bytes) in {t.partitions_behind} partitions, {t.lag_ms} ms{damaged}"
        )
    return lines


def _partition_lines(s: pb.SiteStatusResponse) -> list[str]:
    lines = []
    for p in s.partitions:
        if is_internal(p.topic):
            continue
        lines.append(f"    {p.topic}/{p.partition}  end={p.log_end_offset}  vector={vector_text(p.vector)}")
        for d in p.damaged:
            lines.append(f"      DAMAGED {damaged_text(d)}; quarantined until a peer's copy repairs it")
        for lag in p.lags:
            lines.append(
                f"      {lag.origin:<24} from {lag.upstream or '-':<8} lag {lag.lag_records} records"
                f", ~{lag.lag_bytes} bytes, {lag.lag_ms} ms"
            )
    return lines


def live_link_states(topology: Topology) -> dict[tuple[SiteId, SiteId], LinkStatus]:
    """Each link's state and lag as its destination reports them; links into unreachable sites are left out.
    Over TLS with the default certificates (``$GEOREP_TLS_DIR``, else those of 'georep up' in .georep/certs)."""
    out: dict[tuple[SiteId, SiteId], LinkStatus] = {}
    for site, s in asyncio.run(fetch_status(topology, default_client_tls())).items():
        if isinstance(s, str):
            continue
        for link in s.links:
            out[(SiteId(link.src), SiteId(site))] = LinkStatus(
                state=link.state, lag_records=link.lag_records, lag_ms=link.lag_ms
            )
    return out


async def _gather(
    topology: Topology, tls: TlsConfig | None, args: argparse.Namespace
) -> tuple[dict[str, pb.SiteStatusResponse | str], dict[str, dict[str, pb.SiteStatusResponse | str]]]:
    statuses = await fetch_status(topology, tls, partitions=args.partitions, topic=args.topic)
    if args.partitions:  # every row is at hand already
        return statuses, {t: statuses for t in differing_topics(statuses)}
    return statuses, await fetch_differing(topology, tls, statuses)


def main(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.topology)
    except TopologyFileError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    try:
        tls = client_tls(args)
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    statuses, differing = asyncio.run(_gather(topology, tls, args))
    if args.json:
        doc = as_json(statuses)
        same, total, differs = converged_counts(statuses, differing)
        if not any(isinstance(s, str) for s in statuses.values()):
            doc["convergence"] = {"converged": same, "partitions": total, "differs": [f"{t}/{p}" for t, p in differs]}
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        kafka = kafka_addresses(getattr(args, "data_dir", DEFAULT_DATA_DIR), list(statuses))
        print(render(statuses, kafka, differing))
    return 0 if all(not isinstance(s, str) for s in statuses.values()) else 1
