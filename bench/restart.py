"""Restart after kill -9 of one node with many partitions: open files, RSS, and time until it serves again.

Run from the repository root (it uses the checkout it runs from)::

    .venv/bin/python bench/restart.py --partitions 1000
    .venv/bin/python bench/restart.py --partitions 10000 --max-open-files 1000

One standalone node (plaintext, ephemeral port) under a temporary directory that is removed on exit. It creates
one topic of ``--partitions`` partitions, produces one small batch (acks=leader, fsync per batch) to each, and
reports the node's open files (/proc/PID/fd) and RSS. Then it kills the node with SIGKILL, starts it again on
the same data dir, and reports the time until ``Health`` answers and a ``Fetch`` of a written partition returns
its records (what ``bench/scale.py``'s ``restart_s`` measures), and until every partition has answered a
``ListOffsets`` and a ``Fetch`` of its records; then the open files and RSS again. Last, a clean stop: the time
from SIGTERM until the node exits (every log fsynced, the recovery points written), and the time a start after it
takes to serve again. ``--max-open-files 0`` leaves the node's flag out (for a build that does not have it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.proto import georep_pb2 as pb
from georep.server.process import NodeProcess
from tests.support.node_api import batch, fetch_all, log_end, stub_for


def fds_and_rss(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, rss_kb // 1024


def clean_stop(node: NodeProcess, partitions: int, ends: dict[int, int]) -> None:
    """SIGTERM the node, time its exit, then start it again and time until a written partition serves."""
    started = time.monotonic()
    code = node.stop(timeout_s=600)
    print(f"clean stop (SIGTERM to exit, status {code}): {time.monotonic() - started:.2f} s")
    started = time.monotonic()
    node.start(timeout_s=600)
    channel, stub = stub_for(node)
    stub.Health(pb.HealthRequest(), timeout=600)
    assert fetch_all(stub, "big", partitions - 1, ends[partitions - 1])
    print(f"start after the clean stop: a written partition's Fetch after {time.monotonic() - started:.2f} s")
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--max-open-files", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="leave the killed node's data dir here (to profile)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="georep-restart-"))
    extra = ["--max-open-files", str(args.max_open_files)] if args.max_open_files else []
    node = NodeProcess(site="a", data_dir=root / "a", extra_args=extra)
    try:
        node.start(timeout_s=300)
        channel, stub = stub_for(node)
        started = time.monotonic()
        stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=args.partitions), timeout=600)
        print(f"create {args.partitions} partitions: {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        ends = {}
        for p in range(args.partitions):
            ends[p] = stub.Produce(pb.ProduceRequest(topic="big", partition=p, batch=batch(2)), timeout=60).base_offset
            ends[p] += 2
        print(f"produce one batch to each: {time.monotonic() - started:.1f} s")
        fds, rss = fds_and_rss(node.pid)
        print(f"before kill: open fds {fds}, RSS {rss} MB")
        channel.close()
        node.kill9()
        started = time.monotonic()
        node.start(timeout_s=600)
        channel, stub = stub_for(node)
        stub.Health(pb.HealthRequest(), timeout=600)
        health_s = time.monotonic() - started
        assert fetch_all(stub, "big", args.partitions - 1, ends[args.partitions - 1])
        first_fetch_s = time.monotonic() - started
        for p in range(args.partitions):
            assert log_end(stub, "big", p) == ends[p], p
            assert fetch_all(stub, "big", p, ends[p])
        served_s = time.monotonic() - started
        fds, rss = fds_and_rss(node.pid)
        print(
            f"restart: Health answers after {health_s:.2f} s, a written partition's Fetch after {first_fetch_s:.2f} s; "
            f"every partition fetched after {served_s:.2f} s"
        )
        print(f"after restart and a fetch of every partition: open fds {fds}, RSS {rss} MB")
        channel.close()
        clean_stop(node, args.partitions, ends)
        if args.keep is not None:
            node.kill9()
            shutil.copytree(root / "a", args.keep)
    finally:
        node.kill9()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
