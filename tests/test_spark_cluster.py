"""The audit on a real Spark cluster: a standalone master and two workers (pyspark's own ``spark-class``), the job
submitted with ``deploy/spark/submit.sh --master spark://...`` against three running sites over mutual TLS.

Nothing is shared on disk between the submitter and the executors but the sites' data: the executors run a Python
that has the third-party packages and not georep (:func:`python_without_checkout`), so they can import georep only
from the zip that submit.sh ships, and the report says where each of them took it from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from georep.proto import georep_pb2 as pb
from georep.security import dev_ca
from spark_jobs import inject
from spark_jobs.layout import list_segments
from tests.support.sites import TRIANGLE, Sites, converged, produce, wait_until
from tests.support.spark_cluster import SparkCluster, python_without_checkout

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "deploy" / "spark" / "submit.sh"
NAMES = ["a", "b", "c"]
TOPIC = "orders"
RECORDS_PER_SITE = 300
SEGMENT_BYTES = 8192  # several segments per partition: the flipped record lies in a sealed one
# As tests/conftest.py's session, for jobs this small (a few hundred batches): the JVMs' quick compiler and one GC
# thread, expressions interpreted rather than compiled, few shuffle partitions. The report does not depend on it.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
SMALL_JOB_CONF = {
    "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={REPO}/spark_jobs/log4j2.properties {QUICK_JVM}",
    "spark.executor.extraJavaOptions": QUICK_JVM,
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
}
SUBMIT_TIMEOUT_S = 900.0  # a submission takes 30-60 s on an idle 2-core machine; several times that under load


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    started = time.monotonic()
    spark = SparkCluster(tmp_path_factory.mktemp("spark-cluster")).start()
    took, cpu, load = time.monotonic() - started, sum(cpu_s(pid) for pid in spark.pids()), os.getloadavg()[0]
    print(f"spark master and 2 workers up in {took:.1f} s, {cpu:.1f} CPU-s (load {load:.1f}): {spark.master_url}")
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


def test_the_shipped_zip_holds_every_module_the_jobs_import(executor_python: Path, tmp_path: Path) -> None:
    """What submit.sh ships is importable with nothing else of georep around: every spark_jobs module (and what
    they import), and a namespace package (georep.kafka: no __init__.py, imported from a zip only when the zip
    lists its directory)."""
    shipped = tmp_path / "georep.zip"
    subprocess.run([str(REPO / "deploy" / "spark" / "georep-zip.sh"), str(shipped)], check=True)
    jobs = sorted(n[:-3].replace("/", ".") for n in zipfile.ZipFile(shipped).namelist() if n.startswith("spark_jobs/"))
    modules = [m for m in jobs if m.count(".") == 1 and not m.endswith("__init__")] + ["georep.kafka.gateway"]
    check = "import importlib, sys\nfor m in sys.argv[2:]:\n    f = importlib.import_module(m).__file__\n"
    check += "    assert f.startswith(sys.argv[1] + '/'), (m, f)\nprint(len(sys.argv) - 2)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(shipped)}
    done = subprocess.run(
        [str(executor_python), "-c", check, str(shipped), *modules], cwd="/", env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == str(len(modules)), done.stderr[-3000:]
    assert "spark_jobs.live_source" in modules and "spark_jobs.audit" in modules


def cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and of its children that it reaped (a worker's executors, once they end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Submission:
    """One ``deploy/spark/submit.sh`` job: the process (its own session), its log and its report dir."""

    job: subprocess.Popen[bytes]
    report: Path
    log: Path
    cluster_cpu_before: float
    ours_before: Any

    def driver_pid(self) -> int:
        """The driver's Python (spark-submit's JVM starts it): the process that runs the audit loop."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                argv = cmdline.split(b"\0")
                if (
                    int(stat[2]) == self.job.pid
                    and len(argv) > 1
                    and Path(argv[0].decode()).name.startswith("python")  # not spark-submit's JVM, whose args name it
                    and argv[1].endswith(b"spark_jobs/audit.py")
                ):
                    return int(entry.name)
        raise AssertionError("no driver Python in the job's process group")


def submit(cluster: SparkCluster, python: Path, sites: Sites, certs: Path, report: Path, *more: str) -> Submission:
    """``georep audit --live`` of ``sites`` through submit.sh on ``cluster``, started: see :func:`finish`.

    The auditor's TLS files are read by the driver, which hands them to the executors in the data source's options."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYSPARK_PYTHON=str(python), SPARK_LOCAL_IP="127.0.0.1")
    scratch = report.with_suffix(".driver")  # the driver's block manager and files served to executors
    scratch.mkdir()
    spark_args = ["--master", cluster.master_url, "--conf", f"spark.local.dir={scratch}"]
    for key, value in SMALL_JOB_CONF.items():
        spark_args += ["--conf", f"{key}={value}"]
    job_args = ["--live", "--topology", str(sites.topology), "--report", str(report), *more]
    tls_args = ["--tls-dir", str(certs), "--principal", "client:auditor", "--topics", TOPIC]
    log = report.with_suffix(".log")
    with open(log, "wb") as err:
        # Its own process group: spark-submit's JVM and the driver's Pythons go with it, even on a timeout.
        job = subprocess.Popen(
            [str(SUBMIT), *spark_args, "--", *job_args, *tls_args],
            cwd="/",
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    before = sum(cpu_s(pid) for pid in cluster.pids())
    return Submission(job, report, log, before, resource.getrusage(resource.RUSAGE_CHILDREN))


def finish(cluster: SparkCluster, submission: Submission) -> tuple[int, str]:
    """Wait for ``submission`` (killing its group on a timeout or failure): (exit code, stdout)."""
    job = submission.job
    try:
        stdout, _ = job.communicate(timeout=SUBMIT_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = submission.ours_before
    driver = ours.ru_utime + ours.ru_stime - before.ru_utime - before.ru_stime
    executors = sum(cpu_s(pid) for pid in cluster.pids()) - submission.cluster_cpu_before
    load = os.getloadavg()[0]
    name = submission.report.name
    print(f"{name}: driver side {driver:.1f} CPU-s, cluster side {executors:.1f} CPU-s (load {load:.1f})")
    out = stdout.decode(errors="replace")
    submission.report.with_suffix(".out").write_text(out)
    return job.returncode, out


def run_reports(report: Path) -> list[dict[str, Any]]:
    """The reports of the runs of a continuous audit written so far, oldest first."""
    return [json.loads(p.read_text()) for p in sorted((report / "runs").glob("*/report.json"))]


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


def flip_in_a_sealed_segment(data_dir: Path, past: dict[int, int]) -> tuple[str, int, int]:
    """A value byte flipped, CRC recomputed, in a record of another site's origin in a segment that is not its
    partition's last and starts at or past ``past[partition]`` (a cut's end): (origin, seq, partition)."""
    segments = list_segments({"b": data_dir}, (TOPIC,))
    for partition in (0, 1):
        for segment in [s for s in segments if s.partition == partition][:-1]:
            if segment.base_offset < past[partition]:
                continue
            for origin_site in ("a", "c"):
                try:
                    origin, seq, _position = inject.flip_value_byte_in_place(segment, origin_site)
                except inject.NothingToInject:
                    continue
                return origin, seq, partition
    raise AssertionError(f"no sealed segment of {TOPIC} at b past {past} holds a batch of a or c: more records?")


def batches_stored(sites: Sites, site: str) -> int:
    """Batches in the site's segment files of the topic, counted from the files (the node is quiet)."""
    return sum(len(inject._batches(s)) for s in list_segments({site: sites.nodes[site].data_dir}, (TOPIC,)))


def assert_progress(out: str, report: dict[str, Any], run: int) -> None:
    """The driver showed run ``run``'s stages and, per site, the digests its executors read (sent over UDP)."""
    done = [line for line in out.splitlines() if line.startswith("progress: done: ")][run]
    stages = re.search(r"(\d+) stage\(s\) done", done)
    assert stages and int(stages.group(1)) >= 1, done
    for site, read in report["read"]["per_site"].items():
        shown = re.search(rf"\| {site} ([\d,]+) digests [\d.,]+ MB of [\d.,]+ MB", done)
        assert shown and 0 < int(shown.group(1).replace(",", "")) <= read["digests"] * 2, done  # a task may rerun


def write_everywhere(sites: Sites, prefix: str) -> None:
    async def everyone() -> None:
        await asyncio.gather(
            *(produce(sites.address(s), TOPIC, f"{prefix}{s}", RECORDS_PER_SITE, 100, sites.tls) for s in NAMES)
        )

    asyncio.run(everyone())


def start_sites(tmp_path: Path) -> tuple[Sites, Path]:
    """Three TLS sites holding RECORDS_PER_SITE records of each origin in TOPIC; the auditor may read digests and
    fetch batches by coordinate, nothing else."""
    root = tmp_path / "sites"
    root.mkdir()
    certs = tmp_path / "certs"
    sites = Sites(root, NAMES, TRIANGLE, extra_args=["--segment-bytes-max", str(SEGMENT_BYTES)], tls_dir=certs)
    dev_ca.init(certs, dev_ca.plan(NAMES, {}, ["auditor"]))
    sites.start()
    for s in NAMES:
        sites.stub(s).PutAcl(pb.PutAclRequest(principal="client:auditor", operation="audit", resource="topic:**"))
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2), timeout=10)
    wait_until("the topic reaches b and c", lambda: all(sites.vectors(s, TOPIC) for s in ("b", "c")), 20)
    write_everywhere(sites, "")
    total = RECORDS_PER_SITE * len(NAMES)
    wait_until("every site holds every record", lambda: converged(sites, NAMES, TOPIC, total), 60)
    return sites, certs


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_live_audit_submitted_to_a_standalone_cluster_is_clean_then_names_a_flipped_byte(
    cluster: SparkCluster, executor_python: Path, tmp_path: Path
) -> None:
    """One submission, two runs of ``--every``: the first audits in full and is clean; then the sites take more
    records, b's copy of one of them is flipped, SIGUSR1 starts the second run at once, and that run (incremental:
    only what came after the first one's cut) names it, reading only digests and the two copies of its batch."""
    sites, certs = start_sites(tmp_path)
    try:
        report = tmp_path / "audits"
        started = time.monotonic()
        job = submit(cluster, executor_python, sites, certs, report, "--every", "1h", "--runs", "2")
        # "latest" points to a run once it is whole (report, history row)
        wait_until("the first run", lambda: (report / "latest").exists() or job.job.poll() is not None, 900)
        assert job.job.poll() is None, job.log.read_text()[-4000:]
        (clean,) = run_reports(report)
        print(f"first (full) run done in {time.monotonic() - started:.1f} s")
        total = RECORDS_PER_SITE * len(NAMES)
        assert clean["clean"] and clean["mode"] == "live" and clean["since"] is None, clean["counts"]
        assert {s: t["records"] for s, t in clean["sites"].items()} == {s: total for s in NAMES}
        assert clean["read"]["fetched_batches"] == 0
        stored = {s: batches_stored(sites, s) for s in NAMES}
        assert {s: r["digests"] for s, r in clean["read"]["per_site"].items()} == stored  # every digest, once
        assert clean["read"]["digest_bytes"] < clean["read"]["stored_bytes"] / 10
        assert_shipped(clean, cluster)

        write_everywhere(sites, "more")
        wait_until("every site holds the new records", lambda: converged(sites, NAMES, TOPIC, 2 * total), 60)
        b = sites.nodes["b"]
        b.stop()
        cut = {int(p): v[0] for p, v in clean["cut"]["sites"]["b"]["topics"][TOPIC].items()}
        origin, seq, partition = flip_in_a_sealed_segment(b.data_dir, cut)
        b.start()
        new = {s: batches_stored(sites, s) - stored[s] for s in NAMES}
        os.kill(job.driver_pid(), signal.SIGUSR1)  # the next run now, not in an hour
        code, out = finish(cluster, job)
        _clean, caught = run_reports(report)
        assert code == 1 and not caught["clean"], out
        found = [
            (i["kind"], i["site"], i["topic"], i["partition"], i["origin"], i["first_seq"]) for i in caught["issues"]
        ]
        assert found == [("mismatch", "b", TOPIC, partition, origin, seq)], out
        (issue,) = caught["issues"]
        reference = origin.split("@")[0]  # the origin's own copy is the reference (a or c)
        assert issue["reference_site"] == reference and issue["records"] == 1 and "record differs" in issue["detail"]
        assert issue["file"].startswith(f"b/{TOPIC}/{partition}@")
        assert f"mismatch at {TOPIC}/{partition} {origin}:{seq}" in out
        read = caught["read"]
        assert caught["since"]["taken_at_ms"] == clean["cut"]["taken_at_ms"]
        assert {s: r["digests"] for s, r in read["per_site"].items()} == new  # only what came after the first cut
        assert read["fetched_batches"] == 2  # b's copy and the reference's: every other batch was read as a digest
        assert read["per_site"][reference]["fetched_batches"] == 1 and read["per_site"]["b"]["fetched_batches"] == 1
        assert_shipped(caught, cluster)
        assert_progress(out, clean, 0)
        assert_progress(out, caught, 1)
        print(f"both runs in {time.monotonic() - started:.1f} s")
    finally:
        sites.close()
