"""``georep topic create|list|describe`` and ``georep health``: the admin client's commands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from georep.cli.output import EXIT_ERROR, table, topic_json
from georep.cli.tls_args import client_tls
from georep.client.admin import Admin
from georep.client.errors import InvalidRequest
from topology.filters import is_internal


def _parse_config(items: Sequence[str]) -> dict[str, str]:
    config: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"invalid --config {item!r}: expected KEY=VALUE, for example retention_ms=3600000")
        config[key.strip()] = value.strip()
    return config


async def cmd_topic_create(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topic = await admin.create_topic(args.name, args.partitions, _parse_config(args.config))
    if args.json:
        print(json.dumps(topic_json(topic)))
    else:
        print(f"created topic {topic.name!r} with {topic.partitions} partitions")
    return 0


async def cmd_topic_list(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topics = [t for t in await admin.list_topics() if args.internal or not is_internal(t.name)]
    if args.json:
        print(json.dumps([topic_json(t) for t in topics]))
        return 0
    rows = [
        (t.name, t.partitions, sum(p.log_end_offset - p.log_start_offset for p in t.partition_states)) for t in topics
    ]
    if rows:
        print(table(("TOPIC", "PARTITIONS", "RECORDS"), rows))
    else:
        print("no topics (create one with 'georep topic create NAME --partitions N')")
    return 0


async def cmd_topic_describe(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topic = await admin.describe_topic(args.name)
    if args.json:
        print(json.dumps(topic_json(topic)))
        return 0
    print(f"Topic: {topic.name}  Partitions: {topic.partitions}")
    if topic.config:
        print("Config: " + ", ".join(f"{k}={v}" for k, v in topic.config.items()))
    rows = [
        (
            p.partition,
            p.log_start_offset,
            p.log_end_offset,
            p.size_bytes,
            p.segments,
            len(p.damaged),
            p.vector.to_text() or "-",
        )
        for p in topic.partition_states
    ]
    print(table(("PARTITION", "START", "END", "BYTES", "SEGMENTS", "DAMAGED", "VECTOR"), rows))
    for p in topic.partition_states:
        for text in p.damaged:
            print(
                f"partition {p.partition}: quarantined {text}; repaired from a peer's copy when one answers "
                "('georep scrub --now' checks every batch)"
            )
    return 0


async def cmd_health(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        health = await admin.health()
    if args.json:
        print(
            json.dumps(
                {
                    "status": health.status,
                    "site": health.site,
                    "epoch": health.epoch,
                    "version": health.version,
                    "uptime_ms": health.uptime_ms,
                    "disk_full": health.disk_full,
                }
            )
        )
    else:
        disk = "FULL" if health.disk_full else "ok"
        print(
            f"{health.status} site={health.site} origin={health.site}@{health.epoch} version={health.version} "
            f"uptime={health.uptime_ms / 1000:.1f}s disk={disk}"
        )
    return 0 if health.status == "SERVING" and not health.disk_full else EXIT_ERROR
