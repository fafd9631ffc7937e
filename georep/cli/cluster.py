"""``georep cluster status``: a multi-node site's nodes, partition leaders, under-replicated segments and Raft group;
``georep cluster decommission``: drain a node of it.

The first reachable node of ``--bootstrap`` answers ``ClusterStatus`` from its
view of the site's metadata (``cluster/status.py``): which nodes are live,
how many segment copies each holds and how many partitions it leads, every
partition's leader, epoch and open ensemble, and the segments with fewer
live members than they should have.

**Bytes.** The metadata counts segments, not bytes: only a node can read its
own disk. So the command then asks every other node that the answer shows
live for its own ``ClusterStatus`` and takes from it the bytes of that
node's segment copies (``STORED``) and its Raft role. A node that does not
answer within a few seconds shows ``-`` (``null`` in ``--json``); a dead
node is not asked.

**Bytes moved** (``MOVED``, and the site's total) are the bytes repair
copies wrote to each node from other nodes: copies off dead or draining
members, fills, widenings (``georep/storage/moved_bytes.py``). Each node
keeps its own count on its disk and reports it with its heartbeats, so a
dead node's last report is shown too; a node that answered for itself gives
its count now. A node that joins takes new segments with 0 bytes moved.

**Decommission.** ``georep cluster decommission NODE_ID`` sets the node
draining through the site's metadata (``DecommissionNode``, an admin call:
the token as for ``georep link``). From then on it takes no new segment, the
Raft leader's controller moves the partitions it leads to other nodes, its
open segments are rolled, and its sealed segments are copied to other nodes
at once (no repair delay: it is leaving by request). The command prints what
the metadata still puts on the node; with ``--wait`` it then follows
``ClusterStatus`` until nothing does (the node can then be stopped without
losing a copy), or gives up after ``--wait-timeout-s``. ``--cancel`` stops
the drain: the node takes new segments again, and what was moved stays
moved.

Exit codes: 0 the status was read, or the drain was started (and, with
``--wait``, finished); 2 no node of ``--bootstrap`` could be reached, the
site has one node, or the node id is not one of its nodes; 1 any other
failure, or ``--wait`` timed out. The rendering functions are pure (messages
in, text or a JSON-ready dict out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from georep.cli.admin_token import TOKEN_ENV, call_metadata, find_token
from georep.cli.output import EXIT_ERROR, EXIT_USAGE, table
from georep.client.connection import BOOTSTRAP_ENV, CHANNEL_OPTIONS, Connection, default_bootstrap
from georep.client.errors import GeorepError, InvalidRequest, NodeUnavailable, Operation, from_rpc_error
from georep.client.tls_args import TlsArgsError, client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel

TIMEOUT_S = 10.0
WAIT_POLL_S = 1.0
WAIT_TIMEOUT_S_DEFAULT = 3600.0
REPORT_TIMEOUT_S = 3.0  # per other node asked for its own bytes: a hung node must not hold the command long
PAGE_DEFAULT = 100  # partitions per page of --partitions
SUMMARY = pb.ClusterStatusRequest(partitions_limit=0)  # the nodes and the counts: what a node answers fastest

Reports = dict[int, pb.ClusterStatusResponse]  # node id -> that node's own answer


class StatusRefused(Exception):
    """The node would not give the status; ``str`` says why, ``exit_code`` is what the command exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status", help="nodes, bytes and segments per node, leaders, under-replicated segments, Raft leader"
    )
    status.add_argument(
        "--bootstrap",
        "--bootstrap-server",  # kafka-*.sh spelling
        default=default_bootstrap(),
        metavar="HOST:PORT[,HOST:PORT]",
        help=f"node(s) of the site to ask; the first reachable one answers (default: ${BOOTSTRAP_ENV}, else "
        "127.0.0.1:7101; now %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    status.add_argument(
        "--partitions",
        action="store_true",
        help="list partitions (leader, epoch, open ensemble) and under-replicated segments, a page at a time; "
        "without it, only the counts",
    )
    status.add_argument(
        "--limit",
        type=int,
        default=PAGE_DEFAULT,
        metavar="N",
        help="with --partitions: at most N partitions (and N under-replicated segments) per page (default %(default)s)",
    )
    status.add_argument(
        "--page-token",
        default="",
        metavar="TOKEN",
        help="with --partitions: the page after the one that printed TOKEN",
    )
    status.add_argument("--all", action="store_true", help="with --partitions: every partition, in one page")
    status.add_argument("--topic", default="", help="with --partitions: only this topic's partitions")
    add_client_tls_arguments(status, data_dir=True)
    drain = actions.add_parser("decommission", help="drain a node: move its leaderships and segments to other nodes")
    drain.add_argument("node_id", type=int, metavar="NODE_ID", help="the node to drain (its --node-id)")
    drain.add_argument(
        "--bootstrap",
        "--bootstrap-server",  # kafka-*.sh spelling
        default=default_bootstrap(),
        metavar="HOST:PORT[,HOST:PORT]",
        help=f"node(s) of the site to ask; the first reachable one answers (default: ${BOOTSTRAP_ENV}, else "
        "127.0.0.1:7101; now %(default)s)",
    )
    drain.add_argument(
        "--wait", action="store_true", help="wait until the node holds no segment the site needs and leads no partition"
    )
    drain.add_argument(
        "--wait-timeout-s",
        type=float,
        default=WAIT_TIMEOUT_S_DEFAULT,
        help=f"give up waiting after this long (default {WAIT_TIMEOUT_S_DEFAULT:.0f})",
    )
    drain.add_argument("--cancel", action="store_true", help="stop draining the node: it takes new segments again")
    drain.add_argument(
        "--data-dir", type=Path, default=Path(".georep"), help="where 'georep up' keeps admin.token (default .georep)"
    )
    drain.add_argument(
        "--admin-token", help=f"the nodes' admin token (default: ${TOKEN_ENV}, else DATA_DIR/admin.token)"
    )
    add_client_tls_arguments(drain)


# --- rendering (pure) ----------------------------------------------------------------


def raft_leader_node(answer: pb.ClusterStatusResponse, reports: Reports) -> int | None:
    """The node id of the Raft leader, if the answering node is it or a node asked says it is."""
    if answer.raft.is_leader:
        return answer.node_id
    for node, report in sorted(reports.items()):
        if report.raft.is_leader and report.raft.self_address == answer.raft.leader_address:
            return node
    return None


def _own(node: pb.ClusterNodeStatus, answer: pb.ClusterStatusResponse, reports: Reports) -> pb.ClusterNodeStatus | None:
    """The node's entry in its own answer (the only one with its bytes), if it was had."""
    source = answer if node.node_id == answer.node_id else reports.get(node.node_id)
    if source is None:
        return None
    return next((n for n in source.nodes if n.node_id == node.node_id), None)


def _role(node: pb.ClusterNodeStatus, answer: pb.ClusterStatusResponse, reports: Reports) -> str | None:
    source = answer if node.node_id == answer.node_id else reports.get(node.node_id)
    if source is None:
        return None
    return "leader" if source.raft.is_leader else "follower"


def status_request(args: argparse.Namespace) -> pb.ClusterStatusRequest:
    """What to ask: the summary, or with ``--partitions`` a page of the listing (or all of it, ``--all``)."""
    if not args.partitions:
        return SUMMARY
    request = pb.ClusterStatusRequest(page_token=args.page_token, topic=args.topic)
    if not args.all:
        request.partitions_limit = args.limit
    return request


def status_json(answer: pb.ClusterStatusResponse, reports: Reports) -> dict[str, Any]:
    """The status as one JSON-ready document; every key is always present (null where unknown)."""
    nodes = []
    for n in answer.nodes:
        own = _own(n, answer, reports)
        nodes.append(
            {
                "node": n.node_id,
                "address": n.address,
                "live": n.live,
                "last_heartbeat_age_ms": n.last_heartbeat_age_ms if n.HasField("last_heartbeat_age_ms") else None,
                "free_bytes": n.free_bytes,
                "load": n.load,
                "draining": n.draining,
                "segments": n.segments,
                "open_segments": n.open_segments,
                "leader_of": n.leader_of,
                "store_bytes": own.store_bytes if own is not None and own.HasField("store_bytes") else None,
                "bytes_moved": (own or n).bytes_moved,
                "raft_role": _role(n, answer, reports),
            }
        )
    partitions = [
        {
            "topic": p.topic,
            "partition": p.partition,
            "leader": p.leader or None,
            "leader_live": p.leader_live,
            "leader_epoch": p.leader_epoch,
            "segments": p.segments,
            "open_segment": (
                {"segment_id": p.open_segment_id, "ensemble": list(p.open_ensemble)}
                if p.HasField("open_segment_id")
                else None
            ),
        }
        for p in answer.partitions
    ]
    under = [
        {
            "topic": u.topic,
            "partition": u.partition,
            "segment_id": u.segment_id,
            "sealed": u.sealed,
            "ensemble": list(u.ensemble),
            "dead": list(u.dead),
            "draining": list(u.draining),
            "live_members": u.live_members,
            "wanted_members": u.wanted_members,
            "message": u.message,
        }
        for u in answer.under_replicated
    ]
    raft = answer.raft
    return {
        "site": answer.site,
        "origin": f"{answer.site}@{answer.epoch}",
        "answered_by": answer.node_id,
        "replication_factor": answer.replication_factor,
        "session_timeout_ms": answer.session_timeout_ms,
        "raft": {
            "leader_address": raft.leader_address or None,
            "leader_node": raft_leader_node(answer, reports),
            "self_address": raft.self_address,
            "role": "leader" if raft.is_leader else "follower",
            "reachable_nodes": raft.reachable_nodes,
            "total_nodes": raft.total_nodes,
            "applied_index": raft.applied_index,
            "commit_index": raft.commit_index,
        },
        "bytes_moved": sum(n["bytes_moved"] for n in nodes),
        "nodes": nodes,
        "partition_count": answer.partition_count,
        "leaderless_partitions": answer.leaderless_partitions,
        "under_replicated_count": answer.under_replicated_count,
        "partitions": partitions,
        "under_replicated": under,
        "next_page_token": answer.next_page_token or None,
    }


def size_text(n: int | None) -> str:
    """``512 B``, ``4.1 KiB``, ``12.0 GiB``; ``-`` for unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _ids(nodes: list[int]) -> str:
    return ",".join(map(str, nodes)) or "-"


def _node_table(doc: dict[str, Any]) -> str:
    """One row per node: its state, heartbeat age, free space, load, segments, leaderships and bytes."""
    rows = []
    for n in doc["nodes"]:
        state = ("live" if n["live"] else "dead") + (",draining" if n["draining"] else "")
        age = n["last_heartbeat_age_ms"]
        heartbeat = "never" if age is None else f"{age / 1000:.1f}s"
        rows.append(
            (
                n["node"],
                n["address"],
                state,
                heartbeat,
                size_text(n["free_bytes"]).replace(" ", ""),
                n["load"],
                n["segments"],
                n["open_segments"],
                n["leader_of"],
                size_text(n["store_bytes"]).replace(" ", ""),
                size_text(n["bytes_moved"]).replace(" ", ""),
            )
        )
    header = (
        "NODE",
        "ADDRESS",
        "STATE",
        "HEARTBEAT-AGE",
        "FREE",
        "LOAD",
        "SEGMENTS",
        "OPEN",
        "LEADS",
        "STORED",
        "MOVED",
    )
    return table(header, rows)


def _partition_table(partitions: list[dict[str, Any]]) -> str:
    prows = []
    for p in partitions:
        lead = "-" if p["leader"] is None else str(p["leader"]) + ("" if p["leader_live"] else "(dead)")
        ensemble = "-" if p["open_segment"] is None else _ids(p["open_segment"]["ensemble"])
        prows.append((p["topic"], p["partition"], lead, p["leader_epoch"], p["segments"], ensemble))
    return table(("TOPIC", "PARTITION", "LEADER", "EPOCH", "SEGMENTS", "OPEN-ENSEMBLE"), prows)


def _under_table(under: list[dict[str, Any]]) -> str:
    urows = [
        (
            u["topic"],
            u["partition"],
            u["segment_id"],
            "sealed" if u["sealed"] else "open",
            _ids(u["ensemble"]),
            f"{u['live_members']}/{u['wanted_members']}",
            _ids(u["dead"]),
            _ids(u["draining"]),
        )
        for u in under
    ]
    return table(("TOPIC", "PARTITION", "SEGMENT", "STATE", "ENSEMBLE", "LIVE", "DEAD", "DRAINING"), urows)


def render(answer: pb.ClusterStatusResponse, reports: Reports) -> str:
    doc = status_json(answer, reports)
    live = sum(1 for n in answer.nodes if n.live)
    raft = doc["raft"]
    leader = raft["leader_address"] or "none known"
    if raft["leader_node"] is not None:
        leader = f"node {raft['leader_node']} ({leader})"
    lines = [
        f"site {doc['site']} (origin {doc['origin']}): {len(answer.nodes)} nodes, {live} live; replication factor "
        f"{answer.replication_factor}; as node {answer.node_id} sees it",
        f"raft: leader {leader}; node {answer.node_id} is {raft['role']}; {raft['reachable_nodes']} of "
        f"{raft['total_nodes']} metadata nodes reachable from it",
    ]
    if raft["leader_address"] is None:
        lines.append(
            f"  no Raft leader known to node {answer.node_id}: no heartbeat commits until one is elected, so "
            "nodes that are up may show dead for now"
        )
    lines.append("")
    lines.append(_node_table(doc))
    lines.append(
        f"bytes moved between nodes by repairs: {size_text(doc['bytes_moved'])}"
        + (f" ({doc['bytes_moved']} B)" if doc["bytes_moved"] >= 1024 else "")
    )
    lines.append("")
    count = max(doc["partition_count"], len(doc["partitions"]))  # an older node gives no counts: its list is all
    under = doc["under_replicated"]
    under_count = max(doc["under_replicated_count"], len(under))
    leaderless = doc["leaderless_partitions"]
    if count:
        lines.append(
            f"partitions: {count}, {leaderless} without a live leader; leaders per node in LEADS above"
            + ("" if doc["partitions"] else " (list them with --partitions)")
        )
    else:
        lines.append("no topics yet (create one with 'georep topic create')")
    if doc["partitions"]:
        lines.append(_partition_table(doc["partitions"]))
        if doc["next_page_token"]:
            lines.append(
                f"{len(doc['partitions'])} listed; the next page: georep cluster status --partitions "
                f"--page-token {doc['next_page_token']} (or --all)"
            )
    lines.append("")
    if not under_count:
        lines.append("under-replicated segments: none")
    else:
        lines.append(f"under-replicated segments: {under_count}")
        if under:
            lines.append(_under_table(under))
        if len(under) < under_count:
            lines.append(f"{len(under)} listed: --partitions lists them a page at a time, --all every one")
    return "\n".join(lines)


# --- the shell -----------------------------------------------------------------------


async def _report(node: pb.ClusterNodeStatus, tls: TlsConfig | None) -> pb.ClusterStatusResponse | None:
    """``node``'s own answer, or None if it does not give one in time."""
    try:
        async with client_channel(node.address, tls, CHANNEL_OPTIONS) as channel:
            report = await pbg.NodeStub(channel).ClusterStatus(SUMMARY, timeout=REPORT_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None
    return report if report.node_id == node.node_id else None  # another process at that address now


async def fetch(
    bootstrap: str, tls: TlsConfig | None = None, request: pb.ClusterStatusRequest = SUMMARY
) -> tuple[pb.ClusterStatusResponse, Reports]:
    """The first reachable node's answer to ``request``, and the other live nodes' own (for their bytes)."""
    connection = Connection(bootstrap, tls=tls)
    try:
        stub = await connection.connect()
        try:
            answer: pb.ClusterStatusResponse = await stub.ClusterStatus(request, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.FAILED_PRECONDITION:  # the site has one node: nothing to show
                raise StatusRefused(f"{connection.address}: {exc.details()}", EXIT_USAGE) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise StatusRefused(
                    f"the node at {connection.address} does not serve ClusterStatus: it runs an "
                    "older georep; upgrade it",
                    EXIT_ERROR,
                ) from None
            raise from_rpc_error(exc, connection.address, operation=Operation.ADMIN) from None
    finally:
        await connection.close()
    others = [n for n in answer.nodes if n.live and n.node_id != answer.node_id]
    answers = await asyncio.gather(*(_report(n, tls) for n in others))
    return answer, {n.node_id: r for n, r in zip(others, answers, strict=True) if r is not None}


def drain_text(node: int, draining: bool, sealed: int, open_: int, leads: int) -> str:
    """One line of a drain's progress."""
    if not draining:
        return f"node {node} is not draining: it takes new segments"
    if not (sealed or open_ or leads):
        return f"node {node} is drained: it holds no segment the site needs and leads no partition; it can be stopped"
    return (
        f"node {node} is draining: the site still needs {sealed} sealed and {open_} open segment(s) on it, and it "
        f"leads {leads} partition(s)"
    )


def _drain_of(answer: pb.ClusterStatusResponse, node: int) -> tuple[bool, int, int, int] | None:
    """(draining, sealed, open, leads) of ``node`` in a status answer, or None if it is not listed."""
    for n in answer.nodes:
        if n.node_id == node:
            return n.draining, n.segments - n.open_segments, n.open_segments, n.leader_of
    return None


async def decommission(
    bootstrap: str, node: int, cancel: bool, token: str | None, tls: TlsConfig | None = None
) -> pb.DecommissionNodeResponse:
    connection = Connection(bootstrap, tls=tls)
    try:
        stub = await connection.connect()
        try:
            answer: pb.DecommissionNodeResponse = await stub.DecommissionNode(
                pb.DecommissionNodeRequest(node_id=node, cancel=cancel),
                timeout=TIMEOUT_S,
                metadata=call_metadata(token),
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise StatusRefused(f"{connection.address}: {exc.details()}", EXIT_USAGE) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise StatusRefused(
                    f"the node at {connection.address} does not serve DecommissionNode: it runs an "
                    "older georep; upgrade it",
                    EXIT_ERROR,
                ) from None
            raise from_rpc_error(exc, connection.address, operation=Operation.ADMIN) from None
        return answer
    finally:
        await connection.close()


async def wait_drained(bootstrap: str, node: int, timeout_s: float, tls: TlsConfig | None = None) -> bool:
    """Follow ``ClusterStatus`` until ``node`` is drained (True) or ``timeout_s`` passes (False); prints progress."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        answer, _ = await fetch(bootstrap, tls)
        drain = _drain_of(answer, node)
        if drain is None:
            print(f"node {node} is no longer listed by the site's metadata")
            return True
        if drain != last:
            print(drain_text(node, *drain), flush=True)
            last = drain
        draining, sealed, open_, leads = drain
        if draining and not (sealed or open_ or leads):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(WAIT_POLL_S)


def main_decommission(args: argparse.Namespace) -> int:
    token = find_token(args.admin_token, args.data_dir)
    try:
        tls = client_tls(args)
        answer = asyncio.run(decommission(args.bootstrap, args.node_id, args.cancel, token, tls))
        print(
            drain_text(answer.node_id, answer.draining, answer.sealed_segments, answer.open_segments, answer.leader_of),
            flush=True,
        )
        if not args.wait or args.cancel or answer.drained:
            return 0
        if asyncio.run(wait_drained(args.bootstrap, args.node_id, args.wait_timeout_s, tls)):
            return 0
    except StatusRefused as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (NodeUnavailable, InvalidRequest) as exc:
        print(f"georep: error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except GeorepError as exc:
        print(f"georep: error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    print(
        f"georep: error: node {args.node_id} still holds segments after {args.wait_timeout_s:.0f} s; it keeps "
        "draining: 'georep cluster status' shows what is under-replicated and why",
        file=sys.stderr,
    )
    return EXIT_ERROR


def main(args: argparse.Namespace) -> int:
    if args.action == "decommission":
        return main_decommission(args)
    if args.limit < 1:
        print(f"georep: error: --limit {args.limit}: use 1 or more (--all for every partition)", file=sys.stderr)
        return EXIT_USAGE
    try:
        answer, reports = asyncio.run(fetch(args.bootstrap, client_tls(args), status_request(args)))
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StatusRefused as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (NodeUnavailable, InvalidRequest) as exc:  # no node of --bootstrap answers, or it is not HOST:PORT
        print(f"georep: error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except GeorepError as exc:
        print(f"georep: error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(status_json(answer, reports), indent=1, sort_keys=True))
    else:
        print(render(answer, reports))
    return 0
