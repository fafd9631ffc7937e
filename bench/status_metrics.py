"""Scrape and ``SiteStatus`` cost of one node against its partition count (issue 22, "Metrics").

Starts one standalone node (``--insecure``, no topology) from the code on ``PYTHONPATH``, creates one topic of
``--partitions`` partitions and writes one record to each, then times ``/metrics`` scrapes and ``SiteStatus``
answers (the default request, and every partition row). Run it once with ``PYTHONPATH`` on each tree to compare:

    PYTHONPATH=$PWD python bench/status_metrics.py --partitions 2000

A node keeps 3 files open per partition (until the storage bounds its handles), so ``ulimit -n`` caps the count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch

ROUNDS = 5


def start(data: Path, port: int, detail: bool) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "georep.cli", "node", "--site", "a", "--data-dir", str(data), "--insecure"]
    cmd += ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{port + 1}"]
    if detail:
        cmd.append("--metrics-partition-detail")
    log = (data.parent / "node.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(stub: pbg.NodeStub, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            stub.Health(pb.HealthRequest(), timeout=1)
            return
        except grpc.RpcError:
            time.sleep(0.2)
    raise SystemExit("the node did not answer within 60 s")


def scrape(port: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=60).read()
    took = time.perf_counter() - t0
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return took, series, len(text)


def status(stub: pbg.NodeStub, req: pb.SiteStatusRequest) -> tuple[float, int]:
    t0 = time.perf_counter()
    answer = stub.SiteStatus(req, timeout=60)
    return time.perf_counter() - t0, answer.ByteSize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partitions", type=int, default=2000)
    parser.add_argument("--port", type=int, default=25001, help="gRPC port; /metrics on the next one")
    parser.add_argument("--detail", action="store_true", help="start the node with --metrics-partition-detail")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="georep-status-metrics-"))
    node = start(root / "data", args.port, args.detail)
    out: dict[str, object] = {"partitions": args.partitions, "detail": args.detail}
    try:
        options = [("grpc.max_receive_message_length", 256 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{args.port}", options=options) as channel:
            stub = pbg.NodeStub(channel)
            wait_ready(stub)
            stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=args.partitions), timeout=600)
            record = encode_batch([RecordInput(key=None, value=b"x" * 100, headers=(), timestamp_ms=1_000)])
            for index in range(args.partitions):
                stub.Produce(pb.ProduceRequest(topic="big", partition=index, batch=record), timeout=30)
            scrapes = [scrape(args.port) for _ in range(ROUNDS)]
            out["scrape_s_median"] = round(statistics.median(s[0] for s in scrapes), 4)
            out["series"], out["scrape_bytes"] = scrapes[-1][1], scrapes[-1][2]
            default = [status(stub, pb.SiteStatusRequest()) for _ in range(ROUNDS)]
            out["status_default_s_median"] = round(statistics.median(s[0] for s in default), 4)
            out["status_default_bytes"] = default[-1][1]
            if "partitions" in pb.SiteStatusRequest.DESCRIPTOR.fields_by_name:  # before issue 22: every row always
                rows = [status(stub, pb.SiteStatusRequest(partitions=True)) for _ in range(ROUNDS)]
                out["status_all_rows_s_median"] = round(statistics.median(s[0] for s in rows), 4)
                out["status_all_rows_bytes"] = rows[-1][1]
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
