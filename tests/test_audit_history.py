"""The continuous audit's history, metrics and flags, without Spark: durations, the history's Parquet files (damaged
ones included), ``georep audit history`` and its plot, the node_exporter textfile (checked by promtool when it is
installed). tests/test_audit_continuous.py runs the loop itself on Spark."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from georep.cli.main import main as georep_main
from spark_jobs import history
from spark_jobs.audit import EXIT_USAGE, cli_parser
from spark_jobs.audit import main as audit_main
from spark_jobs.audit_metrics import MetricsError, check_textfile_path, write_textfile
from spark_jobs.continuous import loop_signals, parse_duration
from spark_jobs.history import Run

T0_MS = 1_795_000_000_000
KINDS = ["corrupt", "in_flight", "mismatch", "missing"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(n: int, verdict: str = history.VERDICT_CLEAN, **kw: object) -> Run:
    exit_code = {history.VERDICT_CLEAN: 0, history.VERDICT_DIVERGENCE: 1, history.VERDICT_ERROR: 2}[verdict]
    fields: dict[str, object] = {
        "audited_batches": 60 + n,
        "audited_records": 1000 * (n + 1),
        "audited_bytes": 10_000 * (n + 1),
        "bytes_moved": 500,
        "report": f"runs/r{n}",
    }
    fields.update(kw)
    start = T0_MS + 60_000 * n
    return Run(f"r{n}", start, start + 2_500, "file", verdict, exit_code, **fields)  # type: ignore[arg-type]


def metrics(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "report"))): s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h", 3600), ("1h30m", 5400), ("500ms", 0.5), ("0s", 0)]
)
def test_durations_in_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "5x", "m", "1.5.3s", "5 m", "1h-5m", "tomorrow"])
def test_bad_every_is_a_usage_error_that_shows_a_duration(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_parser().parse_args(["--report", "r", "--every", text])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--every" in err and "not a duration" in err and "30s, 5m, 1h" in err


def test_flags_of_continuous_audits_need_every_or_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before Spark starts, each with what to do."""
    prom = tmp_path / "audit.prom"
    alone = audit_main(cli_parser().parse_args(["--report", str(tmp_path / "r"), "--metrics-textfile", str(prom)]))
    assert alone == EXIT_USAGE and "--runs 1" in capsys.readouterr().err
    for bad, says in ((tmp_path / "audit.txt", "*.prom"), (tmp_path / "nowhere" / "a.prom", "does not exist")):
        args = ["--report", str(tmp_path / "r"), "--runs", "1", "--metrics-textfile", str(bad)]
        assert audit_main(cli_parser().parse_args(args)) == EXIT_USAGE
        assert says in capsys.readouterr().err
    since = ["--report", str(tmp_path / "r"), "--runs", "2", "--since", str(tmp_path)]
    assert audit_main(cli_parser().parse_args(since)) == EXIT_USAGE
    assert "--since goes with --live" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["--report", "r", "--runs", "0"])
    assert "must be 1 or more" in capsys.readouterr().err


def test_history_appends_one_file_per_run_and_reads_them_in_order(tmp_path: Path) -> None:
    runs = [run(0), run(1, history.VERDICT_DIVERGENCE, findings={"mismatch": 2}, cut='{"format": 1}'), run(2)]
    for r in reversed(runs):
        history.append(tmp_path, r)
    files = sorted((tmp_path / history.HISTORY_DIR).iterdir())
    assert [f.name for f in files] == ["run-r0.parquet", "run-r1.parquet", "run-r2.parquet"], "no temporary file left"
    read, skipped = history.read(tmp_path)
    assert read == runs and skipped == []


def test_a_damaged_history_file_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    for n in range(3):
        history.append(tmp_path, run(n))
    damaged = tmp_path / history.HISTORY_DIR / "run-r1.parquet"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a truncated copy
    stray = tmp_path / history.HISTORY_DIR / "run-stray.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), stray)  # Parquet, but not a run
    (tmp_path / history.HISTORY_DIR / ".run-r3.parquet.99.tmp").write_bytes(b"half")  # an append in progress
    warnings: list[str] = []
    runs, skipped = history.read(tmp_path, warnings.append)
    assert [r.run_id for r in runs] == ["r0", "r2"]
    assert skipped == [damaged, stray]
    assert len(warnings) == 2 and str(damaged) in warnings[0] and str(stray) in warnings[1]
    assert "no column" in warnings[1]


def test_audit_history_summarizes_plots_and_reports_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through ``georep``'s own dispatch (``georep audit history``), in this process."""
    runs = [
        run(0),
        run(1, history.VERDICT_DIVERGENCE, findings={"mismatch": 1, "in_flight": 3}),
        run(2, history.VERDICT_ERROR, error="site b did not answer", report=None),
        run(3),
    ]
    for r in runs:
        history.append(tmp_path, r)
    plot = tmp_path / "h.png"
    assert georep_main(["audit", "history", str(tmp_path), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "4 run(s)" in out and "2 clean, 1 divergent, 1 could not run" in out
    assert "divergent runs: 1, the first r1" in out and "mismatch 1" in out
    assert plot.read_bytes()[:8] == PNG_MAGIC
    (tmp_path / history.HISTORY_DIR / "run-r3.parquet").write_bytes(b"PAR1 not really")
    assert georep_main(["audit", "history", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["runs"] == 3 and doc["last"]["verdict"] == history.VERDICT_ERROR
    assert doc["last"]["error"] == "site b did not answer" and doc["divergent_runs"] == ["r1"]
    assert doc["audited_bytes"]["total"] == 10_000 + 20_000, "the runs that reached a verdict"
    assert doc["skipped_files"] == [str(tmp_path / history.HISTORY_DIR / "run-r3.parquet")]
    assert "run-r3.parquet" in captured.err and "damaged" in captured.err


def test_audit_history_without_a_history_says_how_to_record_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert georep_main(["audit", "history", str(tmp_path)]) == EXIT_USAGE
    assert "georep audit --every" in capsys.readouterr().err
    (tmp_path / history.HISTORY_DIR).write_text("not a dir")
    assert georep_main(["audit", "history", str(tmp_path)]) == EXIT_USAGE
    assert "not a directory" in capsys.readouterr().err


def test_metrics_textfile_follows_the_verdicts(tmp_path: Path) -> None:
    prom = tmp_path / "audit.prom"
    check_textfile_path(prom)
    runs = [run(0)]
    write_textfile(prom, runs, "/r", KINDS)
    m = metrics(prom)
    assert m[("georep_audit_divergent", ())] == 0
    assert m[("georep_audit_last_success_timestamp_seconds", ())] == (T0_MS + 2_500) / 1000
    assert m[("georep_audit_findings", (("kind", "mismatch"),))] == 0
    runs.append(run(1, history.VERDICT_DIVERGENCE, findings={"mismatch": 2}))
    write_textfile(prom, runs, "/r", KINDS)
    m = metrics(prom)
    assert m[("georep_audit_divergent", ())] == 1 and m[("georep_audit_last_run_exit_code", ())] == 1
    assert m[("georep_audit_findings", (("kind", "mismatch"),))] == 2
    assert m[("georep_audit_last_success_timestamp_seconds", ())] == (T0_MS + 2_500) / 1000
    runs.append(run(2, history.VERDICT_ERROR, audited_bytes=0))
    write_textfile(prom, runs, "/r", KINDS)
    m = metrics(prom)
    assert m[("georep_audit_divergent", ())] == 1, "a run that could not run does not clear the divergence"
    assert m[("georep_audit_last_run_failed", ())] == 1
    assert m[("georep_audit_last_run_timestamp_seconds", ())] == (T0_MS + 120_000 + 2_500) / 1000
    assert m[("georep_audit_audited_bytes_total", ())] == 30_000
    assert m[("georep_audit_runs_total", (("verdict", "error"),))] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.prom"], "written through a renamed temporary file"


def test_metrics_textfile_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed, so the textfile is not linted: apt-get install -y prometheus")
    prom = tmp_path / "audit.prom"
    runs = [run(0), run(1, history.VERDICT_DIVERGENCE, findings={"mismatch": 2}), run(2, history.VERDICT_ERROR)]
    write_textfile(prom, runs, str(tmp_path), KINDS)
    checked = subprocess.run([promtool, "check", "metrics"], input=prom.read_text(), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_metrics_textfile_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    (tmp_path / "audit.prom").mkdir()
    with pytest.raises(MetricsError, match="cannot write"):
        write_textfile(tmp_path / "audit.prom", [run(0)], "/r", KINDS)


def test_sigterm_sets_the_stop_event_once_then_acts_as_before() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with loop_signals() as signals:
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(10), "the handler ran, and stops the loop"
        assert signal.getsignal(signal.SIGTERM) == before, "a second SIGTERM would act at once"
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigusr1_ends_the_wait_for_the_next_run_and_stops_nothing() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with loop_signals() as signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.wait(600) is False  # woken, not stopped (or this waits 600 s and pytest-timeout fails it)
        assert not signals.wake.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.wait(600) is False, "it stays installed for the next wait"
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_history_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    (tmp_path / history.HISTORY_DIR).write_text("a file where the history's dir goes")
    with pytest.raises(history.HistoryError, match="cannot create the history dir"):
        history.append(tmp_path, run(0))
