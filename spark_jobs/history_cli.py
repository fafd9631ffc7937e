"""``georep audit history REPORT_DIR [--plot OUT.png] [--json]``: what the continuous audit's runs found.

Reads ``REPORT_DIR/history.parquet/`` (:mod:`spark_jobs.history`) with pyarrow alone: no Spark, no JVM. Exit codes:
0 the history was read (damaged run files are skipped, each named in a warning), 2 no history there, or a plot
that could not be written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spark_jobs.history import HISTORY_DIR, VERDICT_CLEAN, VERDICT_DIVERGENCE, VERDICT_ERROR, HistoryError, Run, read

EXIT_OK = 0
EXIT_USAGE = 2
TABLE_RUNS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "report_dir", type=Path, metavar="REPORT_DIR", help="the --report dir of 'georep audit --every'"
    )
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="draw findings and audited bytes over time")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--last", type=int, default=TABLE_RUNS, metavar="N", help=f"runs listed (default {TABLE_RUNS})")


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _run_doc(run: Run) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "started_at": _iso(run.started_at_ms),
        "finished_at": _iso(run.finished_at_ms),
        "duration_s": round(run.duration_s, 3),
        "mode": run.mode,
        "verdict": run.verdict,
        "exit_code": run.exit_code,
        "audited_batches": run.audited_batches,
        "audited_records": run.audited_records,
        "audited_bytes": run.audited_bytes,
        "bytes_moved": run.bytes_moved,
        "findings": run.findings,
        "since": run.since,
        "report": run.report,
        "error": run.error,
    }


def summary(runs: list[Run], skipped: list[Path]) -> dict[str, Any]:
    """The history in numbers: runs by verdict, the last one, the divergent ones, audited bytes."""
    divergent = [r for r in runs if r.verdict == VERDICT_DIVERGENCE]
    clean = [r for r in runs if r.verdict == VERDICT_CLEAN]
    audited = [r.audited_bytes for r in runs if r.completed]
    return {
        "runs": len(runs),
        "first_at": _iso(runs[0].started_at_ms),
        "last_at": _iso(runs[-1].started_at_ms),
        "verdicts": {
            v: sum(1 for r in runs if r.verdict == v) for v in (VERDICT_CLEAN, VERDICT_DIVERGENCE, VERDICT_ERROR)
        },
        "last": _run_doc(runs[-1]),
        "last_clean_at": _iso(clean[-1].finished_at_ms) if clean else None,
        "divergent_runs": [r.run_id for r in divergent],
        "audited_bytes": {
            "total": sum(audited),
            "min": min(audited, default=0),
            "median": statistics.median(audited) if audited else 0,
            "max": max(audited, default=0),
        },
        "bytes_moved_total": sum(r.bytes_moved for r in runs),
        "skipped_files": [str(p) for p in skipped],
    }


def _findings_text(run: Run) -> str:
    return ", ".join(f"{k} {n:,}" for k, n in sorted(run.findings.items()) if n) or "-"


def summary_lines(doc: dict[str, Any], runs: list[Run], report_dir: Path, last: int) -> list[str]:
    v, last_run, b = doc["verdicts"], doc["last"], doc["audited_bytes"]
    lines = [
        f"audit history of {report_dir}: {doc['runs']} run(s) from {doc['first_at']} to {doc['last_at']}: "
        f"{v[VERDICT_CLEAN]} clean, {v[VERDICT_DIVERGENCE]} divergent, {v[VERDICT_ERROR]} could not run",
        f"  last run {last_run['run_id']}: {last_run['verdict'].upper()} (exit {last_run['exit_code']}), "
        f"{last_run['mode']} mode, {last_run['duration_s']:.1f}s"
        + (f": {last_run['error']}" if last_run["error"] else ""),
        f"  last clean run ended {doc['last_clean_at'] or 'never'}",
    ]
    if doc["divergent_runs"]:
        d = doc["divergent_runs"]
        lines.append(f"  divergent runs: {len(d)}, the first {d[0]}, the last {d[-1]}")
    lines.append(
        f"  audited bytes per run: min {b['min'] / 1e6:,.2f} MB, median {b['median'] / 1e6:,.2f} MB, "
        f"max {b['max'] / 1e6:,.2f} MB; {b['total'] / 1e6:,.2f} MB in all, "
        f"{doc['bytes_moved_total'] / 1e6:,.2f} MB moved"
    )
    lines.append(f"  {'started':<20} {'verdict':<10} {'mode':<4} {'secs':>7} {'records':>12} {'MB':>9}  findings")
    for r in runs[-last:] if last > 0 else []:
        lines.append(
            f"  {_iso(r.started_at_ms):<20} {r.verdict:<10} {r.mode:<4} {r.duration_s:>7.1f} "
            f"{r.audited_records:>12,} {r.audited_bytes / 1e6:>9.2f}  {_findings_text(r)}"
        )
    return lines


def plot(runs: list[Run], out: Path) -> None:
    """Findings per kind (divergent runs marked) and audited bytes over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    when = [datetime.fromtimestamp(r.started_at_ms / 1000, UTC) for r in runs]
    kinds = sorted({k for r in runs for k, n in r.findings.items() if n})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for kind in kinds:
        top.plot(when, [r.findings.get(kind, 0) if r.completed else None for r in runs], marker="o", label=kind)
    divergent = [w for w, r in zip(when, runs, strict=True) if r.verdict == VERDICT_DIVERGENCE]
    failed = [w for w, r in zip(when, runs, strict=True) if r.verdict == VERDICT_ERROR]
    for w in divergent:
        top.axvline(w, color="red", alpha=0.25, linewidth=3)
    for w in failed:
        top.axvline(w, color="grey", alpha=0.4, linestyle="--")
    top.set_ylabel("findings (issues)")
    top.set_title(f"georep audit history: {len(runs)} runs, {len(divergent)} divergent (red), {len(failed)} failed")
    if kinds:
        top.legend(loc="upper left", fontsize="small")
    else:
        top.text(0.5, 0.5, "no findings", transform=top.transAxes, ha="center", va="center")
    bottom.plot(when, [r.audited_bytes / 1e6 for r in runs], marker="o", label="audited (MB)")
    bottom.plot(when, [r.bytes_moved / 1e6 for r in runs], marker="x", label="moved (MB)")
    bottom.set_ylabel("MB per run")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("run start (UTC)")
    bottom.legend(loc="upper left", fontsize="small")
    fig.autofmt_xdate()
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100, format="png")
    finally:
        plt.close(fig)


def main(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    try:
        runs, skipped = read(args.report_dir)
    except HistoryError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not runs:
        where = args.report_dir / HISTORY_DIR
        what = "only damaged run files" if skipped else "no audit history"
        print(
            f"georep: error: {what} in {where}: run 'georep audit --every DURATION --report {args.report_dir}' "
            "(or --runs N) to record one",
            file=sys.stderr,
        )
        return EXIT_USAGE
    doc = summary(runs, skipped)
    if args.plot is not None:
        try:
            plot(runs, args.plot)
        except OSError as exc:
            print(f"georep: error: cannot write the plot {args.plot} ({exc}); check the path", file=sys.stderr)
            return EXIT_USAGE
        doc["plot"] = str(args.plot)
    if args.json:
        out(json.dumps({**doc, "history": [_run_doc(r) for r in runs]}, indent=2))
        return EXIT_OK
    for line in summary_lines(doc, runs, args.report_dir, args.last):
        out(line)
    if args.plot is not None:
        out(f"  plot: {args.plot}")
    return EXIT_OK


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="georep audit history", description="summarize the runs of a continuous audit ('georep audit --every')"
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))
