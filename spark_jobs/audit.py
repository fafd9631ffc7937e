"""``georep audit``: check that every site holds the same data (invariants I1-I4).

Thin entry point: it lists the sites' segment files, runs the DataFrame checks
of :mod:`spark_jobs.checks` on the ``georep`` data source, and writes the
report (docs/audit.md)::

    REPORT/report.json               summary, counts, per site pair and origin
    REPORT/discrepancies.parquet/    every issue, one row each (checks.ISSUE_SCHEMA)

Exit codes: 0 no divergence (in-flight gaps allowed), 1 divergence, 2 usage
error or an audit that could not run (the message says what to do).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spark_jobs.layout import (
    AuditInputError,
    SegmentFile,
    list_segments,
    load_topology_for_audit,
    node_order,
    parse_site_dirs,
    site_dirs_from_topology,
)
from topology.model import Topology, UnknownSite
from topology.reach import expected_sites

EXIT_CLEAN = 0
EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
DEFAULT_DATA_ROOT = Path(".georep")
IN_FLIGHT_WINDOW_MS = 60_000
REPORT_FILE = "report.json"
ISSUES_DIR = "discrepancies.parquet"
ISSUES_IN_JSON = 1000
MAX_DRILLED_BATCHES = 10_000
REPORT_FORMAT = 1
REPLICA_LINES = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument(
        "--as-of",
        help="records appended at their origin at or after this time count as in flight "
        "when missing: 'now', epoch ms or ISO-8601 (default: 60 s before now)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the verdict")
    live = parser.add_argument_group("the live audit (docs/audit.md, 'The live audit')")
    live.add_argument(
        "--live",
        action="store_true",
        help="read batch digests from the running sites of the topology over mutual TLS, not segment files",
    )
    live.add_argument(
        "--since",
        type=Path,
        metavar="REPORT_DIR",
        help="with --live: audit only what the sites appended after the cut of that earlier clean live audit",
    )
    live.add_argument(
        "--max-slice-offsets",
        type=int,
        default=1_000_000,
        metavar="N",
        help="with --live: split a partition's range into input partitions of at most N offsets (default 1000000)",
    )
    live.add_argument(
        "--no-replica-check",
        action="store_true",
        help="with --live: read only the copy each multi-node site serves, not every member's (no replica_divergence "
        "check; for a site with a member down, which fails that read)",
    )
    from georep.client.tls_args import add_client_arguments

    add_client_arguments(parser)
    add_continuous_arguments(parser)


def add_continuous_arguments(parser: argparse.ArgumentParser) -> None:
    """--every, --runs, --keep-runs, --metrics-textfile: spark_jobs/continuous.py."""
    from spark_jobs import continuous

    continuous.add_arguments(parser)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``georep audit`` and ``georep delays`` read, where they write, and where Spark runs."""
    parser.add_argument("--topology", help="topology TOML file: sites, links, filters (default: the embedded a, b, c)")
    parser.add_argument(
        "--data-root",
        type=Path,
        help=f"directory with one data dir per site, DATA_ROOT/<site>/ (default {DEFAULT_DATA_ROOT})",
    )
    parser.add_argument(
        "--site",
        action="append",
        default=[],
        metavar="SITE=DIR",
        help="a site's data dir, instead of DATA_ROOT/<site>; repeat for several sites",
    )
    parser.add_argument("--report", type=Path, required=True, help="directory to write the report files to")
    parser.add_argument("--master", help="Spark master URL (default local[*]; under spark-submit, its --master)")
    parser.add_argument("--topics", default="", help="comma-separated topic names or fnmatch patterns (default: all)")


def parse_as_of(text: str | None, now_ms: int) -> int:
    """Epoch ms from 'now', an integer of epoch ms, or ISO-8601 (UTC when no zone is given)."""
    if text is None:
        return now_ms - IN_FLIGHT_WINDOW_MS
    if text == "now":
        return now_ms
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise AuditInputError(
            f"--as-of {text!r}: use 'now', epoch milliseconds or ISO-8601 such as 2026-01-31T12:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def resolve_inputs(
    topology_spec: str | None, data_root: Path | None, site_args: list[str], topics: str
) -> tuple[Topology, dict[str, Path], list[SegmentFile]]:
    """The topology, each audited site's data dir, and the segment files listed now. Raises AuditInputError."""
    topology = load_topology_for_audit(topology_spec)
    if site_args:
        dirs = parse_site_dirs(",".join(site_args))
        for site, path in dirs.items():
            if site not in topology.site_ids():
                raise AuditInputError(
                    f"site {site!r} is not in the topology ({', '.join(topology.site_ids())}): "
                    "pass the --topology that names it"
                )
            if not path.is_dir():
                raise AuditInputError(f"the data dir of site {site}, {path}, is not a directory")
    else:
        dirs = site_dirs_from_topology(topology, data_root or DEFAULT_DATA_ROOT)
    patterns = tuple(t.strip() for t in topics.split(",") if t.strip())
    segments = list_segments(dirs, patterns)
    if not segments:
        which = f" of topics {', '.join(patterns)}" if patterns else ""
        raise AuditInputError(
            f"no segment files{which} under {', '.join(str(d) for d in dirs.values())}: "
            "check --data-root/--site and --topics"
        )
    return topology, dirs, segments


def expected_reach(topology: Topology, streams: list[tuple[str, str]], sites: list[str]) -> list[tuple[str, str, str]]:
    """(topic, origin site, site) for every audited site that ``origin site``'s records of ``topic`` should reach.

    An origin site that the topology does not name (a retired site, say) is expected everywhere audited.
    """
    out: list[tuple[str, str, str]] = []
    for topic, origin_site in sorted(set(streams)):
        try:
            reach = expected_sites(topology, origin_site, topic, through_interest=False)  # only held ones there
        except UnknownSite:
            reach = frozenset(sites)  # type: ignore[arg-type]
        out.extend((topic, origin_site, s) for s in sites if s in reach)
    return out


@dataclass
class AuditResult:
    clean: bool
    report: dict[str, Any]
    summary: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CLEAN if self.clean else EXIT_DIVERGENCE


def run_audit(
    spark: Any, topology: Topology, dirs: dict[str, Path], segments: list[SegmentFile], report_dir: Path, as_of_ms: int
) -> AuditResult:
    """Run every check, write ``report_dir``, and return the verdict with its human summary."""
    from spark_jobs import progress
    from spark_jobs.datasource import segments_option

    started = time.monotonic()
    listing = segments_option(segments)
    # One row per batch is small: a few partitions hold it, so the checks' stages stay few and short.
    reader = spark.read.format("georep").option("segments", listing).option("level", "batches")
    reader = reader.options(**progress.reader_options())
    batches = reader.load().coalesce(spark.sparkContext.defaultParallelism).cache()
    log, replica_issues, cached = site_logs(spark, batches, segments)
    nodes = {
        site: sorted({s.node for s in segments if s.site == site and s.node is not None}, key=node_order)
        for site in dirs
    }
    checked = CheckInput(
        batches=batches,
        log=log,
        sites=sorted(dirs),
        narrow=lambda mismatches: _narrow_mismatches(spark, log, mismatches, listing),
        extra_issues=[] if replica_issues is None else [replica_issues],
        nodes=nodes,
    )
    try:
        return check_and_report(
            spark,
            topology,
            checked,
            report_dir,
            as_of_ms,
            started,
            {
                "sites": {s: str(d) for s, d in sorted(dirs.items())},
                "segments": len(segments),
                "bytes": sum(s.size_bytes for s in segments),
            },
        )
    finally:
        for df in (*cached, batches):
            df.unpersist()


@dataclass
class CheckInput:
    """What the checks read, however it was read (segment files, or digests from live sites).

    ``batches``: every batch row read (``BATCH_SCHEMA``); ``log``: each site's own partition log of them;
    ``narrow``: mismatches in, mismatches narrowed to their first differing record out; ``held_before``: rows
    (site, topic, partition, origin, origin_site, held_max) of what each site held before the rows read (an
    incremental audit), or None."""

    batches: Any
    log: Any
    sites: list[str]
    narrow: Callable[[Any], Any]
    extra_issues: list[Any] = field(default_factory=list)
    nodes: dict[str, list[str]] = field(default_factory=dict)
    held_before: Any = None


def check_and_report(
    spark: Any,
    topology: Topology,
    checked: CheckInput,
    report_dir: Path,
    as_of_ms: int,
    started: float,
    input_doc: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> AuditResult:
    """Every check over ``checked``; the issues' Parquet and report.json (with ``extra``'s fields) written."""
    from pyspark.sql import functions as F

    from spark_jobs import checks, runtime

    log, sites = checked.log, checked.sites
    inventory = (
        log.groupBy("site", "topic", "partition", "origin_site")
        .agg(
            F.sum(F.when(F.col("status") == "ok", F.col("records"))).alias("records"),
            F.count("*").alias("batches"),
            F.sum("size_bytes").alias("bytes"),
        )
        .collect()
    )
    streams = [(r.topic, r.origin_site) for r in inventory if r.origin_site is not None]
    if checked.held_before is not None:
        streams += [(r.topic, r.origin_site) for r in checked.held_before.select("topic", "origin_site").collect()]
    expected = spark.createDataFrame(
        expected_reach(topology, streams, sites), "topic string, origin_site string, site string"
    )
    mismatches = checks.batch_mismatches(log).cache()
    issues = (
        checks.damaged_batches(checked.batches)  # of every copy
        .unionByName(checks.sequence_issues(log))
        .unionByName(checks.reach_issues(log, expected, as_of_ms, checked.held_before))
        .unionByName(checked.narrow(mismatches))
    )
    for more in checked.extra_issues:
        issues = issues.unionByName(more)
    # One partition, as the Parquet is written: the summary and the sample then read one cached partition, not
    # one per partition of every check's plan (63 on local[2]: 3 s of an incremental run).
    issues = issues.coalesce(1).cache()
    order: list[Any] = [F.desc("divergence"), "site", "topic", "partition", "origin", "first_seq", "kind"]
    report_dir.mkdir(parents=True, exist_ok=True)
    issues.sortWithinPartitions(*order).write.mode("overwrite").parquet(str(report_dir / ISSUES_DIR))
    by_kind = [r.asDict(recursive=True) for r in checks.summary_by_kind(issues).collect()]
    sample = [r.asDict() for r in issues.orderBy(*order).limit(ISSUES_IN_JSON).collect()]
    for df in (mismatches, issues):
        df.unpersist()
    counts = _counts_by_kind(by_kind)
    clean = not any(checks.KINDS[k] for k in counts)
    report = {
        "format": REPORT_FORMAT,
        "clean": clean,
        "exit_code": EXIT_CLEAN if clean else EXIT_DIVERGENCE,
        "as_of_ms": as_of_ms,
        "as_of": _iso(as_of_ms),
        "generated_at": _iso(int(time.time() * 1000)),
        "elapsed_s": round(time.monotonic() - started, 3),
        "input": input_doc,
        "sites": _site_totals(inventory, checked.nodes, sites),
        "counts": dict(sorted(counts.items())),
        "pairs": pairs_of(by_kind),
        "issues": sample,
        "issues_truncated": sum(c["issues"] for c in counts.values()) > len(sample),
        "issues_parquet": ISSUES_DIR,
        "runtime": runtime.describe(spark),
        **(extra or {}),
    }
    (report_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return AuditResult(clean, report, summary_lines(report, report_dir))


def _counts_by_kind(by_kind: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Issues and records per kind, summed over the (kind, pair) rows of ``checks.summary_by_kind``."""
    counts: dict[str, dict[str, int]] = {}
    for row in by_kind:
        c = counts.setdefault(row["kind"], {"issues": 0, "records": 0})
        c["issues"] += row["issues"]
        c["records"] += row["records"] or 0
    return counts


def _site_totals(inventory: list[Any], nodes: dict[str, list[str]], sites: list[str]) -> dict[str, dict[str, Any]]:
    """Records, batches, bytes, partitions and nodes per site, from the inventory rows and the nodes read."""
    totals: dict[str, dict[str, Any]] = {s: {"records": 0, "batches": 0, "bytes": 0, "partitions": 0} for s in sites}
    for r in inventory:
        t = totals[r.site]
        for k in ("records", "batches", "bytes"):
            t[k] += r[k] or 0
    for site in sites:
        totals[site]["partitions"] = len({(r.topic, r.partition) for r in inventory if r.site == site})
        totals[site]["nodes"] = nodes.get(site, [])
    return totals


def site_logs(spark: Any, batches: Any, segments: list[SegmentFile]) -> tuple[Any, Any, list[Any]]:
    """Each site's own partition log (a multi-node site's from its segments' reference copies), the
    ``replica_divergence`` issues (None when no site has several nodes), and the DataFrames cached for them."""
    from spark_jobs import replicas

    if not replicas.any_copies(segments):
        return batches, None, []
    references, issues = replicas.check_copies(spark, batches)
    keep = spark.createDataFrame(replicas.keep_rows(segments, references), replicas.KEEP_SCHEMA)
    log = replicas.site_log(batches, keep).cache()
    return log, issues, [log]


def pairs_of(by_kind: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (reference site, site, origin): records per kind, and the first divergent coordinate (else the first)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in by_kind:
        groups.setdefault((row["site"] or "", row["reference_site"] or "", row["origin"] or ""), []).append(row)
    pairs = []
    for key in sorted(groups):
        rows = groups[key]
        first = min(
            rows,
            key=lambda r: (
                not r["divergence"],
                r["first"]["topic"] or "",
                r["first"]["partition"] or 0,
                r["first"]["first_seq"] or 0,
            ),
        )
        pairs.append(
            {
                "site": rows[0]["site"],
                "reference_site": rows[0]["reference_site"],
                "origin": rows[0]["origin"],
                "divergence": any(r["divergence"] for r in rows),
                "kinds": {r["kind"]: r["records"] or 0 for r in sorted(rows, key=lambda r: r["kind"])},
                "first": {**first["first"], "kind": first["kind"]},
            }
        )
    return pairs


def _narrow_mismatches(spark: Any, batches: Any, mismatches: Any, listing: str) -> Any:
    """Read the records of mismatching batches, and of their reference copies, to name the first record."""
    from pyspark.sql import functions as F

    from spark_jobs import checks

    def c(name: str) -> Any:
        return F.col(name)

    def w(name: str) -> Any:
        return F.col(f"w.{name}")

    wanted = mismatches.select("site", "reference_site", *checks.STREAM, "first_seq", "last_seq").alias("w")
    copies = batches.where("status = 'ok'").alias("c")
    located = (
        copies.join(
            wanted,
            [
                *(c(f"c.{k}") == w(k) for k in checks.STREAM),
                c("c.base_seq") <= w("last_seq"),
                c("c.last_seq") >= w("first_seq"),
                (c("c.site") == w("site")) | (c("c.site") == w("reference_site")),
            ],
        )
        .select("c.file", "c.position")
        .distinct()
        .limit(MAX_DRILLED_BATCHES)
        .collect()
    )
    if not located:
        return mismatches
    positions: dict[str, list[int]] = {}
    for row in located:
        positions.setdefault(row.file, []).append(row.position)
    records = (
        spark.read.format("georep").option("segments", listing).option("batchPositions", json.dumps(positions)).load()
    )
    return checks.first_record_differences(mismatches, records)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def coordinate(topic: str, partition: int, origin: str, seq: int) -> str:
    return f"{topic}/{partition} {origin}:{seq}"


def summary_lines(report: dict[str, Any], report_dir: Path) -> list[str]:
    from spark_jobs.checks import REPLICA_DIVERGENCE

    sites = report["sites"]
    if report.get("mode") == "live":
        read = report["read"]
        lines = [
            f"georep audit --live of {len(sites)} site(s) ({', '.join(sites)}), cut at "
            f"{_iso(report['cut']['taken_at_ms'])}: {read['digests']:,} batch digest(s), "
            f"{read['digest_bytes'] / 1e6:,.2f} MB moved for {read['stored_bytes'] / 1e6:,.2f} MB stored, "
            f"{read.get('fetched_batches', 0)} batch(es) fetched; as of {report['as_of']}"
        ]
        if read.get("replica_digests"):
            lines.append(
                f"  and every replica of the multi-node sites: {read['replica_digests']:,} digest(s), "
                f"{read['replica_digest_bytes'] / 1e6:,.2f} MB moved"
            )
    else:
        lines = [
            f"georep audit of {len(sites)} site(s) ({', '.join(sites)}), {report['input']['segments']} segment "
            f"file(s), as of {report['as_of']}"
        ]
    for site, t in sites.items():
        n = len(t.get("nodes") or ())
        nodes = f", read from {n} nodes' segment copies" if n else ""
        if n and report.get("mode") == "live":
            nodes = f", the copies of its {n} nodes compared"
        lines.append(
            f"  {site}: {t['records']:,} records in {t['batches']:,} batches, {t['partitions']} partition(s){nodes}"
        )
    for pair in report["pairs"]:
        ref = pair["reference_site"]
        who = f"{pair['site']} vs {ref}" if ref else f"{pair['site']} (own log)"
        first = pair["first"]
        verdict = "DIVERGENCE" if pair["divergence"] else "ok"
        lines.append(
            f"  {verdict:<10} {who:<14} origin {pair['origin'] or '-':<16} "
            f"{', '.join(f'{k} {n:,}' for k, n in sorted(pair['kinds'].items()))} record(s); first: {first['kind']} at "
            f"{coordinate(first['topic'], first['partition'], pair['origin'] or '?', first['first_seq'] or 0)}"
        )
    replica = [i for i in report["issues"] if i["kind"] == REPLICA_DIVERGENCE]
    for i in replica[:REPLICA_LINES]:
        where = coordinate(i["topic"], i["partition"], i["origin"] or "?", i["first_seq"] or 0)
        lines.append(
            f"  DIVERGENCE {i['site']} node {i['node']} vs node {i['reference_node']}: segment "
            f"{i['segment']} of {i['topic']}/{i['partition']} parts at offset {i['offset']} ({where})"
        )
    if len(replica) > REPLICA_LINES:
        lines.append(f"  ... and {len(replica) - REPLICA_LINES} more replica divergence(s) in the report")
    counts = ", ".join(f"{k} {v['issues']}" for k, v in report["counts"].items()) or "no issues"
    verdict = "CLEAN: no divergence" if report["clean"] else "DIVERGENCE found"
    lines.append(f"{verdict} ({counts})")
    lines.append(f"report: {report_dir / REPORT_FILE}; every discrepancy: {report_dir / ISSUES_DIR}")
    return lines


def main(args: argparse.Namespace, out: Callable[[str], None] = print, spark: Any = None) -> int:
    """``georep audit``: the exit status is the verdict. ``spark``: a running session to use (and leave running);
    by default the command starts its own and stops it."""
    from spark_jobs import continuous

    if continuous.requested(args):
        return continuous.main(args, out, spark)
    if getattr(args, "live", False) or getattr(args, "since", None) is not None:
        from spark_jobs.live_cli import live_main

        return live_main(args, out, spark)
    try:
        if getattr(args, "no_replica_check", False):
            raise AuditInputError("--no-replica-check goes with --live: the file audit reads every copy from disk")
        as_of_ms = parse_as_of(args.as_of, int(time.time() * 1000))
        topology, dirs, segments = resolve_inputs(args.topology, args.data_root, args.site, args.topics)
    except AuditInputError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from spark_jobs.progress import progress_for

    return run_in_session(
        args,
        out,
        spark,
        progress_for(args.quiet, out),
        lambda session: run_audit(session, topology, dirs, segments, args.report, as_of_ms),
        "the audit",
    )


def run_in_session(
    args: argparse.Namespace,
    out: Callable[[str], None],
    spark: Any,
    progress: Any,
    run: Callable[[Any], Any],
    what: str,
    describe: Callable[[BaseException], str] = str,
) -> int:
    """``run`` (a file or live audit, answering its result) on ``spark`` or a session of its own, watched by
    ``progress``; prints its summary and answers its exit status, or EXIT_USAGE, saying why, if it could not run."""
    from spark_jobs.progress import watch
    from spark_jobs.session import start_spark

    session = spark or start_spark(args.master)
    if session is None:
        return EXIT_USAGE
    try:
        with watch(session, progress):
            result = run(session)
    except Exception as exc:  # exit 1 must mean divergence, never a crash
        print(f"georep: error: {what} could not run: {describe(exc)}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if spark is None:
            session.stop()
    for line in result.summary if not args.quiet else result.summary[-2:]:
        out(line)
    return int(result.exit_code)


def cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="georep audit", description="check that every site holds the same data")
    add_arguments(parser)
    return parser


def cli(argv: list[str] | None = None) -> int:
    """The entry point for ``spark-submit spark_jobs/audit.py`` (``georep audit`` goes through georep.cli)."""
    return main(cli_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
