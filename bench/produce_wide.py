"""Produce to one node at many partitions: keyless (sticky partitioner) against explicit round-robin partitions.

Run from the repository root::

    .venv/bin/python bench/produce_wide.py --partitions 100,10000 --records 200000
    .venv/bin/python bench/produce_wide.py --partitions 10000 --only round-robin --py-spy /tmp/wide

One standalone node (``--insecure``) per run, one topic of P partitions, ``--records`` records of 100 bytes from
``georep.client.Producer`` (acks=leader, ``--linger-ms``). Keyless records fill whole batches at any width, so
their rate shows what the partitions that exist cost; round-robin records make batches of about
``records_in_a_linger / P`` records, so their rate is the per-batch rate (docs/design.md, "Scale").

Besides the rate, each row gives the node's and this process's CPU seconds over the produce (``/proc/PID/stat``
and ``time.process_time``) and the node's CPU microseconds per record: on a shared machine the rate moves with
the load, the CPU per record much less. ``--py-spy DIR`` records the node and this process with py-spy during
each produce (``DIR/<partitions>-<shape>-<node|client>.txt``, raw stacks) and prints their top functions
(bench/pyspy_top.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from pyspy_top import print_top, recording

from georep.client.admin import Admin
from georep.client.producer import Producer
from tests.support.sites import Sites

VALUE = b"x" * 100
CLK_TCK = os.sysconf("SC_CLK_TCK")
SHAPES = ("keyless", "round-robin")
CREATE_TIMEOUT_MS = 600_000


@dataclass
class Result:
    rate: float
    node_cpu_s: float
    client_cpu_s: float


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def produce(address: str, partitions: int, records: int, sticky: bool, linger_ms: float) -> float:
    async with Producer(address, linger_ms=linger_ms) as producer:
        start = time.monotonic()
        for i in range(records):
            producer.send("t", VALUE, partition=None if sticky else i % partitions)
            if i % 10_000 == 0:
                await producer.wait_for_buffer()
        await producer.flush()
        return records / (time.monotonic() - start)


async def run(partitions: int, records: int, sticky: bool, linger_ms: float, spy: Path | None) -> Result:
    with tempfile.TemporaryDirectory(prefix="georep-wide-") as tmp:
        sites = Sites(Path(tmp), ["a"], [])
        sites.start()
        try:
            address = sites.address("a")
            async with Admin(address, request_timeout_ms=CREATE_TIMEOUT_MS) as admin:
                await admin.create_topic("t", partitions)
            pid = sites.nodes["a"].pid
            prefix = f"{partitions}-{'keyless' if sticky else 'round-robin'}"
            spied = {} if spy is None else {spy / f"{prefix}-node.txt": pid, spy / f"{prefix}-client.txt": os.getpid()}
            with recording(spied):  # nothing recorded without --py-spy
                node_before, client_before = cpu_seconds(pid), time.process_time()
                rate = await produce(address, partitions, records, sticky, linger_ms)
                return Result(rate, cpu_seconds(pid) - node_before, time.process_time() - client_before)
        finally:
            sites.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="100,10000", help="partition counts, comma-separated")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--linger-ms", type=float, default=5.0)
    parser.add_argument("--only", choices=SHAPES, help="run one shape only")
    parser.add_argument("--py-spy", type=Path, metavar="DIR", help="record the node with py-spy into DIR")
    args = parser.parse_args()
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    print(f"{'partitions':>10} {'shape':>12} {'rec/s':>9} {'node cpu s':>10} {'node us/rec':>11} {'client cpu s':>12}")
    for p in (int(x) for x in args.partitions.split(",")):
        for shape in SHAPES if args.only is None else (args.only,):
            r = asyncio.run(run(p, args.records, shape == "keyless", args.linger_ms, args.py_spy))
            per_record_us = 1e6 * r.node_cpu_s / args.records
            print(
                f"{p:>10} {shape:>12} {r.rate:>9,.0f} {r.node_cpu_s:>10.1f} {per_record_us:>11.1f} "
                f"{r.client_cpu_s:>12.1f}  (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            if args.py_spy is not None:
                for who in ("node", "client"):
                    print_top(args.py_spy / f"{p}-{shape}-{who}.txt", who)
    return 0


if __name__ == "__main__":
    sys.exit(main())
