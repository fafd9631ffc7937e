"""``georep audit --every DURATION [--runs N]``: the audit again and again, each run appended to a history.

Each run starts ``DURATION`` after the previous one started, or at once when that one took longer (runs never
overlap). Every run writes its own report, ``REPORT/runs/<run id>/`` (report.json and discrepancies.parquet, as a
single audit writes them; ``REPORT/latest`` points to the newest), and appends one row to
``REPORT/history.parquet/`` (:mod:`spark_jobs.history`); ``--metrics-textfile`` rewrites the Prometheus textfile
after it (:mod:`spark_jobs.audit_metrics`). With ``--live`` each run is incremental: it starts from the cut of the
last clean run (``--since`` that run's report dir), and audits in full until there is one.

SIGINT or SIGTERM stops the loop after the run in progress, or at once between runs; a second one acts as it would
have without the loop (Ctrl-C interrupts the run). SIGUSR1 starts the next run now rather than at its time (after
the run in progress, if one is), as an operator does after a repair: later runs keep their schedule from it. One
Spark session serves every run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from spark_jobs import history
from spark_jobs.audit_metrics import MetricsError, check_textfile_path, write_textfile
from spark_jobs.history import HistoryError, Run

RUNS_DIR = "runs"
LATEST = "latest"
DEFAULT_KEEP_RUNS = 100
REPORT_FILE = "report.json"  # spark_jobs.audit.REPORT_FILE, without importing Spark's modules to parse flags
EXIT_USAGE = 2
ERROR_PREFIX = "georep: error: "
UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_RUN_ID = re.compile(r"^\d{8}T\d{6}\.\d{3}Z(-\d+)?$")


def parse_duration(text: str) -> float:
    """Seconds from ``30s``, ``5m``, ``1h``, ``1h30m``, ``500ms`` or ``1d`` (for argparse: ArgumentTypeError)."""
    given = text.strip().lower()
    parts = _DURATION_PART.findall(given)
    if not given or "".join(n + u for n, u in parts) != given:
        hint = f" ({given}s?)" if re.fullmatch(r"\d+(\.\d+)?", given) else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration{hint}: give a number and a unit, such as 30s, 5m, 1h or 1h30m "
            "(units ms, s, m, h, d)"
        )
    return sum(float(n) * UNITS_S[u] for n, u in parts)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("continuous audits (docs/audit.md, 'Continuous audits')")
    g.add_argument(
        "--every",
        type=parse_duration,
        metavar="DURATION",
        help="audit again and again, a run starting every DURATION (30s, 5m, 1h; never before the previous one "
        "ended), each in REPORT/runs/<run id>/ and appended to REPORT/history.parquet; Ctrl-C or SIGTERM stops "
        "after the run in progress",
    )
    g.add_argument(
        "--runs", type=_positive, metavar="N", help="stop after N runs (without --every: back to back; cron: --runs 1)"
    )
    g.add_argument(
        "--keep-runs",
        type=_positive,
        metavar="N",
        help=f"keep the report dirs of the newest N runs (default {DEFAULT_KEEP_RUNS}); the history keeps every run",
    )
    g.add_argument(
        "--metrics-textfile",
        type=Path,
        metavar="PATH",
        help="after each run, write its verdict as Prometheus metrics to PATH (*.prom, for node_exporter's "
        "textfile collector)",
    )


def requested(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a continuous audit (or uses one of its flags)."""
    return any(getattr(args, k, None) is not None for k in ("every", "runs", "keep_runs", "metrics_textfile"))


def _check_flags(args: argparse.Namespace) -> None:
    if args.every is None and args.runs is None:
        raise HistoryError(
            "--keep-runs and --metrics-textfile go with --every DURATION or --runs N (a single run for cron: --runs 1)"
        )
    if getattr(args, "since", None) is not None and not getattr(args, "live", False):
        raise HistoryError("--since goes with --live: pass --live --since REPORT_DIR (file-mode runs are always full)")
    if getattr(args, "no_replica_check", False) and not getattr(args, "live", False):
        raise HistoryError("--no-replica-check goes with --live: the file audit reads every copy from disk")
    if args.metrics_textfile is not None:
        try:
            check_textfile_path(args.metrics_textfile)
        except MetricsError as exc:
            raise HistoryError(str(exc)) from None


@dataclass
class Signals:
    """What the loop's signals asked for: ``stop`` (SIGINT, SIGTERM) and, with it or alone (SIGUSR1), ``wake``,
    which ends the wait between runs."""

    stop: threading.Event
    wake: threading.Event

    def wait(self, seconds: float) -> bool:
        """Wait ``seconds``, or until a signal; True if it was one that stops the loop."""
        self.wake.wait(seconds)
        self.wake.clear()
        return self.stop.is_set()


@contextlib.contextmanager
def loop_signals() -> Iterator[Signals]:
    """SIGINT or SIGTERM set ``stop``; the first also puts the previous handlers back, so a second one acts at
    once. SIGUSR1 sets ``wake`` only. Signals are only caught from the main thread (elsewhere nothing sets them)."""
    signals = Signals(threading.Event(), threading.Event())
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}

    def restore(*which: signal.Signals) -> None:
        for s in which:
            signal.signal(s, previous[s])

    def stopping(signum: int, frame: FrameType | None) -> None:
        signals.stop.set()  # no printing here: the handler may interrupt a print of the run
        signals.wake.set()
        restore(signal.SIGINT, signal.SIGTERM)

    def waking(signum: int, frame: FrameType | None) -> None:
        signals.wake.set()

    signal.signal(signal.SIGINT, stopping)
    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGUSR1, waking)
    try:
        yield signals
    finally:
        restore(*previous)


class _Tee(io.TextIOBase):
    """stderr passed through, and kept, so a failed run's message goes into the history too."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.kept: list[str] = []

    def write(self, s: str) -> int:
        self.kept.append(s)
        return int(self.real.write(s))

    def flush(self) -> None:
        self.real.flush()

    def error(self) -> str | None:
        lines = [ln for ln in "".join(self.kept).splitlines() if ln.startswith(ERROR_PREFIX)]
        return lines[-1].removeprefix(ERROR_PREFIX) if lines else None


def new_run_id(report_dir: Path, now_ms: int) -> str:
    base = datetime.fromtimestamp(now_ms / 1000, UTC).strftime("%Y%m%dT%H%M%S.%f")[:-3] + "Z"
    run_id, n = base, 1
    while (report_dir / RUNS_DIR / run_id).exists() or (
        report_dir / history.HISTORY_DIR / f"{history.RUN_PREFIX}{run_id}.parquet"
    ).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


@dataclass
class Loop:
    """The state that carries from one run to the next."""

    args: argparse.Namespace
    out: Callable[[str], None]
    spark: Any
    runs: list[Run]
    since: Path | None  # live mode: the report dir of the last clean run, where the next run starts
    kinds: list[str]

    @property
    def report_dir(self) -> Path:
        return Path(self.args.report)

    @property
    def live(self) -> bool:
        return bool(getattr(self.args, "live", False))


def last_clean_run_dir(report_dir: Path, runs: list[Run]) -> Path | None:
    """The report dir of the history's last clean live run, if it is still there (a restart goes on from it)."""
    for run in reversed(runs):
        if run.verdict == history.VERDICT_CLEAN and run.mode == "live" and run.report:
            path = report_dir / run.report
            return path if (path / REPORT_FILE).is_file() else None
    return None


def run_once(loop: Loop) -> Run:
    """One audit, in a report dir of its own; its row appended to the history, the metrics rewritten."""
    from spark_jobs import audit

    started_ms = int(time.time() * 1000)
    run_id = new_run_id(loop.report_dir, started_ms)
    run_dir = loop.report_dir / RUNS_DIR / run_id
    per_run = argparse.Namespace(**vars(loop.args))
    per_run.report = run_dir
    per_run.every = per_run.runs = per_run.keep_runs = per_run.metrics_textfile = None
    if loop.live:
        per_run.since = loop.since
    tee = _Tee(sys.stderr)
    with contextlib.redirect_stderr(tee):
        code = audit.main(per_run, loop.out, loop.spark)
    finished_ms = int(time.time() * 1000)
    report_path = run_dir / REPORT_FILE
    report = json.loads(report_path.read_text()) if code in (0, 1) and report_path.is_file() else None
    run = history.run_from_report(report, run_id, started_ms, finished_ms, code, "live" if loop.live else "file")
    run.report = str(run_dir.relative_to(loop.report_dir)) if run_dir.is_dir() else None
    run.error = tee.error() if code not in (0, 1) else None
    history.append(loop.report_dir, run)
    loop.runs.append(run)
    if run.verdict == history.VERDICT_CLEAN and loop.live:
        loop.since = run_dir
    if run_dir.is_dir():
        _point_latest(loop.report_dir, run_dir)
    _prune(loop.report_dir, loop.args.keep_runs or DEFAULT_KEEP_RUNS, keep=loop.since)
    if loop.args.metrics_textfile is not None:
        write_textfile(loop.args.metrics_textfile, loop.runs, str(loop.report_dir.resolve()), loop.kinds)
    return run


def _point_latest(report_dir: Path, run_dir: Path) -> None:
    link, temp = report_dir / LATEST, report_dir / f".{LATEST}.{os.getpid()}.tmp"
    try:
        temp.unlink(missing_ok=True)
        temp.symlink_to(run_dir.relative_to(report_dir))
        os.replace(temp, link)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        print(f"georep: warning: cannot point {link} to {run_dir} ({exc}); move {link} away", file=sys.stderr)


def _prune(report_dir: Path, keep_runs: int, keep: Path | None) -> None:
    """Remove the report dirs of all runs but the newest ``keep_runs`` and ``keep`` (only dirs named as runs)."""
    runs_dir = report_dir / RUNS_DIR
    if not runs_dir.is_dir():  # no run has written a report yet
        return
    dirs = sorted(p for p in runs_dir.iterdir() if p.is_dir() and _RUN_ID.match(p.name))
    for old in dirs[:-keep_runs]:
        if keep is None or old.resolve() != keep.resolve():
            shutil.rmtree(old, ignore_errors=True)


def _run_line(loop: Loop, run: Run, n: int) -> str:
    of = f" of {loop.args.runs}" if loop.args.runs else ""
    since = f", incremental from {run.since}" if run.since else ""
    return (
        f"audit run {n}{of} ({run.run_id}, {run.mode} mode{since}): {run.verdict}, exit {run.exit_code}, "
        f"{run.duration_s:.1f}s; history: {loop.report_dir / history.HISTORY_DIR}"
    )


def run_loop(loop: Loop, signals: Signals) -> int:
    """Runs until --runs is reached or a signal stops it; the exit code is the last run's."""
    every_s = loop.args.every or 0.0
    n = 0
    while True:
        started = time.monotonic()
        signals.wake.clear()  # a SIGUSR1 during this run asks for the next one at once
        run = run_once(loop)
        n += 1
        loop.out(_run_line(loop, run, n))
        if loop.args.runs is not None and n >= loop.args.runs:
            return run.exit_code
        wait_s = 0.0 if signals.wake.is_set() else max(0.0, started + every_s - time.monotonic())
        if not signals.stop.is_set() and wait_s > 0 and not loop.args.quiet:
            at = datetime.fromtimestamp(time.time() + wait_s, UTC).isoformat(timespec="seconds")
            loop.out(f"next run at {at.replace('+00:00', 'Z')} (in {wait_s:.0f}s; kill -USR1 {os.getpid()}: now)")
        if signals.wait(wait_s):
            loop.out(f"stopped by a signal after {n} run(s); the last exited {run.exit_code}")
            return run.exit_code


def main(args: argparse.Namespace, out: Callable[[str], None] = print, spark: Any = None) -> int:
    """``georep audit --every/--runs``: one Spark session (``spark``, or one started and stopped here) for every
    run."""
    try:
        _check_flags(args)
        runs, _skipped = history.read(Path(args.report))
    except HistoryError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return EXIT_USAGE
    from spark_jobs.checks import KINDS
    from spark_jobs.session import start_spark

    session = spark or start_spark(args.master)
    if session is None:
        return EXIT_USAGE
    since = args.since if getattr(args, "since", None) is not None else last_clean_run_dir(Path(args.report), runs)
    loop = Loop(args, out, session, runs, since, sorted(KINDS))
    try:
        with loop_signals() as signals:
            return run_loop(loop, signals)
    except (MetricsError, HistoryError) as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if spark is None:
            session.stop()
