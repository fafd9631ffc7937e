"""``georep delays``: replication delay per link path, origin and site, with plots.

The delay of a batch copy at site S is S's append time minus the append time
of the same batch (same origin, same seq range) at its origin site: both are
wall clocks of sites, and the origin's append time is when the record became
visible anywhere. When the origin site's data is not among the inputs, the
producer's timestamp (the batch's ``max_timestamp``) is the reference instead,
which also counts the producer's own delay; ``reference`` says which was used.
Append time is per batch, so every record of a batch has its batch's delay;
percentiles are weighted by records.

The path is the route the topology prefers for that origin, topic and site
(:class:`topology.routing.Router`, all links up), e.g. ``a->b->c``.

Writes to REPORT: ``delays.json`` (p50, p99, max per path, origin and site),
``delays_over_time.parquet`` (the same per time bucket), and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spark_jobs.audit import EXIT_CLEAN, EXIT_USAGE, add_input_arguments, resolve_inputs, site_logs
from spark_jobs.layout import AuditInputError, SegmentFile
from topology.model import Topology, UnknownSite
from topology.routing import Router

DELAYS_FILE = "delays.json"
OVER_TIME_DIR = "delays_over_time.parquet"
SUMMARY_PNG = "delays_summary.png"
OVER_TIME_PNG = "delays_over_time.png"
BUCKETS = 60
NICE_BUCKETS_MS = [
    10,
    50,
    100,
    250,
    500,
    1_000,
    5_000,
    10_000,
    30_000,
    60_000,
    300_000,
    900_000,
    3_600_000,
    21_600_000,
    86_400_000,
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--bucket-ms", type=int, help="width of the delay-over-time buckets (default: ~60 buckets)")


def route(router: Router, topic: str, origin_site: str, site: str) -> str:
    """``a->b->c``: the preferred chain of upstreams from the origin to ``site``; ``?`` hops when there is none."""
    hops = [site]
    for _ in range(len(router.topology.sites)):
        if hops[-1] == origin_site:
            break
        try:
            upstream = router.preferred_upstream(hops[-1], origin_site, topic)
        except UnknownSite:
            upstream = None
        if upstream is None:
            hops.append("?")
            break
        hops.append(upstream)
    return "->".join(reversed(hops))


def bucket_for(span_ms: int) -> int:
    for width in NICE_BUCKETS_MS:
        if span_ms / width <= BUCKETS:
            return width
    return NICE_BUCKETS_MS[-1]


def batch_delays(batches: Any) -> Any:
    """One row per replicated batch copy: site, origin, topic, records, delay_ms, reference, at_ms (origin time)."""
    from pyspark.sql import functions as F

    ok = batches.where(F.col("status") == "ok")
    at_origin = ok.where(F.col("site") == F.col("origin_site")).select(
        "topic", "partition", "origin", "base_seq", F.col("append_time_ms").alias("origin_append_ms")
    )
    copies = ok.where(F.col("site") != F.col("origin_site")).join(
        at_origin, ["topic", "partition", "origin", "base_seq"], "left"
    )
    reference = F.coalesce(F.col("origin_append_ms"), F.col("max_timestamp_ms"))
    return copies.select(
        "site",
        "origin",
        "origin_site",
        "topic",
        "records",
        (F.col("append_time_ms") - reference).alias("delay_ms"),
        F.when(F.col("origin_append_ms").isNotNull(), F.lit("origin_append"))
        .otherwise(F.lit("producer_timestamp"))
        .alias("reference"),
        reference.alias("at_ms"),
    )


def _percentiles(df: Any, keys: list[str]) -> Any:
    from pyspark.sql import functions as F

    p = F.percentile(F.col("delay_ms"), F.array(F.lit(0.5), F.lit(0.99)), F.col("records"))
    return df.groupBy(*keys).agg(
        F.sum("records").alias("records"),
        p.getItem(0).alias("p50_ms"),
        p.getItem(1).alias("p99_ms"),
        F.max("delay_ms").alias("max_ms"),
        F.min("delay_ms").alias("min_ms"),
    )


def run_delays(
    spark: Any, topology: Topology, segments: list[SegmentFile], report_dir: Path, bucket_ms: int | None = None
) -> dict[str, Any]:
    """Compute the delays, write ``report_dir`` (JSON, Parquet, PNGs) and return the JSON document."""
    from pyspark.sql import functions as F

    from spark_jobs.datasource import segments_option
    from spark_jobs.replicas import any_copies

    batches = (
        spark.read.format("georep").option("segments", segments_option(segments)).option("level", "batches").load()
    )
    if any_copies(segments):  # choosing a multi-node site's copies reads the batches before the delays do
        batches = batches.cache()
    log, _replica_issues, cached = site_logs(spark, batches, segments)  # a multi-node site's batches once each
    delays = batch_delays(log).cache()
    router = Router(topology)
    paths = [
        (r.topic, r.origin_site, r.site, route(router, r.topic, r.origin_site, r.site))
        for r in delays.select("topic", "origin_site", "site").distinct().collect()
    ]
    with_path = delays.join(
        spark.createDataFrame(paths, "topic string, origin_site string, site string, path string")
        if paths
        else delays.select("topic", "origin_site", "site").withColumn("path", F.lit("")),
        ["topic", "origin_site", "site"],
    )
    summary = [
        r.asDict()
        for r in _percentiles(with_path, ["path", "origin", "site", "reference"]).orderBy("origin", "site").collect()
    ]
    span = delays.agg(F.min("at_ms").alias("lo"), F.max("at_ms").alias("hi")).first()
    width = bucket_ms or bucket_for(int((span.hi or 0) - (span.lo or 0)))
    over_time = _percentiles(
        with_path.withColumn("bucket_ms", F.floor(F.col("at_ms") / width) * width), ["origin", "site", "bucket_ms"]
    ).orderBy("origin", "site", "bucket_ms")
    report_dir.mkdir(parents=True, exist_ok=True)
    over_time.coalesce(1).write.mode("overwrite").parquet(str(report_dir / OVER_TIME_DIR))
    series = [r.asDict() for r in over_time.collect()]
    for df in (delays, *cached, batches):
        df.unpersist()
    doc = {"format": 1, "bucket_ms": width, "delays": summary, "plots": [SUMMARY_PNG, OVER_TIME_PNG] if summary else []}
    (report_dir / DELAYS_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if summary:
        plot(summary, series, width, report_dir)
    return doc


def plot(summary: list[dict[str, Any]], series: list[dict[str, Any]], bucket_ms: int, report_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['path']}\n{r['origin']}" for r in summary]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4.5))
    xs = range(len(labels))
    for offset, key in ((-0.27, "p50_ms"), (0, "p99_ms"), (0.27, "max_ms")):
        ax.bar([x + offset for x in xs], [r[key] for r in summary], width=0.27, label=key.removesuffix("_ms"))
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("replication delay (ms)")
    ax.set_title("Replication delay per path (origin -> ... -> site)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(report_dir / SUMMARY_PNG, dpi=100)
    plt.close(fig)

    origins = sorted({r["origin"] for r in series})
    fig, axes = plt.subplots(len(origins), 1, figsize=(9, 2.8 * len(origins)), squeeze=False, sharex=True)
    t0 = min(r["bucket_ms"] for r in series)
    for ax, origin in zip(axes[:, 0], origins, strict=True):
        for site in sorted({r["site"] for r in series if r["origin"] == origin}):
            rows = [r for r in series if r["origin"] == origin and r["site"] == site]
            xs_s = [(r["bucket_ms"] - t0) / 1000 for r in rows]
            line = ax.plot(xs_s, [r["p99_ms"] for r in rows], marker=".", label=f"at {site}: p99")[0]
            ax.plot(xs_s, [r["p50_ms"] for r in rows], linestyle="--", color=line.get_color(), label=f"at {site}: p50")
        ax.set_title(f"records from origin {origin}", fontsize=9)
        ax.set_ylabel("delay (ms)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel(f"seconds since the first record (buckets of {bucket_ms} ms, by origin append time)")
    fig.tight_layout()
    fig.savefig(report_dir / OVER_TIME_PNG, dpi=100)
    plt.close(fig)


def summary_lines(doc: dict[str, Any], report_dir: Path) -> list[str]:
    lines = [f"{'PATH':<16} {'ORIGIN':<18} {'SITE':<6} {'RECORDS':>9} {'P50 MS':>8} {'P99 MS':>8} {'MAX MS':>8}  REF"]
    for r in doc["delays"]:
        lines.append(
            f"{r['path']:<16} {r['origin']:<18} {r['site']:<6} {r['records']:>9,} {r['p50_ms']:>8.0f} "
            f"{r['p99_ms']:>8.0f} {r['max_ms']:>8.0f}  {r['reference']}"
        )
    if not doc["delays"]:
        lines.append("no replicated batches: nothing to measure")
    lines.append(f"report: {report_dir / DELAYS_FILE}; plots: " + ", ".join(str(report_dir / p) for p in doc["plots"]))
    return lines


def main(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    try:
        topology, _dirs, segments = resolve_inputs(args.topology, args.data_root, args.site, args.topics)
    except AuditInputError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from spark_jobs.session import start_spark

    spark = start_spark(args.master, "georep-delays")
    if spark is None:
        return EXIT_USAGE
    try:
        doc = run_delays(spark, topology, segments, args.report, args.bucket_ms)
    except Exception as exc:  # say what failed, in one line
        print(f"georep: error: the delay analytics could not run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        spark.stop()
    for line in summary_lines(doc, args.report):
        out(line)
    return EXIT_CLEAN


def cli(argv: list[str] | None = None) -> int:
    """The entry point for ``spark-submit spark_jobs/delays.py`` (``georep delays`` goes through georep.cli)."""
    parser = argparse.ArgumentParser(prog="georep delays", description="replication delay per path, origin and site")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
