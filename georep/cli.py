"""The ``georep`` command.

Client commands (``topic``, ``produce``, ``consume``, ``offsets``, ``health``)
take ``--bootstrap HOST:PORT[,HOST:PORT]`` (default: ``$GEOREP_BOOTSTRAP``,
else 127.0.0.1:7101). ``node`` and ``demo`` belong to the server and demo
modules; they are imported only when used.

Every georep error is one line, ``georep: error: <what to do>``, exit code 1.
Ctrl-C exits with 130, and a closed stdout (``| head``) ends quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from georep import __version__
from georep.client.admin import Admin, TopicInfo
from georep.client.connection import BOOTSTRAP_ENV, default_bootstrap
from georep.client.consumer import Consumer, ConsumerRecord
from georep.client.errors import GeorepError, InvalidRequest
from georep.client.producer import Producer, RecordMetadata
from offsets.commits import OFFSETS_TOPIC, is_internal
from offsets.vector import InvalidVectorOffset, VectorOffset

PROG = "georep"
STDIN_CHUNK_BYTES = 1 << 16
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Subcommands owned by other modules: name -> (module, help).
DELEGATED = {
    "node": ("georep.server.node", "run one storage node of a site"),
    "demo": ("georep.demo", "start a local multi-site demo"),
    "up": ("georep.up", "run every node of a topology on this machine, in the foreground"),
    "status": ("georep.status", "every site's vectors, links, routes and lag"),
    "link": ("georep.link_admin", "cut or heal one replication link"),
    "topology": ("topology.render", "topology show [FILE]: summary and picture of a topology"),
    "group": ("georep.group_admin", "list and describe consumer groups: members, assignments, commits, lag"),
    "drill": ("georep.drill", "run a DR drill against a running topology and report RPO, RTO and duplicates"),
    "audit": ("spark_jobs.audit", "Spark audit: do all sites hold the same data? (reads segment files)"),
    "delays": ("spark_jobs.delays", "Spark analytics: replication delay per path, origin and site, with plots"),
}


# --- output helpers -------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def _err(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _topic_json(topic: TopicInfo) -> dict[str, Any]:
    return {
        "name": topic.name,
        "partitions": topic.partitions,
        "config": topic.config,
        "partition_states": [
            {
                "partition": p.partition, "log_start_offset": p.log_start_offset,
                "log_end_offset": p.log_end_offset, "size_bytes": p.size_bytes, "segments": p.segments,
                "vector": p.vector.to_text(),
            }
            for p in topic.partition_states
        ],
    }  # fmt: skip


# --- topic ---------------------------------------------------------------------


def _parse_config(items: Sequence[str]) -> dict[str, str]:
    config: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"invalid --config {item!r}: expected KEY=VALUE, for example retention_ms=3600000")
        config[key.strip()] = value.strip()
    return config


async def cmd_topic_create(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap) as admin:
        topic = await admin.create_topic(args.name, args.partitions, _parse_config(args.config))
    if args.json:
        print(json.dumps(_topic_json(topic)))
    else:
        print(f"created topic {topic.name!r} with {topic.partitions} partitions")
    return 0


async def cmd_topic_list(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap) as admin:
        topics = [t for t in await admin.list_topics() if args.internal or not is_internal(t.name)]
    if args.json:
        print(json.dumps([_topic_json(t) for t in topics]))
        return 0
    rows = [(t.name, t.partitions, sum(p.log_end_offset - p.log_start_offset for p in t.partition_states))
            for t in topics]  # fmt: skip
    if rows:
        print(_table(("TOPIC", "PARTITIONS", "RECORDS"), rows))
    else:
        print("no topics (create one with 'georep topic create NAME --partitions N')")
    return 0


async def cmd_topic_describe(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap) as admin:
        topic = await admin.describe_topic(args.name)
    if args.json:
        print(json.dumps(_topic_json(topic)))
        return 0
    print(f"Topic: {topic.name}  Partitions: {topic.partitions}")
    if topic.config:
        print("Config: " + ", ".join(f"{k}={v}" for k, v in topic.config.items()))
    rows = [(p.partition, p.log_start_offset, p.log_end_offset, p.size_bytes, p.segments, p.vector.to_text() or "-")
            for p in topic.partition_states]  # fmt: skip
    print(_table(("PARTITION", "START", "END", "BYTES", "SEGMENTS", "VECTOR"), rows))
    return 0


# --- produce ---------------------------------------------------------------------


class _Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.failed = 0
        self.first_error: BaseException | None = None

    def __call__(self, future: asyncio.Future[RecordMetadata]) -> None:
        if future.cancelled():
            self.failed += 1
            return
        error = future.exception()
        if error is None:
            self.ok += 1
        else:
            self.failed += 1
            if self.first_error is None:
                self.first_error = error


async def cmd_produce(args: argparse.Namespace) -> int:
    separator = args.key_separator.encode() if args.key_separator else None
    producer = Producer(args.bootstrap, acks=args.acks, batch_size=args.batch_size, linger_ms=args.linger_ms,
                        compression=args.compression, request_timeout_ms=args.request_timeout_ms)  # fmt: skip
    stdin = sys.stdin.buffer
    loop = asyncio.get_running_loop()
    tally = _Tally()
    sent = 0
    started = time.monotonic()
    async with producer:
        await producer.partitions_for(args.topic)  # fail fast on an unknown topic
        tail = b""
        while True:
            chunk = await loop.run_in_executor(None, stdin.read1, STDIN_CHUNK_BYTES)
            if not chunk:
                lines = [tail] if tail else []
            else:
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
            for line in lines:
                key = None
                if separator is not None:
                    head, sep, rest = line.partition(separator)
                    if sep:
                        key, line = head, rest
                producer.send(args.topic, line, key=key, partition=args.partition).add_done_callback(tally)
                sent += 1
            if not chunk:
                break
            await producer.wait_for_buffer()
        await producer.flush()
    elapsed = time.monotonic() - started
    if tally.failed:
        reason = tally.first_error.message if isinstance(tally.first_error, GeorepError) else tally.first_error
        _err(f"error: {tally.failed} of {sent} records to {args.topic!r} failed: {reason}")
        return EXIT_ERROR
    rate = f" ({tally.ok / elapsed:,.0f} records/s)" if elapsed > 0 and tally.ok else ""
    _err(f"produced {tally.ok} records to {args.topic!r} in {elapsed:.2f}s{rate}")
    return 0


# --- consume ---------------------------------------------------------------------


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", "replace")


def _record_json(record: ConsumerRecord) -> str:
    return json.dumps({
        "key": _text(record.key),
        "value": _text(record.value),
        "partition": record.partition,
        "offset": record.offset,
        "origin": str(record.origin),
        "origin_seq": record.origin_seq,
        "timestamp": record.timestamp_ms,
    })  # fmt: skip


async def cmd_consume(args: argparse.Namespace) -> int:
    vector = None
    if args.vector is not None:
        try:
            vector = VectorOffset.parse(args.vector)
        except InvalidVectorOffset as exc:
            raise InvalidRequest(f"--vector: {exc}") from None
    if args.offset is not None and vector is not None:
        raise InvalidRequest("give either --offset or --vector, not both")
    if args.group is None and args.commit_acks is not None:
        raise InvalidRequest("--commit-acks needs --group: only a group commits its position")
    if args.group is not None and (args.partition is not None or args.offset is not None or vector is not None):
        raise InvalidRequest("--group starts at the group's committed vector: leave out --partition, --offset and "
                             "--vector (or leave out --group)")  # fmt: skip
    reset = "none" if args.offset is not None else "earliest"
    if args.group is not None:  # --from-beginning: where to start when the group has no commit
        reset = "earliest" if args.from_beginning else "latest"
    out = sys.stdout.buffer
    count = 0
    group = {} if args.group is None else {"group_id": args.group, "commit_acks": args.commit_acks or "leader"}
    async with Consumer(args.bootstrap, auto_offset_reset=reset, **group) as consumer, \
            Admin(args.bootstrap) as admin:  # fmt: skip
        topic = await admin.describe_topic(args.topic)
        if args.group is not None:
            partitions: list[int] = []  # the group's coordinator assigns them
        elif args.partition is not None:
            if not 0 <= args.partition < topic.partitions:
                raise InvalidRequest(f"partition {args.partition} does not exist: topic {args.topic!r} has "
                                     f"partitions 0..{topic.partitions - 1}")  # fmt: skip
            partitions = [args.partition]
        else:
            partitions = list(range(topic.partitions))
        if (args.offset is not None or vector is not None) and len(partitions) != 1:
            raise InvalidRequest("--offset and --vector name a position in one partition: add --partition P")
        tps = [(args.topic, p) for p in partitions]
        consumer.assign(tps)
        if args.group is not None:
            consumer.subscribe([args.topic])  # each partition starts at the group's commit, else per `reset`
        elif args.offset is not None:
            consumer.seek(tps[0], args.offset)
        elif vector is not None:
            consumer.seek_to_vector(tps[0], vector)
        elif args.from_beginning:
            consumer.seek_to_beginning()
        else:
            consumer.seek_to_end()
        last_record = time.monotonic()
        while args.max is None or count < args.max:
            wait_ms = 500.0
            if args.timeout is not None:
                left = args.timeout - (time.monotonic() - last_record)
                if left <= 0:
                    break
                wait_ms = min(wait_ms, left * 1000)
            want = 500 if args.max is None else min(500, args.max - count)
            records = await consumer.poll(timeout_ms=wait_ms, max_records=want)
            if not records:
                continue
            last_record = time.monotonic()
            if args.json:
                out.write("".join(_record_json(r) + "\n" for r in records).encode())
            else:
                out.write(b"".join((r.value or b"") + b"\n" for r in records))
            out.flush()
            count += len(records)
        if args.group is not None:
            # The final commit, here so that its failure is an error; then drop the partitions,
            # leaving close() (which commits too, but only logs a failure) nothing to commit again.
            try:
                await consumer.commit()
            finally:
                consumer.assign([])
    _err(f"consumed {count} records from {args.topic!r}")
    return 0


# --- offsets, health ---------------------------------------------------------------


async def cmd_offsets(args: argparse.Namespace) -> int:
    spec: str | int = args.time
    if args.time not in ("earliest", "latest"):
        try:
            spec = int(args.time)
        except ValueError:
            raise InvalidRequest(f"invalid --time {args.time!r}: use earliest, latest or a timestamp in ms") from None
    async with Admin(args.bootstrap) as admin:
        offsets = await admin.list_offsets(args.topic, -1 if args.partition is None else args.partition, spec)
    if args.json:
        print(json.dumps([{"partition": o.partition, "offset": o.offset, "timestamp": o.timestamp_ms}
                          for o in offsets]))  # fmt: skip
    else:
        print(_table(("PARTITION", "OFFSET", "TIMESTAMP"), [(o.partition, o.offset, o.timestamp_ms) for o in offsets]))
    return 0


async def cmd_health(args: argparse.Namespace) -> int:
    async with Admin(args.bootstrap) as admin:
        health = await admin.health()
    if args.json:
        print(json.dumps({"status": health.status, "site": health.site, "epoch": health.epoch,
                          "version": health.version, "uptime_ms": health.uptime_ms,
                          "disk_full": health.disk_full}))  # fmt: skip
    else:
        disk = "FULL" if health.disk_full else "ok"
        print(f"{health.status} site={health.site} origin={health.site}@{health.epoch} version={health.version} "
              f"uptime={health.uptime_ms / 1000:.1f}s disk={disk}")  # fmt: skip
    return 0 if health.status == "SERVING" and not health.disk_full else EXIT_ERROR


# --- the parser ----------------------------------------------------------------------


def _add_bootstrap(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap", default=default_bootstrap(), metavar="HOST:PORT[,HOST:PORT]",
        help=f"node(s) to connect to (default: ${BOOTSTRAP_ENV}, else 127.0.0.1:7101; now %(default)s)",
    )  # fmt: skip


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Geo-replicated append-only event logs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    topic = commands.add_parser("topic", help="create, list and describe topics")
    topic_commands = topic.add_subparsers(dest="topic_command", metavar="ACTION", required=True)
    create = topic_commands.add_parser("create", help="create a topic")
    create.add_argument("name")
    create.add_argument("--partitions", type=int, required=True, help="number of partitions (fixed for life)")
    create.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="topic config overrides")
    create.set_defaults(run=cmd_topic_create)
    listing = topic_commands.add_parser("list", help="list topics")
    listing.add_argument("--internal", action="store_true",
                         help=f"also list georep's internal topics ({OFFSETS_TOPIC}: committed offsets)")  # fmt: skip
    listing.set_defaults(run=cmd_topic_list)
    describe = topic_commands.add_parser("describe", help="partitions, offsets, vectors and config of a topic")
    describe.add_argument("name")
    describe.set_defaults(run=cmd_topic_describe)
    for sub in (create, listing, describe):
        _add_bootstrap(sub)
        sub.add_argument("--json", action="store_true", help="machine-readable output")

    produce = commands.add_parser("produce", help="send one record per stdin line")
    produce.add_argument("topic")
    produce.add_argument(
        "--key-separator",
        metavar="SEP",
        help="split each line at the first SEP into key and value (no SEP in a line: no key)",
    )
    produce.add_argument("--acks", default="leader", help="leader, all or geo:N (default leader)")
    produce.add_argument("--partition", type=_nonnegative, help="send every record to this partition")
    produce.add_argument("--batch-size", type=int, default=65536, help="batch size in bytes (default 65536)")
    produce.add_argument("--linger-ms", type=_positive_float, default=5, help="batch linger time (default 5)")
    produce.add_argument("--compression", default="none", choices=("none", "zstd", "lz4"))
    produce.add_argument("--request-timeout-ms", type=_positive, default=30_000, metavar="MS",
                         help="how long a batch may wait for its acks, geo:N included (default 30000)")  # fmt: skip
    produce.set_defaults(run=cmd_produce)
    _add_bootstrap(produce)

    consume = commands.add_parser("consume", help="print records, one per line")
    consume.add_argument("topic")
    consume.add_argument("--from-beginning", action="store_true", help="start at the earliest offset (default: end)")
    consume.add_argument("--max", type=_nonnegative, help="exit after N records")
    consume.add_argument("--timeout", type=_positive_float, metavar="S",
                         help="exit after S seconds without a new record")  # fmt: skip
    consume.add_argument("--json", action="store_true",
                         help="one JSON object per record: key, value, partition, offset, origin, origin_seq, "
                              "timestamp")  # fmt: skip
    consume.add_argument("--partition", type=_nonnegative, help="read only this partition")
    consume.add_argument("--offset", type=_nonnegative, help="start at this local offset (needs --partition)")
    consume.add_argument("--vector", metavar="TEXT",
                         help="start after what this vector offset covers, e.g. 'a@1:10,b@3:0'")  # fmt: skip
    consume.add_argument("--group", metavar="G",
                         help="read as a member of consumer group G: continue at its committed vector, commit "
                              "every 5 s and on exit (--from-beginning: start at the earliest offset where G has "
                              "no commit)")  # fmt: skip
    consume.add_argument("--commit-acks", metavar="ACKS",
                         help="ack level of the group's commits: leader or geo:N (default leader)")  # fmt: skip
    consume.set_defaults(run=cmd_consume)
    _add_bootstrap(consume)

    offsets = commands.add_parser("offsets", help="earliest, latest or by-time offsets per partition")
    offsets.add_argument("topic")
    offsets.add_argument("--time", default="latest", help="earliest, latest or a timestamp in ms (default latest)")
    offsets.add_argument("--partition", type=_nonnegative)
    offsets.add_argument("--json", action="store_true")
    offsets.set_defaults(run=cmd_offsets)
    _add_bootstrap(offsets)

    health = commands.add_parser("health", help="is the node serving?")
    health.add_argument("--json", action="store_true")
    health.set_defaults(run=cmd_health)
    _add_bootstrap(health)

    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _run_delegated(name: str, argv: list[str]) -> int:
    module_name, help_text = DELEGATED[name]
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        _err(f"error: 'georep {name}' is not available in this build ({exc})")
        return EXIT_ERROR
    if name == "topology":
        if not argv or argv[0] != "show":
            _err("error: usage: georep topology show [FILE] [--output PICTURE] [--topic TOPIC]")
            return EXIT_USAGE
        from georep.status import live_link_states

        return int(module.main(argv[1:], live=live_link_states))
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=help_text)
    module.add_arguments(parser)
    code: int = module.main(parser.parse_args(argv))
    return code


def _quiet_stdout() -> None:
    # Python flushes stdout at exit and would raise again into the closed pipe.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in DELEGATED:
            return _run_delegated(args_list[0], args_list[1:])
        args = build_parser().parse_args(args_list)
        run: Callable[[argparse.Namespace], Any] = args.run
        return int(asyncio.run(run(args)))
    except GeorepError as exc:
        _err(f"error: {exc.message}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
