"""``georep drill --client kafka`` end to end (issue 13): unmodified confluent-kafka producers at two sites, a
group consuming at site a and committing, site a killed, the group resuming at site b's Kafka port with zero
records lost and zero delivered again relative to its last commit; the report is checked against its own
independent count."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.kafka_nodes import KAFKA_ARGS
from tests.support.sites import Sites

pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.slow


def test_kafka_drill_fails_a_group_over_exactly(make_sites: Callable[..., Sites], tmp_path: Path) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")], extra_args=[*KAFKA_ARGS, "--kafka-commit-acks", "geo:2"])
    sites.start()
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "georep.cli",
            "drill",
            "--client",
            "kafka",
            "--topology",
            str(sites.topology),
            "--data-dir",
            str(tmp_path),
            "--report",
            str(report),
            "--warmup",
            "4",
            "--after",
            "3",
            "--rate",
            "100",
            "--partitions",
            "2",
            "--no-restart",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every promise kept" in proc.stdout
    doc = json.loads(report.read_text())
    assert doc["committed_records"] > 0 and doc["delivered_after"] > 0
    assert doc["duplicates_relative_to_commit"] == doc["lost"] == 0
    # The records delivered after the failover are those the failover site holds beyond the commit (some twice,
    # if the new group rebalanced under them).
    assert doc["delivered_after"] == doc["expected_after"] + doc["delivered_twice_after"]
