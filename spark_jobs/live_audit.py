"""``georep audit --live``: the audit of running sites, over the network, from batch digests.

Steps (docs/audit.md, "The live audit"):

1. the cut (:mod:`spark_jobs.cut`): every site's vectors and end offsets at one moment;
2. the digests: the ``georep-live`` data source (:mod:`spark_jobs.live_source`) reads one digest per stored batch
   of every site's ``[start, end)`` with ``ScanDigests``, in parallel, on the executors; a multi-node site's ranges
   are read again with ``all_replicas``, one digest per member's copy (:func:`multi_node_sites`, :class:`Copies`);
3. the same checks as the file audit (:mod:`spark_jobs.checks`) and the same report, the site's log being the
   digests it serves; over every member's copy, the file audit's replica check
   (:func:`spark_jobs.replicas.check_copies`: ``replica_divergence``) and its damaged batches;
4. only the batches whose CRCs differ are fetched whole (``FetchBatch`` by coordinate, from the driver), from
   each site holding them, to name the first differing record.

Incremental (``--since REPORT``): each site is read from the previous cut's end. What the previous run read of
streams that some expected site still lacked at its cut (``pending.parquet``, small: the in-flight tail) is
compared again with what those sites received since, and the previous cut's vectors check each site's seam
(:func:`spark_jobs.checks.boundary_issues`) and count as held (:func:`spark_jobs.checks.reach_issues`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import CorruptBatch, check_batch, decode_records
from georep.security.tls import TlsConfig, client_channel
from spark_jobs.audit import REPORT_FILE, AuditResult, CheckInput, check_and_report, expected_reach
from spark_jobs.cut import Cut, start_offsets
from spark_jobs.layout import AuditInputError, node_order
from spark_jobs.live_source import LIVE_SCHEMA, MAX_SLICE_OFFSETS, NAME, Slice, pack, plan_slices, slices_option
from spark_jobs.live_source import tls_options as source_tls_options
from spark_jobs.progress import Progress, SilentProgress
from spark_jobs.progress import reader_options as progress_options
from spark_jobs.scan import BATCH_SCHEMA, record_hash
from topology.model import Topology

PENDING_DIR = "pending.parquet"
FETCH_PARALLEL = 16
FETCH_TIMEOUT_S = 30.0
MAX_FETCHED_BATCHES = 10_000
RECORD_ROWS = "site string, topic string, partition int, origin string, origin_seq long, record_hash long, " + (
    "offset long, status string"
)
HELD_ROWS = "site string, topic string, partition int, origin string, origin_site string, held_max long"


@dataclass(frozen=True)
class Since:
    """A previous clean live report: its cut, and where its pending batches are."""

    report_dir: Path
    cut: Cut


def load_since(report_dir: Path) -> Since:
    """The previous report's cut; AuditInputError unless it is a clean live report with a cut."""
    path = report_dir / REPORT_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise AuditInputError(
            f"--since {report_dir}: no {REPORT_FILE} there; pass the report dir of a live audit"
        ) from None
    except (OSError, ValueError) as exc:
        raise AuditInputError(f"--since {report_dir}: cannot read {path} ({exc})") from None
    if not isinstance(doc, dict) or "cut" not in doc:
        raise AuditInputError(
            f"--since {report_dir}: that report has no cut (a file-mode audit, or an older georep): run a full "
            "'georep audit --live' first and pass its report dir"
        )
    if doc.get("clean") is not True:
        raise AuditInputError(
            f"--since {report_dir}: that audit found a divergence, so its cut is no clean start; fix the divergence "
            "and run a full 'georep audit --live', then audit incrementally from its report"
        )
    if not (report_dir / PENDING_DIR).is_dir():
        raise AuditInputError(f"--since {report_dir}: {PENDING_DIR} is missing from that report dir; run a full audit")
    return Since(report_dir, Cut.from_json(doc["cut"]))


def live_ranges(cut: Cut, starts: dict[tuple[str, str, int], int]) -> list[tuple[str, str, str, int, int, int]]:
    return [
        (site, p.address, topic, partition, starts[(site, topic, partition)], p.end_offset)
        for site, s in sorted(cut.sites.items())
        for (topic, partition), p in sorted(s.partitions.items())
    ]


def held_rows(cut: Cut, starts: dict[tuple[str, str, int], int]) -> list[tuple[str, str, int, str, str, int]]:
    """What each site held at ``cut`` (a previous one), for the partitions read from its end: rows of HELD_ROWS."""
    out = []
    for site, s in sorted(cut.sites.items()):
        for (topic, partition), p in sorted(s.partitions.items()):
            if starts.get((site, topic, partition), 0) <= 0:
                continue
            for origin, next_seq in sorted(p.vector.items()):
                if next_seq > 0:
                    out.append((site, topic, partition, origin, origin.rpartition("@")[0], next_seq - 1))
    return out


def pending_floors(topology: Topology, cut: Cut) -> list[tuple[str, int, str, int]]:
    """Per (topic, partition, origin): the lowest next seq among the sites expected to hold it at ``cut``. The
    batches at or above it are pending: some expected site lacked them, and gets them after the cut."""
    sites = sorted(cut.sites)
    vectors: dict[tuple[str, int], dict[str, dict[str, int]]] = {}
    for site, s in cut.sites.items():
        for key, p in s.partitions.items():
            vectors.setdefault(key, {})[site] = dict(p.vector)
    out = []
    reaches: dict[tuple[str, str], set[str]] = {}  # once per topic and origin site, not per partition
    for (topic, partition), by_site in sorted(vectors.items()):
        origins = sorted({o for v in by_site.values() for o in v})
        for origin in origins:
            stream = (topic, origin.rpartition("@")[0])
            if stream not in reaches:
                reaches[stream] = {s for _t, _o, s in expected_reach(topology, [stream], sites)}
            floor = min((by_site.get(s, {}).get(origin, 0) for s in reaches[stream]), default=0)
            out.append((topic, partition, origin, floor))
    return out


def run_live_audit(
    spark: Any,
    topology: Topology,
    cut: Cut,
    tls: TlsConfig | None,
    report_dir: Path,
    as_of_ms: int,
    since: Since | None = None,
    progress: Progress | None = None,
    max_slice_offsets: int = MAX_SLICE_OFFSETS,
    replica_check: bool = True,
) -> AuditResult:
    """Steps 2-4 of the live audit over ``cut``; the report written to ``report_dir``. ``replica_check``: also
    every member's copy of the multi-node sites' ranges, compared (``replica_divergence``)."""
    progress = progress or SilentProgress()
    started = time.monotonic()
    starts = start_offsets(cut, since.cut if since else None)
    ranges = live_ranges(cut, starts)
    for site, s in sorted(cut.sites.items()):
        offsets = sum(end - start for r_site, _a, _t, _p, start, end in ranges if r_site == site)
        progress.site_cut(site, len(s.partitions), offsets, cut.took_ms)
    slices = plan_slices(ranges, max_slice_offsets)
    digests = _read_digests(spark, slices, tls, max_slice_offsets).cache()
    read = _read_counters(digests, sorted(cut.sites), progress)
    batches = digests.drop("digest_bytes")
    multi = multi_node_sites(topology, cut) if replica_check else []
    copies = _read_copies(spark, multi, ranges, tls, max_slice_offsets, read, progress)
    log, held_before, extra_issues = batches, None, []
    if since is not None:
        log, held_before, extra_issues = _since_inputs(spark, since, starts, batches)
    read.update(slices=len(slices), input_partitions=len(pack(slices, max_slice_offsets)))
    checked = CheckInput(
        # the damaged batches of every copy read: a multi-node site's copies hold the batches its log is made of
        batches=batches if copies is None else batches.where(~batches["site"].isin(multi)).unionByName(copies.batches),
        log=log,
        sites=sorted(cut.sites),
        narrow=lambda mismatches: _narrow_by_fetch(spark, cut, tls, mismatches, read, progress),
        extra_issues=extra_issues if copies is None else [*extra_issues, copies.issues],
        nodes={} if copies is None else copies.nodes,
        held_before=held_before,
    )
    pending = _write_pending(spark, topology, cut, log, report_dir)
    extra = {
        "mode": "live",
        "cut": cut.to_json(),
        "since": None if since is None else {"report": str(since.report_dir), "taken_at_ms": since.cut.taken_at_ms},
        "read": read,  # the fetch counters join it during the checks
        "replica_check": replica_check,
        "pending_batches": pending,
        "pending_parquet": PENDING_DIR,
    }
    try:
        result = check_and_report(
            spark,
            topology,
            checked,
            report_dir,
            as_of_ms,
            started,
            {
                "sites": {site: sorted({p.address for p in s.partitions.values()}) for site, s in cut.sites.items()},
                "partitions": sum(len(s.partitions) for s in cut.sites.values()),
                "offsets": sum(end - start for *_x, start, end in ranges),
            },
            extra,
        )
    finally:
        cached = [digests, *([] if copies is None else [copies.digests])]
        cached += [] if since is None else [log, held_before]
        for df in cached:
            df.unpersist()
    return result


def multi_node_sites(topology: Topology, cut: Cut) -> list[str]:
    """The sites of ``cut`` of several nodes (the topology's node lists: the cut's answers do not name members)."""
    return [site for site in sorted(cut.sites) if len(topology.site(site).nodes) > 1]


@dataclass
class Copies:
    """A multi-node site's every copy of the audited range: the digests read (cached), their batch rows, the
    ``replica_divergence`` issues among them, and the nodes whose copies they are, per site."""

    digests: Any
    batches: Any
    issues: Any
    nodes: dict[str, list[str]]


def _read_copies(
    spark: Any,
    sites: list[str],
    ranges: list[tuple[str, str, str, int, int, int]],
    tls: TlsConfig | None,
    max_slice_offsets: int,
    read: dict[str, Any],
    progress: Progress,
) -> Copies | None:
    """Every member's copy of the ranges of ``sites`` (``ScanDigests`` with ``all_replicas``, from the node each
    range is read from), counted in ``read``, and compared as the file audit compares a site's copies
    (:func:`spark_jobs.replicas.check_copies`). None when no range is of such a site."""
    from spark_jobs import replicas

    slices = plan_slices([r for r in ranges if r[0] in sites], max_slice_offsets, all_replicas=True)
    if not slices:
        return None
    digests = _read_digests(spark, slices, tls, max_slice_offsets).cache()
    nodes = _copy_counters(digests, sites, read, progress)
    batches = digests.drop("digest_bytes")
    _references, issues = replicas.check_copies(spark, batches)
    return Copies(digests, batches, issues, nodes)


def _copy_counters(digests: Any, sites: list[str], read: dict[str, Any], progress: Progress) -> dict[str, list[str]]:
    """The copies' digests and wire bytes counted into ``read`` (per site and in total); the nodes read, per site."""
    from pyspark.sql import functions as F

    rows = digests.groupBy("site", "node").agg(F.count("*").alias("n"), F.sum("digest_bytes").alias("wire")).collect()
    nodes: dict[str, list[str]] = {}
    for site in sites:
        mine = [r for r in rows if r.site == site]
        nodes[site] = sorted({r.node for r in mine if r.node is not None}, key=node_order)
        one = {"replica_digests": sum(r.n for r in mine), "replica_digest_bytes": sum(r.wire or 0 for r in mine)}
        read["per_site"].setdefault(site, {}).update(one)
        progress.step(
            f"replicas: site {site}: {one['replica_digests']:,} digest(s) of the copies of node(s) "
            f"{', '.join(nodes[site]) or '-'}, {one['replica_digest_bytes'] / 1e6:,.2f} MB moved"
        )
    for key in ("replica_digests", "replica_digest_bytes"):
        read[key] = sum(read["per_site"][site][key] for site in sites)
    return nodes


def _read_digests(spark: Any, slices: list[Slice], tls: TlsConfig | None, max_slice_offsets: int) -> Any:
    from spark_jobs.datasource import spark_schema

    if not slices:  # nothing past the cut: an empty frame (a source with no partition is not one Spark reads)
        return spark.createDataFrame([], spark_schema(LIVE_SCHEMA))
    reader = spark.read.format(NAME).option("slices", slices_option(slices, max_slice_offsets))
    return reader.options(**source_tls_options(tls), **progress_options()).load()


def _read_counters(digests: Any, sites: list[str], progress: Progress) -> dict[str, Any]:
    """Digests, their wire bytes and the bytes they stand for, per site (reported as each site is done)."""
    from pyspark.sql import functions as F

    rows = {
        r.site: r
        for r in digests.groupBy("site")
        .agg(
            F.count("*").alias("digests"),
            F.sum("digest_bytes").alias("digest_bytes"),
            F.sum("size_bytes").alias("stored_bytes"),
        )
        .collect()
    }
    per_site: dict[str, dict[str, int]] = {}
    for site in sites:
        r = rows.get(site)
        one = {
            "digests": r.digests if r else 0,
            "digest_bytes": (r.digest_bytes or 0) if r else 0,
            "stored_bytes": (r.stored_bytes or 0) if r else 0,
        }
        per_site[site] = one
        progress.digests_read(site, one["digests"], one["digest_bytes"], one["stored_bytes"])
    totals = {k: sum(s[k] for s in per_site.values()) for k in ("digests", "digest_bytes", "stored_bytes")}
    return {**totals, "per_site": per_site}


def _since_inputs(spark: Any, since: Since, starts: dict[tuple[str, str, int], int], batches: Any) -> Any:
    """The log (new batches and the previous run's pending ones), what each site held at the previous cut, and
    the seam's issues."""
    from pyspark.sql import functions as F

    from spark_jobs import checks

    starts_df = spark.createDataFrame(
        [(s, t, p, start) for (s, t, p), start in starts.items() if start > 0],
        "site string, topic string, partition int, start long",
    )
    pending = spark.read.schema(batches.schema).parquet(str(since.report_dir / PENDING_DIR))
    # Below each site's new range: like the new rows, they say the log audited starts there (no hole before it)
    kept = (
        pending.join(starts_df, ["site", "topic", "partition"])
        .where("base_offset < start")
        .withColumn("log_start_offset", F.greatest("log_start_offset", "start"))
        .select(*batches.columns)
    )
    held_before = spark.createDataFrame(held_rows(since.cut, starts), HELD_ROWS).cache()
    log = batches.unionByName(kept).coalesce(spark.sparkContext.defaultParallelism).cache()
    return log, held_before, [checks.boundary_issues(batches, held_before)]


def _write_pending(spark: Any, topology: Topology, cut: Cut, log: Any, report_dir: Path) -> int:
    """The batches of streams that some expected site lacked at this cut, for the next ``--since`` run."""
    floors = spark.createDataFrame(
        pending_floors(topology, cut), "topic string, partition int, origin string, floor long"
    )
    pending = (
        log.where("status = 'ok'")
        .join(floors, ["topic", "partition", "origin"])
        .where("last_seq >= floor")
        .select(*BATCH_SCHEMA.names)
        .cache()
    )
    report_dir.mkdir(parents=True, exist_ok=True)
    pending.coalesce(1).write.mode("overwrite").parquet(str(report_dir / PENDING_DIR))
    n = int(pending.count())
    pending.unpersist()
    return n


# -- step 4: the batches whose CRCs differ ----------------------------------------------------------------------


Wanted = tuple[str, str, int, str, int, int]  # site, topic, partition, origin, first seq, last seq


def _narrow_by_fetch(
    spark: Any, cut: Cut, tls: TlsConfig | None, mismatches: Any, read: dict[str, Any], progress: Progress
) -> Any:
    """Fetch the mismatching batches and their reference copies; count them in ``read``; narrow."""
    from spark_jobs import checks

    fetched: dict[str, list[int]] = {}
    read.update(fetched_batches=0, fetched_bytes=0)
    rows = mismatches.select("site", "reference_site", *checks.STREAM, "first_seq", "last_seq").collect()
    wanted: set[Wanted] = set()
    for r in rows:
        for site in (r.site, r.reference_site):
            if site is not None:
                wanted.add((site, r.topic, r.partition, r.origin, r.first_seq, r.last_seq))
    if not wanted:
        return mismatches
    records = asyncio.run(fetch_records(cut, tls, sorted(wanted)[:MAX_FETCHED_BATCHES], fetched))
    for site, (n, size) in sorted(fetched.items()):
        progress.batches_fetched(site, n, size)
        read["per_site"].setdefault(site, {}).update(fetched_batches=n, fetched_bytes=size)
    read.update(fetched_batches=sum(n for n, _ in fetched.values()), fetched_bytes=sum(b for _, b in fetched.values()))
    return checks.first_record_differences(mismatches, spark.createDataFrame(records, RECORD_ROWS))


async def fetch_records(
    cut: Cut, tls: TlsConfig | None, wanted: Iterable[Wanted], fetched: dict[str, list[int]]
) -> list[tuple[Any, ...]]:
    """Every record (RECORD_ROWS) of the batches holding each wanted seq range, fetched by coordinate from its
    site; ``fetched``: site -> [batches, bytes] fetched, counted here."""
    gate = asyncio.Semaphore(FETCH_PARALLEL)
    channels: dict[str, grpc.aio.Channel] = {}

    async def one(w: Wanted) -> list[tuple[Any, ...]]:
        site, topic, partition, origin, first_seq, last_seq = w
        address = cut.sites[site].partitions[(topic, partition)].address
        if address not in channels:
            channels[address] = client_channel(address, tls)
        stub = pbg.NodeStub(channels[address])
        origin_site, _, epoch = origin.rpartition("@")
        out: list[tuple[Any, ...]] = []
        seq = first_seq
        while seq <= last_seq:
            request = pb.FetchBatchRequest(
                topic=topic, partition=partition, origin_site=origin_site, origin_epoch=int(epoch), origin_seq=seq
            )
            async with gate:
                try:
                    data = (await stub.FetchBatch(request, timeout=FETCH_TIMEOUT_S)).batch
                except grpc.aio.AioRpcError:
                    return out  # not held there any more: the mismatch keeps its batch's range
            count = fetched.setdefault(site, [0, 0])
            count[0] += 1
            count[1] += len(data)
            try:
                header = check_batch(data)
                records = decode_records(data, header)
            except CorruptBatch:
                return out
            out.extend((site, topic, partition, origin, r.origin_seq, record_hash(r), r.offset, "ok") for r in records)
            seq = header.last_origin_seq + 1
        return out

    try:
        parts = await asyncio.gather(*(one(w) for w in wanted))
    finally:
        for channel in channels.values():
            await channel.close()
    return [row for part in parts for row in part]
