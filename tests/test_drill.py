"""``georep drill`` end to end: its report must match an independent count of what the sites hold."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from georep.server.process import NODE_INFO
from tests.support.sites import TRIANGLE, Sites, read_site, wait_until

pytestmark = pytest.mark.slow


def kill_restarted(sites: Sites) -> None:
    """The drill restarts the killed node as a detached process: stop it too."""
    for node in sites.nodes.values():
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads((node.data_dir / NODE_INFO).read_text())["pid"])
            if node.proc is None or pid != node.proc.pid:
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["kill", "isolate"])
def test_drill_keeps_its_promises_and_its_report_matches_an_independent_count(
    make_sites: Callable[..., Sites], tmp_path: Path, mode: str
) -> None:
    sites = make_sites(["a", "b", "c"], TRIANGLE)
    sites.start()
    report_path = tmp_path / "report.json"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "georep.cli",
                "drill",
                "--topology",
                str(sites.topology),
                "--data-dir",
                str(tmp_path),
                "--report",
                str(report_path),
                "--mode",
                mode,
                "--warmup",
                "2",
                "--after",
                "2",
                "--rate",
                "100",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "every promise kept" in proc.stdout
        doc = json.loads(report_path.read_text())
        topic = doc["topic"]
        wait_until("every site is back", lambda: all(sites.vectors(s, topic) for s in "abc"), 30)
        held = {s: read_site(sites, s, topic) for s in "abc"}
    finally:
        kill_restarted(sites)
    # Independent count: every site holds the same records, and the report says how many.
    values = {s: sorted(r[3] or b"" for recs in parts.values() for r in recs) for s, parts in held.items()}
    assert values["a"] == values["b"] == values["c"]
    assert doc["records_in_topic"] == len(values["a"]) == doc["delivered_unique"]
    per_level: dict[str, int] = {}
    for value in values["a"]:
        _site, level, _ = value.decode().split("|")
        per_level[level] = per_level.get(level, 0) + 1
    for level, figures in doc["acks"].items():
        # Everything acked is in the topic (nothing lost after the rejoin), and nothing was stored unsent.
        assert figures["acked"] <= per_level[level] <= figures["sent"]
        assert figures["lost_after_rejoin"] == 0
    assert doc["acks"]["geo:2"]["rpo_lost"] == 0
    assert doc["duplicates_vs_commit"] == 0 and doc["never_delivered"] == 0
    assert doc["rto_ms"] > 0 and doc["commits"] > 0
    assert doc["records_acked"] == sum(f["acked"] for f in doc["acks"].values())


def test_drill_usage_errors_exit_2(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "georep.cli", "drill", "--topology", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "nope.toml" in bad.stderr
    (tmp_path / "t.toml").write_text(
        '[sites.a]\nnodes = ["127.0.0.1:1"]\n[sites.b]\nnodes = ["127.0.0.1:2"]\n[[links]]\nsrc = "a"\ndst = "b"\n'
    )
    down = subprocess.run(
        [sys.executable, "-m", "georep.cli", "drill", "--topology", str(tmp_path / "t.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 2 and "does not answer" in down.stderr and "georep up" in down.stderr
