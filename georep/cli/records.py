"""``georep produce``, ``georep consume`` and ``georep offsets``: records in and out, one per line."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from typing import cast

from georep.cli.output import EXIT_ERROR, err, table
from georep.client.admin import Admin
from georep.client.consumer import Consumer, ConsumerRecord
from georep.client.errors import GeorepError, InvalidRequest
from georep.client.producer import Producer, RecordMetadata
from georep.client.tls_args import client_tls
from offsets.vector import InvalidVectorOffset, VectorOffset

STDIN_CHUNK_BYTES = 1 << 16


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
    producer = Producer(
        args.bootstrap,
        tls=client_tls(args),
        acks=args.acks,
        batch_size=args.batch_size,
        linger_ms=args.linger_ms,
        compression=args.compression,
        request_timeout_ms=args.request_timeout_ms,
    )
    stdin = cast(io.BufferedReader, sys.stdin.buffer)
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
        err(f"error: {tally.failed} of {sent} records to {args.topic!r} failed: {reason}")
        return EXIT_ERROR
    rate = f" ({tally.ok / elapsed:,.0f} records/s)" if elapsed > 0 and tally.ok else ""
    err(f"produced {tally.ok} records to {args.topic!r} in {elapsed:.2f}s{rate}")
    return 0


# --- consume ---------------------------------------------------------------------


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", "replace")


def _record_json(record: ConsumerRecord) -> str:
    return json.dumps(
        {
            "topic": record.topic,
            "key": _text(record.key),
            "value": _text(record.value),
            "partition": record.partition,
            "offset": record.offset,
            "origin": str(record.origin),
            "origin_seq": record.origin_seq,
            "timestamp": record.timestamp_ms,
        }
    )


async def cmd_consume(args: argparse.Namespace) -> int:
    vector = _consume_checked(args)
    reset = "none" if args.offset is not None else "earliest"
    if args.group is not None:  # --from-beginning: where to start when the group has no commit
        reset = "earliest" if args.from_beginning else "latest"
    group = {} if args.group is None else {"group_id": args.group, "commit_acks": args.commit_acks or "leader"}
    tls = client_tls(args)
    async with (
        Consumer(
            args.bootstrap,
            tls=tls,
            auto_offset_reset=reset,
            skip_corrupt=args.skip_corrupt,
            read_from=args.read_from,
            prefer=args.prefer,
            **group,
        ) as consumer,
        Admin(args.bootstrap, tls=tls) as admin,
    ):
        await _consume_from(args, vector, consumer, admin)
        count = await _print_records(args, consumer)
        if args.group is not None:
            # The final commit, here so that its failure is an error; then drop the partitions,
            # leaving close() (which commits too, but only logs a failure) nothing to commit again.
            try:
                await consumer.commit()
            finally:
                consumer.assign([])
        for s in consumer.skipped:
            where = (
                f"offsets {s.first_offset}..{s.next_offset - 1}"
                if s.first_offset >= 0
                else f"up to offset {s.next_offset - 1}"
            )
            err(f"skipped {s.kind} records of {s.topic}/{s.partition}, {where}: {s.message}")
    damaged = sum(1 for s in consumer.skipped if s.kind == "damaged")
    invalid = len(consumer.skipped) - damaged
    err(
        f"consumed {count} records from {args.topic!r}"
        + (f", skipped {damaged} damaged range(s)" if damaged else "")
        + (f", skipped {invalid} invalid batch(es)" if invalid else "")
    )
    return 0


def _consume_checked(args: argparse.Namespace) -> VectorOffset | None:
    """``--vector`` parsed, once the flags are checked to go together."""
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
        raise InvalidRequest(
            "--group starts at the group's committed vector: leave out --partition, --offset and "
            "--vector (or leave out --group)"
        )
    if args.prefer is not None and args.read_from != "follower":
        raise InvalidRequest("--prefer names the node follower reads go to: add --read-from follower")
    return vector


def is_pattern(topic: str) -> bool:
    """A topic argument with a wildcard level (``orders/+``, ``orders/**``): every topic it matches is read."""
    return any(level in ("+", "**") for level in topic.split("/"))


def _consume_pattern(args: argparse.Namespace, vector: VectorOffset | None, consumer: Consumer) -> None:
    """Subscribe to every topic ``args.topic`` matches, now and created later (a group's or each partition's start
    as for one topic)."""
    if args.partition is not None or args.offset is not None or vector is not None:
        raise InvalidRequest(
            f"{args.topic!r} is a pattern: --partition, --offset and --vector name a position in one partition of "
            "one topic; leave them out, or name the topic"
        )
    consumer.subscribe(pattern=args.topic)
    if args.group is not None:
        return
    if args.from_beginning:
        consumer.seek_to_beginning()
    else:
        consumer.seek_to_end()


async def _consume_from(
    args: argparse.Namespace, vector: VectorOffset | None, consumer: Consumer, admin: Admin
) -> None:
    """Assign the partitions to read and put the consumer where the flags say it starts."""
    if is_pattern(args.topic):
        _consume_pattern(args, vector, consumer)
        return
    topic = await admin.describe_topic(args.topic)
    if args.group is not None:
        partitions: list[int] = []  # the group's coordinator assigns them
    elif args.partition is not None:
        if not 0 <= args.partition < topic.partitions:
            raise InvalidRequest(
                f"partition {args.partition} does not exist: topic {args.topic!r} has "
                f"partitions 0..{topic.partitions - 1}"
            )
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


async def _print_records(args: argparse.Namespace, consumer: Consumer) -> int:
    """Print records until ``--max`` of them, or ``--timeout`` seconds without one; how many."""
    out = sys.stdout.buffer
    count = 0
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
    return count


# --- offsets, health ---------------------------------------------------------------


async def cmd_offsets(args: argparse.Namespace) -> int:
    spec: str | int = args.time
    if args.time not in ("earliest", "latest"):
        try:
            spec = int(args.time)
        except ValueError:
            raise InvalidRequest(f"invalid --time {args.time!r}: use earliest, latest or a timestamp in ms") from None
    async with Admin(args.bootstrap, tls=client_tls(args)) as admin:
        offsets = await admin.list_offsets(args.topic, -1 if args.partition is None else args.partition, spec)
    if args.json:
        print(
            json.dumps([{"partition": o.partition, "offset": o.offset, "timestamp": o.timestamp_ms} for o in offsets])
        )
    else:
        print(table(("PARTITION", "OFFSET", "TIMESTAMP"), [(o.partition, o.offset, o.timestamp_ms) for o in offsets]))
    return 0
