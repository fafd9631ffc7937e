"""``georep group reset-offsets`` and ``georep group delete``: kafka-consumer-groups.sh's two writes.

Both are refused while the group has active members at the site asked (stop the consumers first, as Kafka
requires); the node refuses them too (``GroupNotEmpty``, and a commit without a member id while the group has
members), so a consumer that joins between the check and the write is not overridden.

A position is a vector (``offsets/``), the same at every site: ``--to-earliest`` is the empty vector (every
retained record), ``--to-latest`` and ``--to-datetime`` are the vectors of what lies below the partition's end or
below the first record at or after that time (``ListOffsets`` answers the vector with the offset), and
``--to-vector`` is given. The new positions are commits (member id empty, generation -1) and a delete is a
tombstone commit: both replicate to every site and win by their stamps (``offsets/commits.py``), so georep's
consumers and Kafka consumers at any site resume from them.

The plan (partition, old position, new position) is printed first; ``--dry-run`` stops there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import grpc

from georep.client.connection import Connection
from georep.client.errors import GeorepError, InvalidRequest, Operation, UnknownGroup, from_rpc_error
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_from_proto, vector_to_proto
from offsets.vector import InvalidVectorOffset, VectorOffset

TIMEOUT_S = 10.0


class GroupActive(GeorepError):
    """The group has active members: its positions are theirs to move."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where ``--to-*`` says to go: ``kind`` is earliest, latest, datetime or vector."""

    kind: str
    timestamp_ms: int = 0
    vectors: dict[int, VectorOffset] | None = None  # --to-vector: per partition (None key: every partition)
    every: VectorOffset | None = None


def add_arguments(actions: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    reset = actions.add_parser("reset-offsets", help="move an inactive group's positions of a topic")
    reset.add_argument("group")
    reset.add_argument("--topic", required=True, metavar="TOPIC[:P,P...]", help="the topic (and partitions) to reset")
    to = reset.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="every retained record again")
    to.add_argument("--to-latest", action="store_true", help="only records written from now on")
    to.add_argument("--to-datetime", metavar="ISO", help="the first record at or after this time (ISO 8601)")
    to.add_argument("--to-vector", metavar="JSON", help='a vector for every partition, or {"0": "a@1:10", ...}')
    reset.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    reset.add_argument("--execute", action="store_true", help="kafka-consumer-groups.sh's spelling: the default")
    delete = actions.add_parser("delete", help="delete an inactive group's committed positions at every site")
    delete.add_argument("group")
    common(reset)
    common(delete)


def parse_topic(text: str) -> tuple[str, list[int] | None]:
    """``orders`` or ``orders:0,2`` (kafka-consumer-groups.sh's spelling)."""
    name, _, parts = text.partition(":")
    if not parts:
        return name, None
    try:
        return name, sorted({int(p) for p in parts.split(",")})
    except ValueError:
        raise InvalidRequest(f"--topic {text!r}: partitions are numbers, as in 'orders:0,2'") from None


def parse_target(args: argparse.Namespace) -> Target:
    if args.to_earliest:
        return Target("earliest")
    if args.to_latest:
        return Target("latest")
    if args.to_datetime is not None:
        try:
            when = datetime.fromisoformat(args.to_datetime)
        except ValueError:
            raise InvalidRequest(f"--to-datetime {args.to_datetime!r}: use ISO 8601, as 2026-11-28T09:00:00Z") from None
        if when.tzinfo is None:
            raise InvalidRequest(f"--to-datetime {args.to_datetime!r}: give a time zone, as 2026-11-28T09:00:00Z")
        return Target("datetime", timestamp_ms=int(when.timestamp() * 1000))
    return _vector_target(args.to_vector)


def _vector_target(text: str) -> Target:
    try:
        doc = json.loads(text)
        if isinstance(doc, str):
            return Target("vector", every=VectorOffset.parse(doc))
        if isinstance(doc, dict):
            return Target("vector", vectors={int(p): VectorOffset.parse(str(v)) for p, v in doc.items()})
    except (ValueError, InvalidVectorOffset) as exc:
        raise InvalidRequest(f"--to-vector: {exc}") from None
    raise InvalidRequest('--to-vector takes a JSON string ("a@1:10,b@3:7") or object ({"0": "a@1:10"})')


def render_plan(group: str, topic: str, rows: Sequence[tuple[int, VectorOffset | None, VectorOffset]]) -> str:
    lines = [f"GROUP {group}  TOPIC {topic}", "PARTITION  OLD-POSITION  NEW-POSITION"]
    for partition, old, new in rows:
        lines.append(f"{partition:<9}  {(old.to_text() or '-') if old else '-':<12}  {new.to_text() or '(earliest)'}")
    return "\n".join(lines)


Coordinated = Callable[[Connection, str, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]


async def _describe(connection: Connection, group: str, at: Coordinated, missing_ok: bool) -> pb.GroupDescription:
    """The group, refused if it has members; a reset of a group unknown here starts it (as Kafka's)."""
    try:
        d: pb.GroupDescription = await at(
            connection, group, lambda stub: stub.DescribeGroup(pb.DescribeGroupRequest(group=group), timeout=TIMEOUT_S)
        )
    except UnknownGroup:
        if not missing_ok:
            raise
        return pb.GroupDescription(group=group)
    if d.members:
        raise GroupActive(
            f"group {group!r} has {len(d.members)} active member(s) at site {connection.origin}: stop its consumers "
            "(or wait for their sessions to time out), then run this again"
        )
    return d


async def _ends(connection: Connection, topic: str, partitions: list[int], target: Target) -> dict[int, VectorOffset]:
    """Each partition's vector at the target, from the partition's leader (``ListOffsets``)."""
    if target.kind == "earliest":
        return {p: VectorOffset() for p in partitions}
    if target.kind == "vector":
        if target.every is not None:
            return {p: target.every for p in partitions}
        assert target.vectors is not None
        missing = sorted(set(partitions) - set(target.vectors))
        if missing:
            raise InvalidRequest(f"--to-vector names no vector for partition(s) {missing} of {topic}")
        return {p: target.vectors[p] for p in partitions}
    described: pb.TopicDescription = await connection.stub.DescribeTopic(
        pb.DescribeTopicRequest(name=topic), timeout=TIMEOUT_S
    )
    leaders = {lead.partition: lead.address for lead in described.leaders}
    spec = {"timestamp_ms": target.timestamp_ms} if target.kind == "datetime" else {"position": pb.START_LATEST}
    out: dict[int, VectorOffset] = {}
    for p in partitions:
        address = leaders.get(p, "") or connection.address
        node = connection if address == connection.address else Connection(address, tls=connection.tls)
        try:
            stub = await node.connect()
            answer: pb.ListOffsetsResponse = await stub.ListOffsets(
                pb.ListOffsetsRequest(topic=topic, partition=p, **spec), timeout=TIMEOUT_S
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, address, operation=Operation.GROUP) from None
        finally:
            if node is not connection:
                await node.close()
        out[p] = vector_from_proto(answer.offsets[0].vector)
    return out


async def reset(connection: Connection, args: argparse.Namespace, at: Coordinated) -> str:
    topic, chosen = parse_topic(args.topic)
    target = parse_target(args)
    d = await _describe(connection, args.group, at, missing_ok=True)
    described: pb.TopicDescription = await connection.stub.DescribeTopic(
        pb.DescribeTopicRequest(name=topic), timeout=TIMEOUT_S
    )
    partitions = chosen if chosen is not None else list(range(described.partitions))
    beyond = [p for p in partitions if not 0 <= p < described.partitions]
    if beyond:
        raise InvalidRequest(f"topic {topic} has {described.partitions} partitions: no partition {beyond}")
    old = {c.partition: vector_from_proto(c.vector) for c in d.offsets if c.topic == topic}
    new = await _ends(connection, topic, partitions, target)
    plan = render_plan(args.group, topic, [(p, old.get(p), new[p]) for p in partitions])
    if args.dry_run:
        return plan + "\n(dry run: nothing changed; run again without --dry-run to commit)"
    commits = [
        pb.PartitionCommit(topic=topic, partition=p, vector=vector_to_proto(new[p]), hint_offset=-1) for p in new
    ]
    request = pb.CommitOffsetsRequest(group=args.group, generation=-1, commits=commits, acks=pb.ACKS_ALL)
    await at(connection, args.group, lambda stub: stub.CommitOffsets(request, timeout=TIMEOUT_S))
    return plan + f"\ncommitted at site {connection.origin}"


async def delete(connection: Connection, args: argparse.Namespace, at: Coordinated) -> str:
    d = await _describe(connection, args.group, at, missing_ok=False)
    commits = [
        pb.PartitionCommit(topic=c.topic, partition=c.partition, deleted=True, hint_offset=-1) for c in d.offsets
    ]
    if commits:
        request = pb.CommitOffsetsRequest(group=args.group, generation=-1, commits=commits, acks=pb.ACKS_ALL)
        await at(connection, args.group, lambda stub: stub.CommitOffsets(request, timeout=TIMEOUT_S))
    return f"deleted group {args.group!r}: {len(commits)} committed position(s), at every site its commits reach"
