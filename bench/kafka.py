"""Kafka clients against the Kafka gateway, next to georep's own client, on the same node, in one run.

Run from the repository root::

    .venv/bin/python bench/kafka.py            # 50,000 records of 1 KiB per run, 2 runs each
    .venv/bin/python bench/kafka.py --quick    # 5,000 records, 1 run: a smoke run

One node (``--flush-interval-ms 100``, acks after the write like Kafka's defaults) serves both protocols. Each
run writes ``--records`` records of ``--value-bytes`` bytes to a fresh one-partition topic and reads them
back from the start:

* ``kafka produce``: confluent-kafka's ``Producer`` (librdkafka), ``acks=all``, idempotent,
  ``linger.ms=5``; the clock runs from the first ``produce`` to the end of ``flush``.
* ``georep produce``: ``georep.client.Producer``, ``acks=all``, the same records; until every future is done.
* ``kafka consume``: confluent-kafka's ``Consumer`` assigned the partition from offset 0, until it has every
  record.
* ``georep consume``: ``georep.client.Consumer`` assigned the partition from the earliest offset, likewise.

With ``--group-site``, one more row: ``kafka group consume (3-node site)``, a confluent-kafka consumer group
of two members subscribed to a three-partition topic of a 3-node site, settled (both members assigned) before
``--records`` records are produced there, then reading every record with auto-commit every second; the clock
runs from the first record delivered to the last. Its commits go to the group's coordinator, which
asks the leaders of the partitions it does not lead for their vectors (docs/kafka.md, "Multi-node sites").

The runs alternate (kafka, georep, kafka, georep ...) so a shared machine's noise falls on both; the summary
takes each one's best run and prints the ratios kafka / georep. What the gateway adds per batch: a Kafka
record batch v2 decoded and re-encoded as a georep batch on produce, and the reverse (plus two headers per
record) on fetch, in Python (docs/kafka.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from georep.server.process import NODE_INFO, NodeProcess


def kafka_produce(bootstrap: str, topic: str, records: int, value: bytes) -> float:
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "batch.size": 1 << 20,
            "queue.buffering.max.kbytes": 1 << 20,
        }
    )
    p.produce(topic, value=value)  # metadata and the producer id, before the clock
    p.flush(30)
    start = time.perf_counter()
    for _ in range(records - 1):
        while True:
            try:
                p.produce(topic, value=value)
                break
            except BufferError:
                p.poll(0.01)
    if p.flush(120) != 0:
        raise RuntimeError("confluent-kafka did not deliver every record within 120 s")
    return time.perf_counter() - start


def kafka_consume(bootstrap: str, topic: str, records: int) -> float:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{time.time_ns()}",
            "enable.auto.commit": False,
            "fetch.max.bytes": 16 << 20,
            "max.partition.fetch.bytes": 4 << 20,
        }
    )
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        got = 0
        start = time.perf_counter()
        deadline = start + 300
        while got < records and time.perf_counter() < deadline:
            for m in c.consume(1000, 1.0):
                if m.error() is None:
                    got += 1
        if got < records:
            raise RuntimeError(f"confluent-kafka read {got} of {records} records")
        return time.perf_counter() - start
    finally:
        c.close()


async def georep_produce(address: str, topic: str, records: int, value: bytes) -> float:
    from georep.client import Producer

    producer = Producer(address, acks="all", batch_size=1 << 20, linger_ms=5)
    await producer.start()
    try:
        await producer.send(topic, value, partition=0)
        futures = []
        start = time.perf_counter()
        for _ in range(records - 1):
            futures.append(producer.send(topic, value, partition=0))
            if producer.buffered_bytes > producer.buffer_memory:
                await producer.wait_for_buffer()
        await producer.flush()
        await asyncio.gather(*futures)
        return time.perf_counter() - start
    finally:
        await producer.close()


async def georep_consume(address: str, topic: str, records: int) -> float:
    from georep.client import Consumer

    consumer = Consumer(address, auto_offset_reset="earliest", max_bytes=4 << 20)
    await consumer.start()
    try:
        consumer.assign([(topic, 0)])
        got = 0
        start = time.perf_counter()
        deadline = start + 300
        while got < records and time.perf_counter() < deadline:
            got += len(await consumer.poll(timeout_ms=1000, max_records=10_000))
        if got < records:
            raise RuntimeError(f"georep's consumer read {got} of {records} records")
        return time.perf_counter() - start
    finally:
        await consumer.close()


def kafka_group_on_site(records: int, value: bytes) -> float:
    """Seconds for a two-member confluent-kafka group to read ``records`` records of a 3-node site (see the module
    docstring)."""
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.support.cluster_site import ClusterSite

    with tempfile.TemporaryDirectory(prefix="georep-bench-kafka-site-") as tmp:
        site = ClusterSite(Path(tmp), 3, extra_args=["--flush-interval-ms", "100"], kafka=True)
        site.start()
        try:
            bootstrap = ",".join(site.kafka_address(n) for n in (1, 2, 3))
            admin = AdminClient({"bootstrap.servers": bootstrap})
            admin.create_topics([NewTopic("grp", 3, 1)])["grp"].result(30)
            for i in range(3):
                site.wait_leader("grp", i)
            config = {
                "bootstrap.servers": bootstrap,
                "group.id": "bench",
                "auto.offset.reset": "earliest",
                "auto.commit.interval.ms": 1000,
                "heartbeat.interval.ms": 300,  # no rebalance barrier: the first member learns of the second sooner
                "fetch.max.bytes": 16 << 20,
                "max.partition.fetch.bytes": 4 << 20,
            }
            members = [Consumer({**config, "client.id": f"m{i}"}) for i in range(2)]
            for m in members:
                m.subscribe(["grp"])
            # The group settles (both members assigned) before the records come, so the clock times reading.
            settle = time.perf_counter() + 60
            while not all(m.assignment() for m in members) and time.perf_counter() < settle:
                for m in members:
                    m.consume(1, 0.1)
            kafka_produce(bootstrap, "grp", records, value)
            got, start = 0, 0.0
            deadline = time.perf_counter() + 300
            while got < records and time.perf_counter() < deadline:
                for m in members:
                    # a short wait: one member blocked on an empty queue would hold up the other
                    n = sum(1 for x in m.consume(1000, 0.01) if x.error() is None)
                    if n and not got:
                        start = time.perf_counter()
                    got += n
            elapsed = time.perf_counter() - start
            for m in members:
                m.close()
            if got < records:
                raise RuntimeError(f"the group read {got} of {records} records")
            return elapsed
        finally:
            site.close()


def create_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for name, future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).items():
        future.result(30)
        del name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000, help="records per run (default 50000)")
    parser.add_argument("--value-bytes", type=int, default=1024, help="record size (default 1024)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (default 2)")
    parser.add_argument("--quick", action="store_true", help="5000 records, 1 run")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--group-site", action="store_true", help="also a confluent-kafka group consuming on a 3-node site"
    )
    args = parser.parse_args()
    if args.quick:
        args.records, args.repeats = 5_000, 1
    value = b"x" * args.value_bytes
    with tempfile.TemporaryDirectory(prefix="georep-bench-kafka-") as tmp:
        node = NodeProcess(
            site="a",
            data_dir=Path(tmp) / "a",
            extra_args=["--kafka-listen", "127.0.0.1:0", "--flush-interval-ms", "100"],
        )
        node.start()
        try:
            bootstrap = json.loads((node.data_dir / NODE_INFO).read_text())["kafka"]
            results: dict[str, list[float]] = {
                k: [] for k in ("kafka produce", "georep produce", "kafka consume", "georep consume")
            }
            for run in range(args.repeats):
                kt, gt = f"k{run}", f"g{run}"
                create_topics(bootstrap, [kt, gt])
                results["kafka produce"].append(kafka_produce(bootstrap, kt, args.records, value))
                results["georep produce"].append(asyncio.run(georep_produce(node.address, gt, args.records, value)))
                results["kafka consume"].append(kafka_consume(bootstrap, kt, args.records))
                results["georep consume"].append(asyncio.run(georep_consume(node.address, gt, args.records)))
                print(
                    f"run {run + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results.items()),
                    flush=True,
                )
        finally:
            node.stop()
    if args.group_site:
        key = "kafka group consume (3-node site)"
        results[key] = [kafka_group_on_site(args.records, value) for _ in range(args.repeats)]
    mb = args.records * args.value_bytes / 1e6
    best = {k: min(v) for k, v in results.items()}
    summary: dict[str, Any] = {"records": args.records, "value_bytes": args.value_bytes, "repeats": args.repeats}
    print(f"\n{args.records} records of {args.value_bytes} B, best of {args.repeats}:")
    for k, s in best.items():
        summary[k] = {"seconds": round(s, 3), "records_s": round(args.records / s), "mb_s": round(mb / s, 1)}
        print(f"  {k:<34} {args.records / s:>10,.0f} records/s  {mb / s:>7.1f} MB/s")
    for what in ("produce", "consume"):
        ratio = best[f"georep {what}"] / best[f"kafka {what}"]
        summary[f"{what}_ratio_kafka_over_georep"] = round(ratio, 2)
        print(f"  {what}: the Kafka gateway with confluent-kafka runs at {ratio:.2f}x georep's own client")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
