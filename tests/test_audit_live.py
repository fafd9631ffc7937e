"""``georep audit --live`` against three running sites over mutual TLS, as an auditor with only the audit grant.

One topology for the module: sites a, b and c (one node each, small segments) and topic ``events`` for the
incremental runs. The audits run in this process on the shared Spark session, through the command's own parser
and entry point (``spark_jobs.audit.main``), so what is checked is what ``georep audit --live`` does. The audit
that is clean, then finds a flipped byte, runs on a Spark cluster (tests/test_spark_cluster.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from georep.proto import georep_pb2 as pb
from georep.security import dev_ca
from spark_jobs import inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_USAGE, cli_parser, main
from spark_jobs.layout import list_segments
from tests.support.sites import TRIANGLE, Sites, converged, produce, wait_until

NAMES = ["a", "b", "c"]
EVENTS = "events"


@dataclass
class Live:
    sites: Sites
    certs: Path

    def audit(
        self, report: Path, *more: str, principal: str = "client:auditor"
    ) -> tuple[int, dict[str, Any], list[str]]:
        """One ``georep audit --live`` as ``principal``; its exit status, report and printed lines."""
        args = cli_parser().parse_args(
            [
                "--live",
                "--topology",
                str(self.sites.topology),
                "--report",
                str(report),
                "--tls-dir",
                str(self.certs),
                "--principal",
                principal,
                *more,
            ]
        )
        lines: list[str] = []
        code = main(args, out=lines.append, spark=self.spark)
        doc = json.loads((report / "report.json").read_text()) if (report / "report.json").exists() else {}
        return code, doc, lines

    spark: Any = None


def batches_stored(sites: Sites, site: str, topic: str) -> int:
    """Batches in the site's segment files of ``topic``, counted from the files (the node is quiet)."""
    dirs = {site: sites.nodes[site].data_dir}
    return sum(len(inject._batches(s)) for s in list_segments(dirs, (topic,)))


def write(sites: Sites, topic: str, per_site: int, prefix: str, at: list[str]) -> None:
    async def everyone() -> None:
        await asyncio.gather(*(produce(sites.address(s), topic, f"{prefix}{s}", per_site, 100, sites.tls) for s in at))

    asyncio.run(everyone())


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("live")
    certs = root / "certs"
    sites = Sites(root, NAMES, TRIANGLE, extra_args=["--segment-bytes-max", "8192"], tls_dir=certs)
    dev_ca.init(certs, dev_ca.plan(NAMES, {}, ["auditor", "stranger"]))
    try:
        sites.start()
        for s in NAMES:  # the auditor may read digests (and fetch batches by coordinate), nothing else
            sites.stub(s).PutAcl(pb.PutAclRequest(principal="client:auditor", operation="audit", resource="topic:**"))
        sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=EVENTS, partitions=1))
        wait_until("the topics reach b and c", lambda: all(sites.vectors(s, EVENTS) for s in NAMES), 20)
        write(sites, EVENTS, 60, "e", ["a"])
        wait_until("every site holds every event", lambda: converged(sites, NAMES, EVENTS, 60), 30)
        yield Live(sites, certs)
    finally:
        sites.close()


@pytest.fixture
def on(live: Live, spark: Any) -> Live:
    live.spark = spark
    return live


@pytest.mark.slow
def test_an_incremental_live_audit_reads_only_what_came_after_the_previous_cut(on: Live, tmp_path: Path) -> None:
    """``--every --live``: the first run audits in full, the next only what the sites appended after its cut (new
    records written between the runs), both go into the history (spark_jobs/continuous.py); then a plain ``--since``
    of the second run, with nothing new, reads nothing."""
    from spark_jobs import history

    sites = on.sites
    before = {s: batches_stored(sites, s, EVENTS) for s in NAMES}

    def between_runs(line: str) -> None:
        if line.startswith("audit run 1 of 2"):
            write(sites, EVENTS, 30, "more", ["b"])
            wait_until("every site holds the new events", lambda: converged(sites, NAMES, EVENTS, 90), 30)

    report = tmp_path / "continuous"
    flags = ["--live", "--topology", str(sites.topology), "--report", str(report), "--tls-dir", str(on.certs)]
    args = cli_parser().parse_args(
        [*flags, "--principal", "client:auditor", "--topics", EVENTS, "--every", "0s", "--runs", "2"]
    )
    assert main(args, out=between_runs, spark=on.spark) == EXIT_CLEAN
    runs, skipped = history.read(report)
    assert [(r.mode, r.verdict) for r in runs] == [("live", "clean")] * 2 and skipped == []
    first, second = runs
    full = json.loads((report / "runs" / first.run_id / "report.json").read_text())
    since = json.loads((report / "runs" / second.run_id / "report.json").read_text())
    assert first.since is None and full["read"]["digests"] == sum(before.values())
    assert second.since == str(report / "runs" / first.run_id) and second.audited_records == 3 * 30
    new = {s: batches_stored(sites, s, EVENTS) - before[s] for s in NAMES}
    assert all(new.values())
    assert {s: r["digests"] for s, r in since["read"]["per_site"].items()} == new  # only the new batches
    assert {s: t["records"] for s, t in since["sites"].items()} == {s: 30 for s in NAMES}
    assert since["since"]["taken_at_ms"] == full["cut"]["taken_at_ms"]
    assert since["counts"] == {}
    assert second.bytes_moved > 0 and first.bytes_moved > 0  # the digest counts above say which batches moved

    code, again, _ = on.audit(tmp_path / "nothing", "--topics", EVENTS, "--since", str(report / "runs" / second.run_id))
    assert code == EXIT_CLEAN and again["read"]["digests"] == 0


def test_a_principal_without_the_audit_grant_gets_no_digest(
    on: Live, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _doc, _lines = on.audit(tmp_path / "stranger", "--topics", EVENTS, principal="client:stranger")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "ScanDigests of events/0" in err and "audit" in err, err


def test_live_usage_errors_say_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any site is asked: each with exit 2 and the fix."""

    def refused(*argv: str) -> str:
        args = cli_parser().parse_args(["--report", str(tmp_path / "r"), *argv])
        assert main(args) == EXIT_USAGE
        return capsys.readouterr().err

    assert "--since goes with --live" in refused("--since", str(tmp_path))
    assert "--no-replica-check goes with --live" in refused("--no-replica-check", "--data-root", str(tmp_path))
    assert "--no-replica-check goes with --live" in refused("--no-replica-check", "--every", "1h", "--runs", "1")
    assert "drop --data-root" in refused("--live", "--data-root", str(tmp_path))
    assert "positive" in refused("--live", "--insecure", "--max-slice-offsets", "0")
    assert "no report.json" in refused("--live", "--insecure", "--since", str(tmp_path / "nowhere"))
    (tmp_path / "file-mode").mkdir()
    (tmp_path / "file-mode" / "report.json").write_text(json.dumps({"clean": True, "format": 1}))
    assert "has no cut" in refused("--live", "--insecure", "--since", str(tmp_path / "file-mode"))
    (tmp_path / "diverged").mkdir()
    (tmp_path / "diverged" / "report.json").write_text(json.dumps({"clean": False, "cut": {}}))
    assert "found a divergence" in refused("--live", "--insecure", "--since", str(tmp_path / "diverged"))
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "report.json").write_text("{not json")
    assert "cannot read" in refused("--live", "--insecure", "--since", str(tmp_path / "garbled"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "pending.parquet").mkdir()
    (tmp_path / "odd" / "report.json").write_text(json.dumps({"clean": True, "cut": {"format": 1, "sites": 3}}))
    assert "cut is malformed" in refused("--live", "--insecure", "--since", str(tmp_path / "odd"))
    topology = tmp_path / "nobody.toml"
    topology.write_text('[sites.a]\nnodes = ["127.0.0.1:1"]\n')
    assert "site a did not answer" in refused("--live", "--insecure", "--topology", str(topology))


def test_an_incremental_seam_names_a_hole_and_a_repeat_after_the_previous_cut(spark: Any) -> None:
    """``checks.boundary_issues``: each site's first new batch of an origin must go on from what the site held at
    the previous cut. b held a@1 up to seq 9 and goes on at 15 (a hole, 10..14), c held up to 9 and goes on at 5
    (5..9 again), d goes on at 10 (nothing to say)."""
    from spark_jobs import checks
    from spark_jobs.datasource import spark_schema
    from spark_jobs.live_audit import HELD_ROWS
    from spark_jobs.scan import BATCH_SCHEMA

    def batch(site: str, base_seq: int, last_seq: int) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(BATCH_SCHEMA.names)
        row.update(site=site, topic=EVENTS, partition=0, file=f"{site}/f", position=0, status="ok", origin="a@1")
        row.update(
            origin_site="a", base_offset=100, base_seq=base_seq, last_seq=last_seq, records=1 + last_seq - base_seq
        )
        return row

    batches = spark.createDataFrame(
        [batch("b", 15, 20), batch("c", 5, 12), batch("d", 10, 12)], spark_schema(BATCH_SCHEMA)
    )
    held = spark.createDataFrame([(s, EVENTS, 0, "a@1", "a", 9) for s in "bcd"], HELD_ROWS)
    found = sorted(
        (r.kind, r.site, r.first_seq, r.last_seq, r.detail) for r in checks.boundary_issues(batches, held).collect()
    )
    assert [f[:4] for f in found] == [("duplicate", "c", 5, 9), ("missing", "b", 10, 14)]
    assert found[1][4] == "hole after the previous cut: seqs 10..14 absent, the log goes on at seq 15 (offset 100)"
    assert found[0][4] == "seqs 5..9 held again at offset 100, after the previous cut"
