"""``georep topic create|list|describe|alter|add-partitions|delete`` and ``georep health``: the admin client's
commands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from georep.cli.output import EXIT_ERROR, err, table, topic_json
from georep.client.admin import Admin, NewTopic, TopicInfo
from georep.client.errors import InvalidRequest
from georep.client.tls_args import client_tls
from georep.metadata.kafka_config import InvalidConfig, to_georep
from topology.filters import is_internal

LIST_PAGES_MAX = 100_000  # 100 million topics at the smallest page: a bound, not a limit anyone meets


def _parse_config_items(items: Sequence[str]) -> dict[str, str]:
    """``--config KEY=VALUE`` items as given (the node checks an alter's names and values)."""
    config: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"invalid --config {item!r}: expected KEY=VALUE, for example retention.ms=3600000")
        config[key.strip()] = value.strip()
    return config


def _parse_config(items: Sequence[str]) -> dict[str, str]:
    """``--config KEY=VALUE`` items, with georep's keys or Kafka's names (``retention.ms``, ``segment.bytes``: see
    docs/kafka.md, "Config names"), as georep's keys. A min.insync.replicas is checked against the replication
    factor by the node, which knows the site's."""
    config = _parse_config_items(items)
    try:
        return to_georep(config, None)
    except InvalidConfig as exc:
        raise InvalidRequest(f"--config: {exc}") from None


async def cmd_topic_create(args: argparse.Namespace) -> int:
    config = _parse_config(args.config)
    if args.replication_factor is not None:
        config = _parse_config([*args.config, f"replication_factor={args.replication_factor}"])
    if len(args.name) > 1:
        return await _create_many(args, config)
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topic = await admin.create_topic(args.name[0], args.partitions, config)
    if args.json:
        print(json.dumps(topic_json(topic)))
    else:
        print(f"created topic {topic.name!r} with {topic.partitions} partitions")
    return 0


async def _create_many(args: argparse.Namespace, config: dict[str, str]) -> int:
    """The names in ``CreateTopics`` calls of 100: each topic created or refused on its own."""
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        results = await admin.create_topics([NewTopic(name, args.partitions, config) for name in args.name])
    refused = [r for r in results if r.error is not None]
    if args.json:
        print(json.dumps([{"name": r.name, "partitions": r.partitions, "error": _text(r.error)} for r in results]))
    else:
        for r in results:
            if r.error is None:
                print(f"created topic {r.name!r} with {r.partitions} partitions")
        for r in refused:
            err(f"error: topic {r.name!r} not created: {r.error}")
        print(f"created {len(results) - len(refused)} of {len(results)} topics")
    return EXIT_ERROR if refused else 0


async def cmd_topic_alter(args: argparse.Namespace) -> int:
    """Set (``--config``) or reset (``--delete-config``) config keys; the change replicates, last writer winning."""
    config = _parse_config_items(args.config)
    if not config and not args.delete_config:
        raise InvalidRequest("nothing to change: give --config KEY=VALUE or --delete-config KEY")
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topic = await admin.alter_topic(args.name, config, args.delete_config, validate_only=args.validate_only)
    if args.json:
        print(json.dumps(topic_json(topic)))
    else:
        done = "would change" if args.validate_only else "changed"
        what = [f"{k}={v}" for k, v in sorted(config.items())] + [f"{k} (default)" for k in args.delete_config]
        print(f"{done} topic {topic.name!r}: {', '.join(what)}")
    return 0


async def cmd_topic_add_partitions(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        topic = await admin.add_partitions(args.name, args.partitions, validate_only=args.validate_only)
    if args.json:
        print(json.dumps(topic_json(topic)))
    elif args.validate_only:
        print(f"topic {topic.name!r} has {topic.partitions} partitions and can grow to {args.partitions}")
    else:
        print(f"topic {topic.name!r} now has {topic.partitions} partitions")
    return 0


async def cmd_topic_delete(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        incarnation = await admin.delete_topic(args.name, validate_only=args.validate_only)
    if args.json:
        print(json.dumps({"name": args.name, "incarnation": incarnation, "deleted": not args.validate_only}))
    elif args.validate_only:
        print(f"topic {args.name!r} (incarnation {incarnation}) can be deleted")
    else:
        print(f"deleted topic {args.name!r} (incarnation {incarnation}): every site its links reach removes it")
    return 0


def _text(error: Exception | None) -> str | None:
    return None if error is None else str(error)


async def cmd_topic_list(args: argparse.Namespace) -> int:
    """Every topic by name, a page per call; with ``--limit``, at most that many and the token to go on from."""
    if args.limit is not None and args.limit <= 0:
        raise InvalidRequest(f"--limit {args.limit}: list at least one topic")
    if args.page_size <= 0:
        raise InvalidRequest(f"--page-size {args.page_size}: ask for at least one topic per call")
    topics: list[TopicInfo] = []
    token = args.page_token
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        for _ in range(LIST_PAGES_MAX):
            wanted = args.page_size if args.limit is None else min(args.page_size, args.limit - len(topics))
            page = await admin.list_topics_page(wanted, token)
            topics += [t for t in page.topics if args.internal or not is_internal(t.name)]
            if not page.next_page_token or page.next_page_token == token:
                token = ""
                break
            token = page.next_page_token
            if args.limit is not None and len(topics) >= args.limit:
                break
    if args.json:
        print(json.dumps([topic_json(t, summary=True) for t in topics]))
    elif topics:
        print(table(("TOPIC", "PARTITIONS", "RECORDS"), [(t.name, t.partitions, t.records) for t in topics]))
    elif not token:
        print("no topics (create one with 'georep topic create NAME --partitions N')")
    if token:
        err(f"more topics follow: go on with 'georep topic list --page-token {token}'")
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
