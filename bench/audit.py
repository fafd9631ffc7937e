"""Throughput of ``georep audit`` on local[2], and how its time grows with the data.

Run from the repository root::

    .venv/bin/python bench/audit.py                      # 1M, 3M and 10M records
    .venv/bin/python bench/audit.py --records 200k,1M    # quicker
    .venv/bin/python bench/audit.py --live               # live vs file mode on 3 running TLS sites (300k records)
    .venv/bin/python bench/audit.py --live --records 10M # the issue's size (bench/audit_live.py)

Each size is a fresh set of 3 sites (a, b, c) written straight through the
storage layer (``spark_jobs.sitegen``), every site holding every origin's
batches, so "records" counts every stored copy: 10M records are 3.33M
coordinates held at 3 sites. The audit runs in-process, in one SparkSession
started (and warmed on the smallest set) before the clock, exactly as
``georep audit`` runs it after its JVM start.

Absolute times on a shared machine are noisy; the same run also times two
references over the same files, so compare ratios:

* ``spark batch scan``: the georep source at batch level, ``sum(records)``:
  read, frame and CRC-check every byte; the floor of any Spark audit.
* ``spark record scan``: the georep source at record level, ``count()``:
  decode and hash every record in Python; what a record-by-record audit would
  pay before comparing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from spark_jobs.audit import run_audit
from spark_jobs.datasource import segments_option
from spark_jobs.layout import list_segments
from spark_jobs.session import spark_session
from spark_jobs.sitegen import SiteSpec, write_sites
from topology.model import default_topology

SITES = ["a", "b", "c"]
PARTITIONS = 4
BATCH_RECORDS = 500
SEGMENT_BYTES_MAX = 64 << 20
FAR_FUTURE_MS = 4_000_000_000_000
DEFAULT_RECORDS = "1M,3M,10M"
LIVE_DEFAULT_RECORDS = 300_000


def parse_count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def generate(root: Path, records: int) -> dict[str, Path]:
    per_origin = max(1, records // (len(SITES) * len(SITES) * PARTITIONS))
    spec = SiteSpec(
        topic="bench",
        partitions=PARTITIONS,
        records_per_origin=per_origin,
        batch_records=BATCH_RECORDS,
        value_bytes=40,
        segment_bytes_max=SEGMENT_BYTES_MAX,
    )
    return write_sites(root, SITES, spec)


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def measure(spark: Any, dirs: dict[str, Path], report: Path, repeats: int) -> dict[str, Any]:
    from pyspark.sql import functions as F

    segments = list_segments(dirs)
    listing = segments_option(segments)
    audit_s, result = min(
        (
            timed(lambda: run_audit(spark, default_topology(), dirs, segments, report, FAR_FUTURE_MS))
            for _ in range(repeats)
        ),
        key=lambda t: t[0],
    )
    assert result.clean, result.summary
    records = sum(t["records"] for t in result.report["sites"].values())
    batch_s, batch_sum = min(
        (
            timed(
                lambda: (
                    spark.read.format("georep")
                    .option("segments", listing)
                    .option("level", "batches")
                    .load()
                    .agg(F.sum("records"))
                    .first()[0]
                )
            )
            for _ in range(repeats)
        ),
        key=lambda t: t[0],
    )
    record_s, record_count = timed(lambda: spark.read.format("georep").option("segments", listing).load().count())
    assert batch_sum == record_count == records, (batch_sum, record_count, records)
    return {
        "records": records,
        "segments": len(segments),
        "bytes": sum(s.size_bytes for s in segments),
        "audit_s": audit_s,
        "batch_scan_s": batch_s,
        "record_scan_s": record_s,
    }


def live_main(args: argparse.Namespace, cores: int) -> int:
    import audit_live  # bench/audit_live.py, beside this script

    records = parse_count(args.records) if args.records != DEFAULT_RECORDS else LIVE_DEFAULT_RECORDS
    root = Path(tempfile.mkdtemp(prefix="georep-bench-audit-live-"))
    print(
        f"georep audit bench, live mode: master {args.master} ({cores} cores), {os.cpu_count()} cores on this machine, "
        f"load average {os.getloadavg()[0]:.1f}; {records:,} stored records on 3 sites (full size: "
        f".venv/bin/python bench/audit.py --live --records 10M)",
        flush=True,
    )
    try:
        spark = spark_session(args.master, "georep-bench-audit-live")
        warm = generate(root / "warm", 30_000)  # the JVM's first jobs are slow: not on the clock of either mode
        run_audit(spark, default_topology(), warm, list_segments(warm), root / "warm-report", FAR_FUTURE_MS)
        figures = audit_live.run(spark, root, records, cores)
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"master": args.master, "cores": cores, **figures}, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default=DEFAULT_RECORDS, help="comma-separated sizes, e.g. 1M,3M,10M or 200k")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size for the audit; the best counts")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--live",
        action="store_true",
        help="live mode against file mode on 3 running sites (bench/audit_live.py); --records: one size, "
        f"default {LIVE_DEFAULT_RECORDS:,}",
    )
    args = parser.parse_args()
    inside = args.master.removeprefix("local[").removesuffix("]")
    cores = int(inside) if inside.isdigit() else os.cpu_count() or 1
    if args.live:
        return live_main(args, cores)
    sizes = [parse_count(s) for s in args.records.split(",")]
    root = Path(tempfile.mkdtemp(prefix="georep-bench-audit-"))
    rows = []
    try:
        spark = spark_session(args.master, "georep-bench-audit")
        print(
            f"georep audit bench: master {args.master} ({cores} cores), {os.cpu_count()} cores on this machine; "
            f"3 sites x {PARTITIONS} partitions, {BATCH_RECORDS} records per batch",
            flush=True,
        )
        warm = generate(root / "warm", 30_000)
        run_audit(spark, default_topology(), warm, list_segments(warm), root / "warm-report", FAR_FUTURE_MS)
        for size in sizes:
            gen_s, dirs = timed(lambda size=size: generate(root / f"n{size}", size))
            row = measure(spark, dirs, root / f"report{size}", args.repeats)
            row["generate_s"] = gen_s
            rows.append(row)
            print(
                f"  {row['records']:>11,} records ({row['bytes'] / 1e6:,.0f} MB, {row['segments']} segments, "
                f"generated in {gen_s:.1f}s): audit {row['audit_s']:6.1f}s = "
                f"{row['records'] / row['audit_s']:>10,.0f} rec/s ({row['records'] / row['audit_s'] / cores:,.0f} "
                f"per core); batch scan {row['batch_scan_s']:.1f}s; record scan {row['record_scan_s']:.1f}s "
                f"= {row['records'] / row['record_scan_s']:,.0f} rec/s",
                flush=True,
            )
            shutil.rmtree(dirs["a"].parent)
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        size_ratio = hi["records"] / lo["records"]
        print(
            f"growth {lo['records']:,} -> {hi['records']:,} records (x{size_ratio:.1f}): audit time "
            f"x{hi['audit_s'] / lo['audit_s']:.2f}, batch scan x{hi['batch_scan_s'] / lo['batch_scan_s']:.2f}, "
            f"record scan x{hi['record_scan_s'] / lo['record_scan_s']:.2f} (x{size_ratio:.1f} is linear)"
        )
    for row in rows:
        print(
            f"  {row['records']:>11,}: audit / batch scan = {row['audit_s'] / row['batch_scan_s']:.2f}, "
            f"audit / record scan = {row['audit_s'] / row['record_scan_s']:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"master": args.master, "cores": cores, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
