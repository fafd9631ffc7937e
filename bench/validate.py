"""What validating a batch before storing it costs (georep/record/validate.py), on one core, no I/O.

Run from the repository root::

    .venv/bin/python bench/validate.py            # a few seconds
    .venv/bin/python bench/validate.py --quick    # smoke run

For each record size and codec it times ``validate_batch`` on a batch of about ``--batch-bytes``, next to
``check_batch`` (framing and CRC-32C only: what the broker did before issue 20), and prints MB/s of batch bytes,
records/s, and the time per record the walk adds. Best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from georep.record.batch import RecordInput, check_batch, encode_batch
from georep.record.compression import Compression
from georep.record.validate import validate_batch

LIMIT = 64 << 20
TS = 1_700_000_000_000


def best_seconds(fn: Callable[[], object], runs: int, min_seconds: float) -> float:
    """The best time of one call over ``runs`` runs, each repeating ``fn`` for at least ``min_seconds``."""
    best = float("inf")
    for _ in range(runs):
        n = 0
        started = time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / n)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-bytes", type=int, default=1 << 20, help="batch size to build (default 1 MiB)")
    parser.add_argument("--record-sizes", default="100,1024,16384", help="value sizes (default 100,1024,16384)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept (default 3)")
    parser.add_argument("--quick", action="store_true", help="one short run each")
    args = parser.parse_args(argv)
    runs, min_seconds = (1, 0.05) if args.quick else (args.repeats, 0.5)
    print(
        f"{'value':>7} {'codec':>5} {'records':>8} {'check MB/s':>11} {'validate MB/s':>14} {'records/s':>11} "
        f"{'walk ns/record':>15}"
    )
    for value_bytes in (int(v) for v in args.record_sizes.split(",")):
        count = max(1, args.batch_bytes // (value_bytes + 30))
        records = [RecordInput(b"key-%d" % i, os.urandom(value_bytes), (), TS + i) for i in range(count)]
        for codec in Compression:
            batch = encode_batch(records, compression=codec)
            check = best_seconds(lambda b=batch: check_batch(b), runs, min_seconds)  # type: ignore[misc]
            full = best_seconds(lambda b=batch: validate_batch(b, LIMIT), runs, min_seconds)  # type: ignore[misc]
            size = len(encode_batch(records))  # MB/s of the uncompressed batch, for every codec
            print(
                f"{value_bytes:>7} {codec.name.lower():>5} {count:>8} {size / check / 1e6:>11,.0f} "
                f"{size / full / 1e6:>14,.0f} {count / full:>11,.0f} {(full - check) / count * 1e9:>15,.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
