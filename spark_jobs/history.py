"""The history of continuous audits: one Parquet file per run, under ``REPORT_DIR/history.parquet/``.

``georep audit --every DURATION`` (:mod:`spark_jobs.continuous`) appends one row per run; ``georep audit history``
(:mod:`spark_jobs.history_cli`) reads them back. One file per run makes an append atomic: the row is written to a
hidden temporary name in the same directory and renamed into place, so a reader (pyarrow, Spark, pandas: all skip
names that start with ``.``) sees a run whole or not at all, and a crash leaves no half-written run behind.

A file that does not read as Parquet of this schema (a truncated copy, a stray file) is skipped with a warning that
names it, never silently: the other runs still count.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

HISTORY_DIR = "history.parquet"
RUN_PREFIX = "run-"
HISTORY_FORMAT = 1
VERDICT_CLEAN = "clean"
VERDICT_DIVERGENCE = "divergence"
VERDICT_ERROR = "error"  # the audit could not run (exit 2): a site down, Spark failed, ...

SCHEMA = pa.schema(
    [
        pa.field("format", pa.int32(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("started_at", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("finished_at", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("duration_s", pa.float64(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),  # file or live
        pa.field("verdict", pa.string(), nullable=False),  # clean, divergence or error
        pa.field("exit_code", pa.int32(), nullable=False),
        pa.field("as_of_ms", pa.int64()),
        pa.field("audited_batches", pa.int64()),
        pa.field("audited_records", pa.int64()),
        pa.field("audited_bytes", pa.int64()),
        pa.field("bytes_moved", pa.int64()),  # file mode: segment bytes read; live: digests, fetched batches
        pa.field("findings", pa.map_(pa.string(), pa.int64())),  # kind -> issues
        pa.field("finding_records", pa.map_(pa.string(), pa.int64())),  # kind -> records concerned
        pa.field("cut", pa.string()),  # live mode: the cut (JSON, as report.json's "cut"); file mode: null
        pa.field("since", pa.string()),  # live mode: the report dir whose cut the run started from
        pa.field("report", pa.string()),  # the run's report dir, relative to REPORT_DIR (null if none was written)
        pa.field("error", pa.string()),  # verdict error: the message the run printed
    ]
)


class HistoryError(Exception):
    """A history that cannot be read or written; the message says what to do."""


@dataclass
class Run:
    """One audit run, as a row of the history."""

    run_id: str
    started_at_ms: int
    finished_at_ms: int
    mode: str
    verdict: str
    exit_code: int
    as_of_ms: int | None = None
    audited_batches: int = 0
    audited_records: int = 0
    audited_bytes: int = 0
    bytes_moved: int = 0
    findings: dict[str, int] = field(default_factory=dict)
    finding_records: dict[str, int] = field(default_factory=dict)
    cut: str | None = None
    since: str | None = None
    report: str | None = None
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return (self.finished_at_ms - self.started_at_ms) / 1000

    @property
    def completed(self) -> bool:
        """The audit ran to a verdict (clean or divergence)."""
        return self.verdict != VERDICT_ERROR


def run_from_report(
    report: dict[str, Any] | None, run_id: str, started_at_ms: int, finished_at_ms: int, exit_code: int, mode: str
) -> Run:
    """The history row of a run from its report.json (None, or a stale one, when the run could not run)."""
    if report is None or exit_code not in (0, 1):
        return Run(run_id, started_at_ms, finished_at_ms, mode, VERDICT_ERROR, exit_code)
    sites = report.get("sites", {}).values()
    read = report.get("read") or {}
    live = report.get("mode") == "live"
    counts = report.get("counts", {})
    return Run(
        run_id,
        started_at_ms,
        finished_at_ms,
        "live" if live else "file",
        VERDICT_CLEAN if report.get("clean") else VERDICT_DIVERGENCE,
        exit_code,
        as_of_ms=report.get("as_of_ms"),
        audited_batches=sum(int(s.get("batches") or 0) for s in sites),
        audited_records=sum(int(s.get("records") or 0) for s in sites),
        audited_bytes=sum(int(s.get("bytes") or 0) for s in sites),
        bytes_moved=(
            sum(int(read.get(k, 0)) for k in ("digest_bytes", "replica_digest_bytes", "fetched_bytes"))
            if live
            else int(report.get("input", {}).get("bytes", 0))
        ),
        findings={k: int(v["issues"]) for k, v in sorted(counts.items())},
        finding_records={k: int(v["records"]) for k, v in sorted(counts.items())},
        cut=json.dumps(report["cut"], sort_keys=True) if report.get("cut") is not None else None,
        since=(report.get("since") or {}).get("report"),
    )


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _table(run: Run) -> pa.Table:
    row = asdict(run)
    row.update(
        format=HISTORY_FORMAT,
        started_at=_ts(run.started_at_ms),
        finished_at=_ts(run.finished_at_ms),
        duration_s=run.duration_s,
        findings=list(run.findings.items()),
        finding_records=list(run.finding_records.items()),
    )
    return pa.Table.from_pylist([{f.name: row[f.name] for f in SCHEMA}], schema=SCHEMA)


def append(report_dir: Path, run: Run) -> Path:
    """Add ``run`` to the history of ``report_dir``, atomically; returns the file written."""
    directory = report_dir / HISTORY_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HistoryError(f"cannot create the history dir {directory} ({exc}): check --report") from None
    final = directory / f"{RUN_PREFIX}{run.run_id}.parquet"
    temp = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        pq.write_table(_table(run), temp)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, final)
    except OSError as exc:
        raise HistoryError(
            f"cannot append run {run.run_id} to the history in {directory} ({exc}): check its space and permissions"
        ) from None
    finally:
        temp.unlink(missing_ok=True)
    return final


def _warn(message: str) -> None:
    print(f"georep: warning: {message}", file=sys.stderr)


def _run_of(row: dict[str, Any]) -> Run:
    return Run(
        run_id=row["run_id"],
        started_at_ms=int(row["started_at"].timestamp() * 1000),
        finished_at_ms=int(row["finished_at"].timestamp() * 1000),
        mode=row["mode"],
        verdict=row["verdict"],
        exit_code=row["exit_code"],
        as_of_ms=row["as_of_ms"],
        audited_batches=row["audited_batches"] or 0,
        audited_records=row["audited_records"] or 0,
        audited_bytes=row["audited_bytes"] or 0,
        bytes_moved=row["bytes_moved"] or 0,
        findings=dict(row["findings"] or []),
        finding_records=dict(row["finding_records"] or []),
        cut=row["cut"],
        since=row["since"],
        report=row["report"],
        error=row["error"],
    )


def _read_one(path: Path) -> Run:
    table = pq.read_table(path)
    missing = [f.name for f in SCHEMA if f.name not in table.column_names]
    if missing:
        raise ValueError(f"not a georep audit history file: no column {', '.join(missing)}")
    if table.num_rows != 1:
        raise ValueError(f"{table.num_rows} rows, where a run's file holds 1")
    return _run_of(table.select([f.name for f in SCHEMA]).to_pylist()[0])


def read(report_dir: Path, warn: Callable[[str], None] = _warn) -> tuple[list[Run], list[Path]]:
    """Every run of the history, oldest first, and the files skipped because they could not be read (each named
    through ``warn``). An empty list when there is no history yet."""
    directory = report_dir / HISTORY_DIR
    if directory.exists() and not directory.is_dir():
        raise HistoryError(f"{directory} is not a directory: move it away, the history is kept there")
    runs, skipped = [], []
    for path in sorted(directory.glob(f"{RUN_PREFIX}*.parquet")) if directory.is_dir() else []:
        try:
            runs.append(_read_one(path))
        except (OSError, ValueError, pa.ArrowException, KeyError, TypeError) as exc:
            skipped.append(path)
            warn(
                f"skipping the damaged audit history file {path} ({type(exc).__name__}: {exc}); the other runs "
                "still count: remove or restore it to silence this"
            )
    runs.sort(key=lambda r: (r.started_at_ms, r.run_id))
    return runs, skipped
