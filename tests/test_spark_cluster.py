"""The audit on a real Spark cluster: a standalone master and two workers (pyspark's own ``spark-class``), the job
submitted with ``deploy/spark/submit.sh --master spark://...`` against three running sites over mutual TLS.

Nothing is shared on disk between the submitter and the executors but the sites' data: the executors run a Python
that has the third-party packages and not georep (:func:`python_without_checkout`), so they can import georep only
from the zip that submit.sh ships, and the report says where each of them took it from.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from georep.proto import georep_pb2 as pb
from spark_jobs import inject
from tests.support.sites import TRIANGLE, Sites, converged, produce, wait_until
from tests.support.spark_cluster import SparkCluster, python_without_checkout

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "deploy" / "spark" / "submit.sh"
NAMES = ["a", "b", "c"]
TOPIC = "orders"
RECORDS_PER_SITE = 300
SEGMENT_BYTES = 8192  # several segments per partition: the flipped record lies in a sealed one
SUBMIT_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    started = time.monotonic()
    spark = SparkCluster(tmp_path_factory.mktemp("spark-cluster")).start()
    print(f"spark standalone master and 2 workers up in {time.monotonic() - started:.1f} s ({spark.master_url})")
    try:
        yield spark
    finally:
        spark.close()


@pytest.fixture(scope="module")
def executor_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = python_without_checkout(tmp_path_factory.mktemp("executor-env") / "venv")
    # The environment is the test's premise: if it could import georep, the executors could without the zip.
    probe = subprocess.run([str(python), "-c", "import georep"], cwd="/", capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'georep'" in probe.stderr, probe.stderr
    return python


def submit(
    cluster: SparkCluster, python: Path, sites: Sites, report: Path, log: Path
) -> tuple[int, dict[str, Any], str]:
    """The file-mode audit of ``sites`` through submit.sh on ``cluster``: (exit code, report.json, stdout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYSPARK_PYTHON=str(python), SPARK_LOCAL_IP="127.0.0.1")
    args = [
        str(SUBMIT),
        "--master",
        cluster.master_url,
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--",
        "--topology",
        str(sites.topology),
        "--data-root",
        str(sites.topology.parent),
        "--report",
        str(report),
        "--as-of",
        "now",
    ]
    with open(log, "wb") as err:
        done = subprocess.run(args, cwd="/", env=env, stdout=subprocess.PIPE, stderr=err, timeout=SUBMIT_TIMEOUT_S)
    out = done.stdout.decode(errors="replace")
    if not (report / "report.json").exists():
        pytest.fail(f"submit.sh exited {done.returncode} without a report:\n{out}\n{log.read_text()[-4000:]}")
    return done.returncode, json.loads((report / "report.json").read_text()), out


def assert_shipped(report: dict[str, Any], cluster: SparkCluster) -> None:
    """Every executor ran on a worker of ``cluster``, in the Python without georep, with georep from the zip."""
    runtime = report["runtime"]
    assert runtime["master"] == cluster.master_url
    executors = runtime["executors"]
    assert executors, runtime
    for e in executors:
        assert Path(e["work_dir"]).is_relative_to(cluster.root), e
        assert ".zip/georep/" in e["georep"] and Path(e["georep"]).is_relative_to(cluster.root), e
        assert not Path(e["georep"]).is_relative_to(REPO), e
    # Spark's UI stays on under spark-submit (the session turns it off only for in-process local runs).
    assert runtime["ui"] and runtime["ui"].startswith("http://"), runtime


@pytest.mark.slow
def test_audit_submitted_to_a_standalone_cluster_is_clean_then_names_a_flipped_byte(
    cluster: SparkCluster, executor_python: Path, tmp_path: Path
) -> None:
    (tmp_path / "sites").mkdir()
    sites = Sites(tmp_path / "sites", NAMES, TRIANGLE, tls_dir=tmp_path / "tls")
    try:
        sites.start()
        config = {"segment_bytes_max": str(SEGMENT_BYTES)}
        sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2, config=config), timeout=10)
        wait_until("the topic reaches b and c", lambda: all(sites.vectors(s, TOPIC) for s in ("b", "c")), 20)

        async def everyone() -> None:
            await asyncio.gather(*(produce(sites.address(s), TOPIC, s, RECORDS_PER_SITE, tls=sites.tls) for s in NAMES))

        asyncio.run(everyone())
        total = RECORDS_PER_SITE * len(NAMES)
        wait_until("every site holds every record", lambda: converged(sites, NAMES, TOPIC, total), 60)

        started = time.monotonic()
        code, clean, out = submit(cluster, executor_python, sites, tmp_path / "clean", tmp_path / "clean.log")
        print(f"clean audit submitted and done in {time.monotonic() - started:.1f} s")
        assert code == 0 and clean["clean"], out
        assert {s: t["records"] for s, t in clean["sites"].items()} == {s: total for s in NAMES}
        assert_shipped(clean, cluster)

        sites.nodes["b"].stop()
        origin_a = f"a@{json.loads((sites.nodes['a'].data_dir / 'site.json').read_text())['epoch']}"
        seq = 7
        segment = inject.flip_value_byte_in_sealed_segment(
            sites.nodes["b"].data_dir / "logs" / f"{TOPIC}-1", origin_a, seq
        )
        code, caught, out = submit(cluster, executor_python, sites, tmp_path / "flipped", tmp_path / "flipped.log")
        assert code == 1 and not caught["clean"], out
        issues = [
            (i["kind"], i["site"], i["topic"], i["partition"], i["origin"], i["first_seq"]) for i in caught["issues"]
        ]
        assert issues == [("mismatch", "b", TOPIC, 1, origin_a, seq)], out
        assert caught["issues"][0]["reference_site"] == "a" and caught["issues"][0]["file"] == str(segment)
        assert f"mismatch at {TOPIC}/1 {origin_a}:{seq}" in out
        assert_shipped(caught, cluster)
        print(f"both audits in {time.monotonic() - started:.1f} s")
    finally:
        sites.close()
