"""``georep group list|describe``: consumer groups as one site sees them (``reset-offsets`` and ``delete``:
``georep/cli/group_reset.py``).

Membership lives at the site a consumer is connected to (each site
coordinates its own members), while commits replicate to every site. So both
commands answer for the site of the first reachable node of ``--bootstrap`` and
name that site (``site@epoch``) in their output. ``LAG`` is exact: the number of
records this site holds for the partition that the committed vector does not
cover; on a multi-node site ``describe`` asks each partition's leader for its
end, and ``list`` shows "-" for a group with a partition its coordinator does not
lead.

On a multi-node site a group's coordinator is the leader of its
``__georep_offsets`` partition: ``describe`` follows the ``NotLeader`` hint (or
the leader ``DescribeTopic`` names) to it, and ``list`` asks every leader of the
internal topic for the groups it coordinates and merges the answers, asking
again for a few seconds while a partition of the internal topic has no leader
or its new leader is still taking it over, then failing saying so.

The rendering functions are pure (protobuf message in, text or a JSON-ready
dict out); ``main`` is the thin shell that calls the node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import grpc

from georep.cli import group_reset
from georep.client.connection import BOOTSTRAP_ENV, Connection, default_bootstrap, parse_bootstrap
from georep.client.errors import (
    GeorepError,
    InvalidRequest,
    NodeUnavailable,
    NotLeader,
    Operation,
    UnknownTopic,
    from_rpc_error,
)
from georep.client.tls_args import TlsArgsError, client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_from_proto
from georep.security.tls import TlsConfig
from offsets.commits import OFFSETS_TOPIC, offsets_partition

TIMEOUT_S = 10.0
EXIT_ERROR = 1
COORDINATOR_ATTEMPTS = 10
COORDINATOR_BACKOFF_S = 0.3


def _bootstrap(text: str) -> str:
    try:
        parse_bootstrap(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every group this site has members or commits of")
    describe = actions.add_parser("describe", help="members, assignments, committed vectors and lag of one group")
    describe.add_argument("group")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--bootstrap",
            "--bootstrap-server",  # kafka-*.sh spelling
            type=_bootstrap,
            default=default_bootstrap(),
            metavar="HOST:PORT[,HOST:PORT]",
            help=f"node(s) to ask; the first reachable one answers (default: ${BOOTSTRAP_ENV}, else 127.0.0.1:7101)",
        )
        if sub.prog.split()[-1] in ("list", "describe"):
            sub.add_argument("--json", action="store_true", help="one JSON document instead of a table")
        add_client_tls_arguments(sub, data_dir=True)

    common(listing)
    common(describe)
    group_reset.add_arguments(actions, common)


# --- rendering (pure) ----------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def utc_iso(ms: int) -> str:
    """``2025-11-21T08:00:01.234Z``; ``-`` for 0 (never set)."""
    if ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def vector_text(vector: pb.VectorOffset) -> str:
    return vector_from_proto(vector).to_text() or "-"


def assignment_json(assignment: Sequence[pb.TopicPartitions]) -> dict[str, list[int]]:
    return {tp.topic: sorted(tp.partitions) for tp in sorted(assignment, key=lambda tp: tp.topic)}


def assignment_text(assignment: Sequence[pb.TopicPartitions]) -> str:
    """``orders/0,2;audit/1``: no spaces, so a table row splits into its columns."""
    parts = [f"{t}/{','.join(map(str, ps))}" for t, ps in assignment_json(assignment).items() if ps]
    return ";".join(parts) or "-"


def _lag_text(lag: int) -> str:
    return "-" if lag < 0 else str(lag)  # -1: the answering node does not lead the partition (multi-node site)


def _lag_json(lag: int) -> int | None:
    return None if lag < 0 else lag


def list_json(site: str, groups: pb.ListGroupsResponse) -> dict[str, Any]:
    return {
        "site": site,
        "groups": [
            {
                "group": g.group,
                "members": g.members,
                "generation": g.generation,
                "assignor": g.assignor,
                "committed_partitions": g.committed_partitions,
                "lag_records": _lag_json(g.lag_records),
            }
            for g in groups.groups
        ],
    }


def render_list(site: str, groups: pb.ListGroupsResponse) -> str:
    if not groups.groups:
        return f"no consumer groups at site {site} (start one with 'georep consume TOPIC --group G')"
    rows = [
        (g.group, g.members, g.generation, g.assignor or "-", g.committed_partitions, _lag_text(g.lag_records))
        for g in groups.groups
    ]
    return _table(("GROUP", "MEMBERS", "GENERATION", "ASSIGNOR", "PARTITIONS", "LAG"), rows)


def describe_json(site: str, d: pb.GroupDescription) -> dict[str, Any]:
    return {
        "site": site,
        "group": d.group,
        "generation": d.generation,
        "assignor": d.assignor,
        "members": [
            {
                "member_id": m.member_id,
                "client_id": m.client_id,
                "assignment": assignment_json(m.assignment),
                "last_heartbeat_age_ms": m.last_heartbeat_age_ms,
            }
            for m in d.members
        ],
        "offsets": [
            {
                "topic": c.topic,
                "partition": c.partition,
                "vector": vector_from_proto(c.vector).to_text(),
                "committed_by": c.committed_by,
                "hlc": c.hlc,
                "committed_at": utc_iso(c.committed_at_ms),
                "committed_at_ms": c.committed_at_ms,
                "member_id": c.member_id,
                "generation": c.generation,
                "hint_offset": c.hint_offset,
                "metadata": c.metadata,
                "lag_records": _lag_json(c.lag_records),
            }
            for c in d.offsets
        ],
    }


def render_describe(site: str, d: pb.GroupDescription) -> str:
    lines = [f"Group: {d.group}  Site: {site}  Generation: {d.generation}  Assignor: {d.assignor or '-'}"]
    if d.members:
        rows = [
            (
                m.member_id,
                m.client_id or "-",
                assignment_text(m.assignment),
                f"{m.last_heartbeat_age_ms / 1000:.1f}s ago",
            )
            for m in d.members
        ]
        lines += ["", _table(("MEMBER", "CLIENT", "ASSIGNMENT", "LAST-HEARTBEAT"), rows)]
    else:
        lines += ["", f"no members at site {site}"]
    if d.offsets:
        commits = [
            (
                c.topic,
                c.partition,
                vector_text(c.vector),
                c.committed_by,
                c.hlc,
                utc_iso(c.committed_at_ms),
                c.member_id or "-",
                _lag_text(c.lag_records),
            )
            for c in d.offsets
        ]
        header = ("TOPIC", "PARTITION", "COMMITTED", "BY", "HLC", "COMMITTED-AT", "MEMBER", "LAG")
        lines += ["", _table(header, commits)]
    else:
        lines += ["", "no committed offsets"]
    return "\n".join(lines)


# --- the shell -----------------------------------------------------------------------


async def _leaders(connection: Connection) -> list[pb.PartitionLeader]:
    """The leaders of the internal topic's partitions (none on a one-node site, or before the topic exists)."""
    try:
        description: pb.TopicDescription = await connection.stub.DescribeTopic(
            pb.DescribeTopicRequest(name=OFFSETS_TOPIC), timeout=TIMEOUT_S
        )
    except grpc.RpcError as exc:
        error = from_rpc_error(exc, connection.address, operation=Operation.GROUP)
        if isinstance(error, UnknownTopic):
            return []
        raise error from None
    return list(description.leaders)


async def _list(connection: Connection) -> pb.ListGroupsResponse:
    """One-node site: that node's answer. Multi-node site: every leader of the internal topic answers for the
    groups it coordinates; asked again while a leader is missing, dead or not serving its partition yet."""
    error: GeorepError | None = None
    for _attempt in range(COORDINATOR_ATTEMPTS):
        leaders = await _leaders(connection)
        if not leaders:
            groups: pb.ListGroupsResponse = await connection.stub.ListGroups(pb.ListGroupsRequest(), timeout=TIMEOUT_S)
            return groups
        try:
            return await _list_leaders(connection, leaders)
        except (NotLeader, NodeUnavailable) as exc:
            error = exc
        await asyncio.sleep(COORDINATOR_BACKOFF_S)
    assert error is not None
    raise error


async def _list_leaders(connection: Connection, leaders: list[pb.PartitionLeader]) -> pb.ListGroupsResponse:
    leaderless = sorted(leader.partition for leader in leaders if not leader.address)
    if leaderless:
        raise NodeUnavailable(
            f"partition(s) {leaderless} of {OFFSETS_TOPIC} have no leader now (the site is "
            "electing one): the groups they coordinate cannot be listed; retry in a moment"
        )
    merged: dict[str, pb.GroupSummary] = {}
    for address in sorted({leader.address for leader in leaders}):
        node = connection if address == connection.address else Connection(address, tls=connection.tls)
        try:
            stub = await node.connect()
            answer: pb.ListGroupsResponse = await stub.ListGroups(pb.ListGroupsRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, address, operation=Operation.GROUP) from None
        finally:
            if node is not connection:
                await node.close()
        for g in answer.groups:
            merged.setdefault(g.group, g)
    return pb.ListGroupsResponse(groups=[merged[name] for name in sorted(merged)])


async def _fill_lags(connection: Connection, d: pb.GroupDescription) -> None:
    """A multi-node site: the coordinator knows the end only of the partitions it leads (lag -1 for the others);
    ask each partition's leader for its vector (``DescribeTopic``) and count what the commit does not cover.
    A partition whose leader does not answer keeps -1 ("-")."""
    unknown = [c for c in d.offsets if c.lag_records < 0]
    vectors: dict[tuple[str, int], pb.VectorOffset] = {}
    for topic in sorted({c.topic for c in unknown}):
        try:
            described: pb.TopicDescription = await connection.stub.DescribeTopic(
                pb.DescribeTopicRequest(name=topic), timeout=TIMEOUT_S
            )
        except grpc.RpcError:
            continue
        wanted = {c.partition for c in unknown if c.topic == topic}
        for address in sorted(
            {lead.address for lead in described.leaders if lead.partition in wanted and lead.address}
        ):
            node = Connection(address, tls=connection.tls)
            try:
                stub = await node.connect()
                at_leader: pb.TopicDescription = await stub.DescribeTopic(
                    pb.DescribeTopicRequest(name=topic), timeout=TIMEOUT_S
                )
                vectors.update({(topic, st.partition): st.vector for st in at_leader.partition_states})
            except (grpc.RpcError, GeorepError):
                continue
            finally:
                await node.close()
    for c in unknown:
        end = vectors.get((c.topic, c.partition))
        if end is not None:
            committed = vector_from_proto(c.vector)
            ends = vector_from_proto(end)
            c.lag_records = sum(max(0, seq - committed.get(origin)) for origin, seq in ends.items())


async def _describe(connection: Connection, group: str) -> pb.GroupDescription:
    """``DescribeGroup`` at the group's coordinator."""
    description: pb.GroupDescription = await _at_coordinator(
        connection, group, lambda stub: stub.DescribeGroup(pb.DescribeGroupRequest(group=group), timeout=TIMEOUT_S)
    )
    return description


async def _at_coordinator(connection: Connection, group: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """``call`` at the group's coordinator: the connected node, or the one a ``NotLeader`` names."""
    node = connection
    try:
        for _attempt in range(COORDINATOR_ATTEMPTS):
            try:
                stub = await node.connect()
                return await call(stub)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, node.address, operation=Operation.GROUP)
            except NodeUnavailable as exc:
                error = exc
            if not isinstance(error, NotLeader | NodeUnavailable) or (
                isinstance(error, NodeUnavailable) and node is connection
            ):
                raise error
            hint = error.leader if isinstance(error, NotLeader) else ""
            if not hint:
                index = offsets_partition(group)
                hint = next((lead.address for lead in await _leaders(connection) if lead.partition == index), "")
            if node is not connection:
                await node.close()
            node = connection if not hint or hint == connection.address else Connection(hint, tls=connection.tls)
            if not hint:
                await asyncio.sleep(COORDINATOR_BACKOFF_S)
        raise error
    finally:
        if node is not connection:
            await node.close()


async def _ask(
    bootstrap: str, action: str, group: str, tls: TlsConfig | None = None, args: argparse.Namespace | None = None
) -> tuple[str, pb.ListGroupsResponse | pb.GroupDescription | str]:
    connection = Connection(bootstrap, tls=tls)
    try:
        await connection.connect()
        try:
            if action == "list":
                return connection.origin, await _list(connection)
            if args is not None and action == "reset-offsets":
                return connection.origin, await group_reset.reset(connection, args, _at_coordinator)
            if args is not None and action == "delete":
                return connection.origin, await group_reset.delete(connection, args, _at_coordinator)
            description = await _describe(connection, group)
            await _fill_lags(connection, description)
            return connection.origin, description
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, connection.address, operation=Operation.GROUP) from None
    finally:
        await connection.close()


def main(args: argparse.Namespace) -> int:
    try:
        site, answer = asyncio.run(
            _ask(args.bootstrap, args.action, getattr(args, "group", ""), client_tls(args), args)
        )
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    except GeorepError as exc:
        print(f"georep: error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    if isinstance(answer, str):
        print(answer)
    elif isinstance(answer, pb.ListGroupsResponse):
        print(json.dumps(list_json(site, answer)) if args.json else render_list(site, answer))
    else:
        print(json.dumps(describe_json(site, answer)) if args.json else render_describe(site, answer))
    return 0
