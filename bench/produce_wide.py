"""Produce to one node at many partitions: keyless (sticky partitioner) against explicit round-robin partitions.

Run from the repository root::

    .venv/bin/python bench/produce_wide.py --partitions 100,5000 --records 200000

One standalone node (``--insecure``) per run, one topic of P partitions, ``--records`` records of 100 bytes from
``georep.client.Producer`` (acks=leader, ``--linger-ms``). Keyless records fill whole batches at any width, so
their rate shows what the partitions that exist cost; round-robin records make batches of about
``records_in_a_linger / P`` records, so their rate is the per-batch rate (docs/design.md, "Scale").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.client.admin import Admin
from georep.client.producer import Producer
from tests.support.sites import Sites

VALUE = b"x" * 100


async def run(partitions: int, records: int, sticky: bool, linger_ms: float) -> float:
    with tempfile.TemporaryDirectory(prefix="georep-wide-") as tmp:
        sites = Sites(Path(tmp), ["a"], [])
        sites.start()
        try:
            address = sites.address("a")
            async with Admin(address) as admin:
                await admin.create_topic("t", partitions)
            async with Producer(address, linger_ms=linger_ms) as producer:
                start = time.monotonic()
                for i in range(records):
                    producer.send("t", VALUE, partition=None if sticky else i % partitions)
                    if i % 10_000 == 0:
                        await producer.wait_for_buffer()
                await producer.flush()
                return records / (time.monotonic() - start)
        finally:
            sites.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="100,5000", help="partition counts, comma-separated")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--linger-ms", type=float, default=5.0)
    args = parser.parse_args()
    print(f"{'partitions':>10} {'keyless rec/s':>14} {'round-robin rec/s':>18}")
    for p in (int(x) for x in args.partitions.split(",")):
        sticky = asyncio.run(run(p, args.records, True, args.linger_ms))
        rr = asyncio.run(run(p, args.records, False, args.linger_ms))
        print(f"{p:>10} {sticky:>14,.0f} {rr:>18,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
