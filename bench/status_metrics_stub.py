"""The /metrics collector and the SiteStatus answer in-process over N stub partition logs.

A node keeps 3 files open per partition until its file handles are bounded, so ``ulimit -n`` stops a real node
near 6,000 partitions; this runs the node's own collector and ``SiteStatus`` code over stub logs instead::

    PYTHONPATH=$PWD python bench/status_metrics_stub.py 10000 [--detail]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from prometheus_client import generate_latest

from georep.server.metrics import NodeMetrics
from offsets.coordinates import Origin
from topology.ids import SiteId

ROUNDS = 5


class StubLog:
    log_end_offset = 10
    log_start_offset = 0
    size_bytes = 1_500
    segment_count = 1
    flushed_offset = 10
    damage_found_total = 0
    repaired_total = 0

    def vector(self) -> dict[Origin, int]:
        return {Origin(SiteId("a"), 1): 5, Origin(SiteId("b"), 1): 5}

    def damaged_batches(self) -> list[object]:
        return []


def best_of(run: object) -> float:
    assert callable(run)
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("partitions", type=int)
    parser.add_argument("--detail", action="store_true", help="as georep node --metrics-partition-detail")
    args = parser.parse_args()
    parts = {("big", i): SimpleNamespace(log=StubLog()) for i in range(args.partitions)}
    broker = SimpleNamespace(
        partitions=parts, disk_full=False, on_produce=None, identity=SimpleNamespace(site="a", epoch=1)
    )
    metrics = NodeMetrics(broker)  # type: ignore[arg-type]
    if args.detail:
        metrics.partition_detail = True
    text = generate_latest(metrics.registry)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    took = best_of(lambda: generate_latest(metrics.registry))
    print(f"partitions={args.partitions} detail={args.detail} scrape={took:.4f}s series={series} bytes={len(text)}")
    try:
        from georep.proto import georep_pb2 as pb
        from georep.server import site_status
    except ImportError:  # a tree before issue 22
        return
    request = pb.SiteStatusRequest()
    answer = site_status.answer(broker, None, request).SerializeToString()  # type: ignore[arg-type]
    took = best_of(lambda: site_status.answer(broker, None, request))  # type: ignore[arg-type]
    print(f"SiteStatus default: {took:.4f}s, {len(answer)} bytes")


if __name__ == "__main__":
    main()
