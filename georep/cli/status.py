"""``georep status``: every site's vectors, links, routes and lag, from ``SiteStatus``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from georep.cli.tls_args import TlsArgsError, client_tls, default_client_tls
from georep.cli.tls_args import add_client_arguments as add_client_tls_arguments
from georep.cli.topology import LinkStatus
from georep.cli.topology_arg import load_topology
from georep.cli.up import DEFAULT_DATA_DIR
from georep.client.admin import damaged_text
from georep.client.connection import tls_problem
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from georep.server.process import NODE_INFO
from topology.file import TopologyFileError
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology

TIMEOUT_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    parser.add_argument(
        "--partitions",
        action="store_true",
        help="list every partition (default: a line per topic, and only the partitions damaged or lagging)",
    )
    add_client_tls_arguments(parser, data_dir=True)


def vector_text(vector: pb.VectorOffset) -> str:
    return ",".join(f"{e.site}@{e.epoch}:{e.next_seq}" for e in vector.entries) or "-"


async def fetch_status(topology: Topology, tls: TlsConfig | None = None) -> dict[str, pb.SiteStatusResponse | str]:
    """Each site's status, or the reason it could not be had."""

    async def one(address: str) -> pb.SiteStatusResponse | str:
        async with client_channel(address, tls) as channel:
            try:
                return await pbg.NodeStub(channel).SiteStatus(pb.SiteStatusRequest(), timeout=TIMEOUT_S)
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


def convergence(statuses: dict[str, pb.SiteStatusResponse | str]) -> list[tuple[str, int, bool]]:
    """(topic, partition, whether every reachable site holds the same records) for the users' topics.

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


LISTED_MAX = 20  # partitions named one by one (damaged, lagging, differing) before "... and N more"


def render(
    statuses: dict[str, pb.SiteStatusResponse | str], kafka: dict[str, str] | None = None, partitions: bool = False
) -> str:
    """Per site: a line per topic, the partitions that need attention (damaged or lagging; every partition with
    ``partitions``), the links and conflicts; then convergence. Its size follows the topics and the trouble, not
    the partition count."""
    lines: list[str] = []
    for site, s in statuses.items():
        if isinstance(s, str):
            lines.append(f"site {site}: {s}")
            continue
        kafka_at = f", Kafka clients at {kafka[site]}" if kafka and kafka.get(site) else ""
        lines.append(f"site {site} (origin {site}@{s.epoch}){kafka_at}")
        lines += _topic_lines(s.partitions, partitions)
        for link in s.links:
            err = f"  ({link.last_error})" if link.last_error else ""
            lines.append(
                f"  link {link.src} -> {link.dst}: {link.state}, applied {link.applied_batches} batches "
                f"({link.applied_bytes} bytes), skipped {link.skipped_batches}, streams opened "
                f"{link.streams_opened}{err}"
            )
        for c in s.conflicts:
            lines.append(f"  CONFLICT {c.topic}: {c.message}")
    rows = convergence(statuses)
    unreachable = [site for site, s in statuses.items() if isinstance(s, str)]
    if unreachable:
        lines.append(f"convergence unknown: site(s) {', '.join(unreachable)} did not answer")
    elif rows:
        same = sum(1 for _, _, ok in rows if ok)
        lines.append(f"converged partitions: {same}/{len(rows)}")
        lines += _capped([f"  differs: {t}/{p}" for t, p, ok in rows if not ok], "differ")
    return "\n".join(lines)


def _topic_lines(parts: Iterable[pb.PartitionStatus], every: bool) -> list[str]:
    topics: dict[str, list[pb.PartitionStatus]] = {}
    for p in parts:
        if not is_internal(p.topic):
            topics.setdefault(p.topic, []).append(p)
    lines: list[str] = []
    for topic, ps in topics.items():
        lagging = [p for p in ps if any(lag.lag_records for lag in p.lags)]
        damaged = [p for p in ps if p.damaged]
        behind = sum(lag.lag_records for p in ps for lag in p.lags)
        records = sum(e.next_seq for p in ps for e in p.vector.entries)
        lines.append(
            f"  topic {topic}: {len(ps)} partitions, {records} records, {len(lagging)} lagging ({behind} records "
            f"behind), {len(damaged)} damaged"
        )
        shown = ps if every else [p for p in ps if p.damaged or any(lag.lag_records for lag in p.lags)]
        detail = [line for p in shown for line in _partition_lines(p)]
        lines += detail if every else _capped(detail, "more lines: georep status --partitions lists them all")
    return lines


def _partition_lines(p: pb.PartitionStatus) -> list[str]:
    lines = [f"  {p.topic}/{p.partition}  end={p.log_end_offset}  vector={vector_text(p.vector)}"]
    for d in p.damaged:
        lines.append(f"      DAMAGED {damaged_text(d)}; quarantined until a peer's copy repairs it")
    for lag in p.lags:
        lines.append(
            f"      {lag.origin:<24} from {lag.upstream or '-':<8} lag {lag.lag_records} records"
            f", ~{lag.lag_bytes} bytes, {lag.lag_ms} ms"
        )
    return lines


def _capped(lines: list[str], what: str) -> list[str]:
    if len(lines) <= LISTED_MAX:
        return lines
    return [*lines[:LISTED_MAX], f"  ... and {len(lines) - LISTED_MAX} {what}"]


def live_link_states(topology: Topology) -> dict[tuple[SiteId, SiteId], LinkStatus]:
    """Each link's state and lag as its destination reports them; links into unreachable sites are left out.
    Over TLS with the default certificates (``$GEOREP_TLS_DIR``, else those of 'georep up' in .georep/certs)."""
    out: dict[tuple[SiteId, SiteId], LinkStatus] = {}
    for site, s in asyncio.run(fetch_status(topology, default_client_tls())).items():
        if isinstance(s, str):
            continue
        for link in s.links:
            carried = [lag for p in s.partitions for lag in p.lags if lag.upstream == link.src]
            out[(SiteId(link.src), SiteId(site))] = LinkStatus(
                state=link.state,
                lag_records=sum(lag.lag_records for lag in carried),
                lag_ms=max((lag.lag_ms for lag in carried), default=0),
            )
    return out


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
    statuses = asyncio.run(fetch_status(topology, tls))
    if args.json:
        print(json.dumps(as_json(statuses), indent=1, sort_keys=True))
    else:
        kafka = kafka_addresses(getattr(args, "data_dir", DEFAULT_DATA_DIR), list(statuses))
        print(render(statuses, kafka, partitions=args.partitions))
    return 0 if all(not isinstance(s, str) for s in statuses.values()) else 1
