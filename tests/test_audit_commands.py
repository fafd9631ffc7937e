"""``georep audit`` and ``georep delays`` as commands: usage errors, the verdict as the exit status, the delays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_jobs import inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_DIVERGENCE, EXIT_USAGE
from spark_jobs.layout import list_segments
from spark_jobs.sitegen import write_sites
from tests.support.audit import SITES, SPEC, part, synthetic_sites
from topology.model import default_topology


@pytest.fixture
def sites(tmp_path: Path) -> dict[str, Path]:
    return synthetic_sites(tmp_path)


def georep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=240)


def test_usage_errors_exit_2_with_what_to_do(tmp_path: Path) -> None:
    missing = georep("audit", "--data-root", str(tmp_path / "nowhere"), "--report", str(tmp_path / "r"))
    assert missing.returncode == EXIT_USAGE and "--data-root" in missing.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[sites.a]\n")
    topology = georep("audit", "--topology", str(bad), "--report", str(tmp_path / "r"))
    assert topology.returncode == EXIT_USAGE and "valid --topology" in topology.stderr
    no_report = georep("audit")
    assert no_report.returncode == EXIT_USAGE and "--report" in no_report.stderr
    write_sites(tmp_path / "data", SITES, SPEC)
    no_topic = georep(
        "audit", "--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r"), "--topics", "nothing-*"
    )
    assert no_topic.returncode == EXIT_USAGE and "no segment files of topics nothing-*" in no_topic.stderr
    as_of = georep("audit", "--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r"), "--as-of", "soon")
    assert as_of.returncode == EXIT_USAGE and "ISO-8601" in as_of.stderr


@pytest.mark.slow  # a multi-second run; make test runs it, make test-quick stays under 3 minutes
def test_georep_audit_exits_0_when_clean_and_1_on_divergence(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's verdict as its exit status, from its own argument parser (in this process, on the shared
    session: a process of its own would start a JVM per run; the usage errors above go through the process)."""
    from spark_jobs.audit import cli_parser, main

    dirs = write_sites(tmp_path / "data", SITES, SPEC)
    args = cli_parser().parse_args(["--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r")])
    assert main(args, spark=spark) == EXIT_CLEAN
    out = capsys.readouterr().out
    assert "CLEAN: no divergence" in out
    # Not on a terminal: the last status line, with the batches the readers counted for each site.
    (done,) = [line for line in out.splitlines() if line.startswith("progress: done: ")]
    assert all(f"| {site} " in done and " batches " in done for site in SITES), done
    runtime = json.loads((tmp_path / "r" / "report.json").read_text())["runtime"]
    assert runtime["master"].startswith("local") and runtime["executors"] == []  # probed on a cluster only
    inject.flip_value_byte(part(dirs, "c"), "b@1", 3)
    assert main(args, spark=spark) == EXIT_DIVERGENCE
    out = capsys.readouterr().out
    assert "DIVERGENCE" in out and "orders/0 b@1:3" in out
    assert json.loads((tmp_path / "r" / "report.json").read_text())["exit_code"] == EXIT_DIVERGENCE
    assert spark.range(3).count() == 3, "a session the caller passed is left running"


@pytest.mark.slow
def test_delays_per_path_origin_and_site_use_the_origin_append_time(
    spark: Any, sites: dict[str, Path], tmp_path: Path
) -> None:
    from spark_jobs.delays import run_delays

    doc = run_delays(spark, default_topology(), list_segments(sites), tmp_path / "d")
    rows = {(r["origin"], r["site"]): r for r in doc["delays"]}
    assert set(rows) == {(o + "@1", s) for o in SITES for s in SITES if o != s}
    # sitegen appends copies SPEC.delay_ms * (1, 2 or 3) after the origin did, in turn
    for r in rows.values():
        assert r["reference"] == "origin_append" and r["records"] == 2 * 200
        assert r["min_ms"] >= SPEC.delay_ms and r["max_ms"] <= 3 * SPEC.delay_ms
        assert SPEC.delay_ms <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert rows[("a@1", "b")]["path"] == "a->b"
    for png in ("delays_summary.png", "delays_over_time.png"):
        assert (tmp_path / "d" / png).read_bytes()[:4] == b"\x89PNG"
    without_origin = {s: d for s, d in sites.items() if s != "a"}
    fallback = run_delays(spark, default_topology(), list_segments(without_origin), tmp_path / "d2")
    ref = {r["reference"] for r in fallback["delays"] if r["origin"] == "a@1"}
    assert ref == {"producer_timestamp"}
