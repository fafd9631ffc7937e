"""The storage cost of an append when batches go to many partitions in turn (issue 22), without a node.

Run from the repository root::

    .venv/bin/python bench/storage_wide.py --partitions 100,10000 --appends 100000

For each partition count P: P ``SegmentLog``s in a temporary directory under one handle cache of
``--max-open-files``, then ``--appends`` one-record batches of 100 bytes, partition after partition (round-robin,
LRU's worst case once P segments exceed the cache). Every ``--flush-every`` appends the logs written since the last
flush are flushed together with one ``syncfs`` (``flush_together``, as the node's group flush does), so segments
are clean by the time the cache evicts them, as at ``acks=leader``. Then a checkpoint (``enforce_retention``) of
every log, as the node's retention run does.

Each row gives this process's CPU microseconds (``time.process_time``: user and system) per append (the
``append`` call alone: the batch is built outside the clock), of the grouped flushes per append, and of one
partition's checkpoint; the peak of descriptors the logs held, and how many segments the handle cache opened.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.storage.handle_cache import HANDLES, set_max_open_files
from georep.storage.segment_log import SegmentLog, flush_together
from tests.support.segments import A, make_batch, open_log

VALUE = b"x" * 100


@dataclass
class Row:
    append_us: float  # CPU per append, the append alone
    flush_us: float  # CPU of the grouped flushes, per append
    checkpoint_us: float  # CPU of one partition's checkpoint (enforce_retention) after the produce
    peak_fds: int  # descriptors open beyond those before the logs opened
    cache_opens: int  # segments the handle cache opened during the produce


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(partitions: int, appends: int, flush_every: int, root: Path) -> Row:
    base_fds = open_fds()
    logs = [open_log(root / f"t-{i}") for i in range(partitions)]
    seqs = [0] * partitions
    fs_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    peak = 0
    opened = HANDLES.opened_total
    written: list[SegmentLog] = []
    in_append = in_flush = 0.0
    for n in range(appends):
        i = n % partitions
        batch = make_batch(A, seqs[i], [VALUE])  # outside the clock: the broker gets it parsed
        seqs[i] += 1
        start = time.process_time()
        logs[i].append(batch.header, batch.body, 10_000 + n)
        in_append += time.process_time() - start
        written.append(logs[i])
        if len(written) >= flush_every or n == appends - 1:
            start = time.process_time()
            flush_together(written, fs_fd)
            in_flush += time.process_time() - start
            written.clear()
            peak = max(peak, open_fds() - base_fds)
    opened = HANDLES.opened_total - opened
    start = time.process_time()
    for log in logs:
        log.enforce_retention(now_ms=int(time.time() * 1000))
    per_checkpoint = (time.process_time() - start) / partitions * 1e6
    for log in logs:
        log.close()
    os.close(fs_fd)
    return Row(in_append / appends * 1e6, in_flush / appends * 1e6, per_checkpoint, peak, opened)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="100,10000", help="partition counts, comma-separated")
    parser.add_argument("--appends", type=int, default=100_000)
    parser.add_argument("--flush-every", type=int, default=200, help="appends per grouped flush (one syncfs)")
    parser.add_argument("--max-open-files", type=int, default=1000)
    args = parser.parse_args()
    set_max_open_files(args.max_open_files)
    print(
        f"{'partitions':>10} {'us/append':>10} {'flush us/append':>16} {'us/checkpoint':>14} "
        f"{'peak fds':>9} {'opens':>8}"
    )
    for partitions in (int(p) for p in args.partitions.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            r = run(partitions, args.appends, args.flush_every, Path(tmp))
        load = os.getloadavg()[0]
        print(
            f"{partitions:>10,} {r.append_us:>10.1f} {r.flush_us:>16.1f} {r.checkpoint_us:>14.1f} {r.peak_fds:>9,} "
            f"{r.cache_opens:>8,}  (load {load:.1f})"
        )


if __name__ == "__main__":
    main()
