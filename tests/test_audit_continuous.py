"""``georep audit --every/--runs`` on the shared Spark session: runs appended to the history, a divergence planted
between runs in the history and the metrics, SIGTERM stopping the loop after the run in progress, and runs that could
not run recorded as such (tests/test_audit_history.py covers the history and metrics without Spark)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spark_jobs import history, inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_DIVERGENCE, EXIT_USAGE, cli_parser, main
from spark_jobs.continuous import LATEST, RUNS_DIR
from spark_jobs.history_cli import cli as history_cli
from spark_jobs.sitegen import write_sites
from tests.support.audit import NEVER_IN_FLIGHT_MS, SITES, SPEC, part


def samples(prom: Path) -> dict[tuple[str, str], float]:
    """(metric, kind or verdict label) -> value."""
    return {
        (s.name, s.labels.get("kind", s.labels.get("verdict", ""))): s.value
        for family in text_string_to_metric_families(prom.read_text())
        for s in family.samples
    }


@pytest.mark.slow  # three audits on the shared session: 10-20 s on a quiet machine
def test_every_appends_each_run_and_a_planted_divergence_shows_in_history_and_metrics(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = write_sites(tmp_path / "data", SITES, SPEC)
    report, prom = tmp_path / "r", tmp_path / "audit.prom"
    common = ["--data-root", str(tmp_path / "data"), "--report", str(report), "--as-of", str(NEVER_IN_FLIGHT_MS)]
    common += ["--metrics-textfile", str(prom), "--keep-runs", "2"]
    assert main(cli_parser().parse_args([*common, "--every", "0s", "--runs", "2"]), spark=spark) == EXIT_CLEAN
    runs, skipped = history.read(report)
    assert [r.verdict for r in runs] == [history.VERDICT_CLEAN] * 2 and skipped == []
    assert all(r.audited_records == 3 * 3 * 2 * 200 and r.findings == {} and r.mode == "file" for r in runs)
    assert samples(prom)[("georep_audit_divergent", "")] == 0
    capsys.readouterr()

    inject.flip_value_byte(part(dirs, "c"), "b@1", 3)  # planted between runs

    def stop_after_the_run(line: str) -> None:  # a SIGTERM while the run is on: it ends, and no other starts
        print(line)
        if line.startswith("georep audit of"):
            os.kill(os.getpid(), signal.SIGTERM)

    args = cli_parser().parse_args([*common, "--every", "1h"])
    assert main(args, out=stop_after_the_run, spark=spark) == EXIT_DIVERGENCE
    assert "stopped by a signal after 1 run(s)" in capsys.readouterr().out
    runs, _ = history.read(report)
    assert [r.verdict for r in runs] == ["clean", "clean", "divergence"]
    assert runs[-1].findings == {"mismatch": 1} and runs[-1].exit_code == EXIT_DIVERGENCE
    m = samples(prom)
    assert m[("georep_audit_divergent", "")] == 1 and m[("georep_audit_findings", "mismatch")] == 1
    assert m[("georep_audit_last_success_timestamp_seconds", "")] == runs[1].finished_at_ms / 1000
    assert m[("georep_audit_runs_total", "clean")] == 2 and m[("georep_audit_runs_total", "divergence")] == 1
    kept = sorted(p.name for p in (report / RUNS_DIR).iterdir())
    assert kept == [r.run_id for r in runs[1:]], "--keep-runs 2"
    assert (report / LATEST).resolve() == (report / RUNS_DIR / runs[-1].run_id).resolve()
    assert (report / LATEST / "report.json").is_file()

    assert history_cli([str(report)]) == 0
    out = capsys.readouterr().out
    assert "3 run(s)" in out and "2 clean, 1 divergent" in out and "mismatch 1" in out


def test_runs_that_cannot_run_are_recorded_with_their_error(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A site's data dir gone (an unmounted disk, a site down): each run fails, the loop goes on, and the history and
    the metrics say so; no Spark job runs."""
    report, prom = tmp_path / "r", tmp_path / "audit.prom"
    args = ["--data-root", str(tmp_path / "gone"), "--report", str(report), "--runs", "2", "--every", "0s"]
    assert main(cli_parser().parse_args([*args, "--metrics-textfile", str(prom)]), spark=spark) == EXIT_USAGE
    runs, _ = history.read(report)
    assert [r.verdict for r in runs] == [history.VERDICT_ERROR] * 2
    assert all(r.error is not None and "--data-root" in r.error and r.report is None for r in runs)
    assert "--data-root" in capsys.readouterr().err, "the run's message still reaches stderr"
    m = samples(prom)
    assert m[("georep_audit_last_run_failed", "")] == 1 and m[("georep_audit_last_run_exit_code", "")] == 2
    assert m[("georep_audit_last_success_timestamp_seconds", "")] == 0 and m[("georep_audit_divergent", "")] == 0
