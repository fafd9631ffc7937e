"""The consistency audit (issue 5) on synthetic sites: clean, then each kind of injected divergence.

Sites are written straight through the storage layer (spark_jobs.sitegen), as
replication leaves them, then edited through it (spark_jobs.inject) so that
storage-level checks pass and only the cross-site comparison can catch them.
The tests on real, replicating processes are in test_audit_sites.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from georep.record.batch import RecordInput, decode_records, encode_batch, parse_header
from georep.storage.replica_store import REPLICA_LOG_CONFIG
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from spark_jobs import inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_DIVERGENCE, EXIT_USAGE, AuditResult, run_audit
from spark_jobs.layout import list_segments
from spark_jobs.replicas import CopyStats, Parting, Side, choose_references, replica_issues
from spark_jobs.sitegen import SiteSpec, segment_dir, to_cluster_site, write_sites
from topology.ids import SiteId
from topology.model import Topology, default_topology, parse_topology

SITES = ["a", "b", "c"]
SPEC = SiteSpec(topic="orders", partitions=2, records_per_origin=200, batch_records=20, segment_bytes_max=16_000)
NEVER_IN_FLIGHT_MS = 4_000_000_000_000  # an as-of in 2096: every gap is a divergence
ALWAYS_IN_FLIGHT_MS = 0


@pytest.fixture
def sites(tmp_path: Path) -> dict[str, Path]:
    return write_sites(tmp_path / "data", SITES, SPEC)


def audit(spark: Any, dirs: dict[str, Path], report: Path, as_of_ms: int = NEVER_IN_FLIGHT_MS,
          topology: Topology | None = None) -> AuditResult:  # fmt: skip
    return run_audit(spark, topology or default_topology(), dirs, list_segments(dirs), report, as_of_ms)


def issues(result: AuditResult) -> list[tuple[str, str, str | None, int, str, int, int]]:
    return sorted((i["kind"], i["site"], i["topic"], i["partition"], i["origin"], i["first_seq"], i["last_seq"])
                  for i in result.report["issues"])  # fmt: skip


def part(dirs: dict[str, Path], site: str, p: int = 0) -> Path:
    return dirs[site] / "logs" / f"{SPEC.topic}-{p}"


def test_clean_sites_give_a_clean_report_and_an_empty_parquet(spark: Any, sites: dict[str, Path],
                                                              tmp_path: Path) -> None:  # fmt: skip
    result = audit(spark, sites, tmp_path / "report")
    assert result.clean and result.exit_code == EXIT_CLEAN and result.report["issues"] == []
    assert {s: t["records"] for s, t in result.report["sites"].items()} == {s: 3 * 2 * 200 for s in SITES}
    on_disk = json.loads((tmp_path / "report" / "report.json").read_text())
    assert on_disk["clean"] is True and on_disk["counts"] == {}
    assert pq.read_table(tmp_path / "report" / "discrepancies.parquet").num_rows == 0
    assert "CLEAN" in result.summary[-2]


def test_each_injected_divergence_is_named_by_site_coordinate_and_kind(spark: Any, sites: dict[str, Path],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """Four edits to three sites' logs, each through the storage layer (CRCs valid), caught in one audit."""
    inject.flip_value_byte(part(sites, "b"), "a@1", 57)  # I1: one byte of one value, batch CRC recomputed
    inject.delete_batch(part(sites, "c", 1), "b@1", 45)  # I1 prefix: a batch gone from the middle of c's log
    inject.duplicate_batch(part(sites, "a"), "c@1", 100)  # I2: c's batch 100..119 appended again at a
    inject.swap_batches(part(sites, "b", 1), "a@1", 20)  # I3: a's batches 20..39 and 40..59 swapped at b
    result = audit(spark, sites, tmp_path / "r", as_of_ms=ALWAYS_IN_FLIGHT_MS)  # holes are never in flight
    assert not result.clean and result.exit_code == EXIT_DIVERGENCE
    assert issues(result) == [
        ("duplicate", "a", "orders", 0, "c@1", 100, 119),
        ("mismatch", "b", "orders", 0, "a@1", 57, 57),
        ("missing", "c", "orders", 1, "b@1", 40, 59),
        ("order", "b", "orders", 1, "a@1", 20, 39),
    ]
    by_kind = {i["kind"]: i for i in result.report["issues"]}
    assert by_kind["mismatch"]["reference_site"] == "a" and by_kind["mismatch"]["records"] == 1
    assert "record differs" in by_kind["mismatch"]["detail"]
    assert by_kind["duplicate"]["offset"] == 600  # the copy appended at the log end
    assert {(p["site"], p["reference_site"], p["origin"], p["first"]["first_seq"]) for p in result.report["pairs"]} == {
        ("a", None, "c@1", 100), ("b", "a", "a@1", 57), ("b", None, "a@1", 20), ("c", None, "b@1", 40)}  # fmt: skip
    assert any("b vs a" in line and "orders/0 a@1:57" in line for line in result.summary)
    table = pq.read_table(tmp_path / "r" / "discrepancies.parquet").to_pylist()
    assert sorted((r["kind"], r["site"], r["first_seq"]) for r in table) == [
        ("duplicate", "a", 100), ("mismatch", "b", 57), ("missing", "c", 40), ("order", "b", 20)]  # fmt: skip


def test_a_batch_cut_otherwise_than_at_its_origin_is_a_mismatch(spark: Any, sites: dict[str, Path],
                                                                  tmp_path: Path) -> None:  # fmt: skip
    """Same records, other batch boundaries: not the origin's bytes (dedup never re-cuts a batch)."""

    def split(batches: list[inject.Stored]) -> list[inject.Stored]:
        from georep.record.batch import RecordInput, decode_records, encode_batch, parse_header

        i = next(i for i, (_t, b) in enumerate(batches) if str(parse_header(b).origin) == "a@1")
        appended, batch = batches[i]
        records = [RecordInput(r.key, r.value, r.headers, r.timestamp_ms) for r in decode_records(batch)]
        h = parse_header(batch)
        halves = [(appended, encode_batch(records[:5], origin=h.origin, base_origin_seq=0)),
                  (appended, encode_batch(records[5:], origin=h.origin, base_origin_seq=5))]  # fmt: skip
        return [*batches[:i], *halves, *batches[i + 1 :]]

    inject.rewrite_partition(part(sites, "c"), split)
    result = audit(spark, sites, tmp_path / "r")
    assert issues(result) == [("mismatch", "c", "orders", 0, "a@1", 0, 4), ("mismatch", "c", "orders", 0, "a@1", 5, 19)]
    assert all("other batches; the records themselves are identical" in i["detail"] for i in result.report["issues"])


def test_a_corrupt_batch_is_named_by_site_file_and_position(spark: Any, sites: dict[str, Path],
                                                            tmp_path: Path) -> None:  # fmt: skip
    segment = next(s for s in list_segments(sites) if s.site == "c" and not s.last)
    inject.corrupt_byte(Path(segment.path), 200)
    result = audit(spark, sites, tmp_path / "r")
    corrupt = [i for i in result.report["issues"] if i["kind"] == "corrupt"]
    assert [(i["site"], i["file"], i["position"]) for i in corrupt] == [("c", segment.path, 0)]
    assert "CRC" in corrupt[0]["detail"]
    # its records are not counted as held: c now lacks them, in the middle of its log
    assert {i["kind"] for i in result.report["issues"]} == {"corrupt", "missing"}


def test_a_site_behind_by_a_recent_tail_is_in_flight_and_an_old_one_is_missing(spark: Any, sites: dict[str, Path],
                                                                               tmp_path: Path) -> None:  # fmt: skip
    for _ in range(2):  # b lacks a's last two batches of partition 0
        inject.rewrite_partition(part(sites, "b"), lambda batches: _drop_last_of(batches, "a@1"))
    recent = audit(spark, sites, tmp_path / "r1", as_of_ms=ALWAYS_IN_FLIGHT_MS)
    assert issues(recent) == [("in_flight", "b", "orders", 0, "a@1", 160, 199)]
    assert recent.clean and recent.exit_code == EXIT_CLEAN
    old = audit(spark, sites, tmp_path / "r2", as_of_ms=NEVER_IN_FLIGHT_MS)
    assert issues(old) == [("missing", "b", "orders", 0, "a@1", 160, 199)]
    assert old.report["issues"][0]["reference_site"] == "a" and not old.clean


def _drop_last_of(batches: list[inject.Stored], origin: str) -> list[inject.Stored]:
    from georep.record.batch import parse_header

    last = max(i for i, (_t, b) in enumerate(batches) if str(parse_header(b).origin) == origin)
    return batches[:last] + batches[last + 1 :]


def test_expected_reach_follows_link_filters(spark: Any, tmp_path: Path) -> None:
    """c's link from b carries only 'audit/**': c must not hold, and need not hold, 'orders'."""
    dirs = write_sites(tmp_path / "data", ["a", "b"], SPEC)
    write_sites(tmp_path / "data", ["c"], SiteSpec(topic="other", records_per_origin=20))
    text = "\n".join([*(f'[sites.{s}]\nnodes = ["127.0.0.1:{7000 + i}"]' for i, s in enumerate(SITES)),
                      '[[links]]\nsrc = "a"\ndst = "b"', '[[links]]\nsrc = "b"\ndst = "a"',
                      '[[links]]\nsrc = "b"\ndst = "c"\ntopics = ["audit/**"]',
                      '[[links]]\nsrc = "c"\ndst = "b"\ntopics = ["audit/**"]'])  # fmt: skip
    topology = parse_topology(text)
    dirs["c"] = tmp_path / "data" / "c"
    result = audit(spark, dirs, tmp_path / "r", topology=topology)
    # 'other' written at c reaches nobody (the links carry only audit/**): nothing is missing
    assert result.clean and result.report["issues"] == []
    shutil.copytree(part(dirs, "a"), part(dirs, "c"))  # c holds 'orders' that no link should have brought it
    result = audit(spark, dirs, tmp_path / "r", topology=topology)
    assert result.clean and issues(result) == [("unexpected", "c", "orders", 0, o, 0, 199) for o in ("a@1", "b@1")]
    shutil.rmtree(part(dirs, "c"))
    result = audit(spark, dirs, tmp_path / "r", topology=default_topology())
    kinds = {(i["kind"], i["site"], i["topic"]) for i in result.report["issues"]}
    assert ("missing", "c", "orders") in kinds and ("missing", "a", "other") in kinds


NODES = ["1", "2", "3", "4"]


@pytest.fixture
def cluster(sites: dict[str, Path]) -> dict[str, Path]:
    """Site a as a four-node site (replication factor 3; each partition 5 segments of 6 batches: 0 on nodes 1-3, 1 on
    2-4, 2 on 3, 4, 1, ...), b and c one-node sites holding the same records."""
    to_cluster_site(sites["a"], NODES, replication_factor=3, segment_batches=6)
    return sites


def _copy(dirs: dict[str, Path], node: str, partition: int, segment: int) -> Path:
    return segment_dir(dirs["a"], node, SPEC.topic, partition, segment)


def _append(copy: Path, batches: list[bytes], append_time_ms: int) -> None:
    log = SegmentLog.open(copy, REPLICA_LOG_CONFIG, 0)
    for batch in batches:
        log.append(parse_header(batch), [memoryview(batch)[24:]], append_time_ms)
    log.close()


def _rewritten(batch: bytes) -> bytes:
    """The same origin seqs as ``batch``, other values: what a deposed leader wrote that its successor's seal cut."""
    h = parse_header(batch)
    records = [RecordInput(r.key, b"unacknowledged", r.headers, r.timestamp_ms) for r in decode_records(batch, h)]
    return encode_batch(records, origin=h.origin, base_origin_seq=h.base_origin_seq)


def test_a_multi_node_site_audits_clean_against_one_node_sites_holding_the_same_records(
    spark: Any, cluster: dict[str, Path], tmp_path: Path
) -> None:
    """Copies of different lengths are the site's segment as far as the longest goes, and no further than the next
    segment's base: a member not told of a seal keeps a tail whose seqs the next segment assigns again."""
    # partition 0: node 4 keeps a tail of sealed segment 1 that the seal cut (segment 2 reuses its seqs) ...
    first_of_next = inject.read_partition(_copy(cluster, "3", 0, 2))[0][1]
    _append(_copy(cluster, "4", 0, 1), [_rewritten(first_of_next)], 1)
    # ... and the open segment 4's copies are at three lengths: only node 3 holds its last batch (not confirmed yet)
    for node, short_by in (("1", 2), ("2", 1)):
        held = inject.read_partition(_copy(cluster, node, 0, 4))
        end = parse_header(held[-1 - short_by][1]).next_offset
        SegmentLog.cut(_copy(cluster, node, 0, 4), REPLICA_LOG_CONFIG, end, 0).close()
    # partition 1: segment 5 has just opened, empty, on nodes 2-4; node 2 kept a tail of segment 4 past its seal
    for node in ("2", "3", "4"):
        SegmentLog.create_at(_copy(cluster, node, 1, 5), REPLICA_LOG_CONFIG, 600, {}, 0).close()
    stray = [RecordInput(b"k", b"cut by the seal", (), 1) for _ in range(3)]
    _append(_copy(cluster, "2", 1, 4), [encode_batch(stray, origin=Origin(SiteId("a"), 1), base_origin_seq=200)], 1)

    result = audit(spark, cluster, tmp_path / "r")
    assert result.clean and result.report["issues"] == [], result.summary
    assert {s: t["records"] for s, t in result.report["sites"].items()} == {s: 3 * 2 * 200 for s in SITES}
    assert result.report["sites"]["a"]["nodes"] == NODES and result.report["sites"]["b"]["nodes"] == []
    assert "read from 4 nodes' segment copies" in result.summary[1]


def test_a_flipped_byte_in_one_copy_is_a_replica_divergence_naming_the_node(
    spark: Any, cluster: dict[str, Path], tmp_path: Path
) -> None:
    """Segment 1 of partition 1 is on nodes 2, 3 and 4. Node 2's copy, the lowest node, gets one value bit flipped
    (its batch CRC recomputed, so the copy checks on its own): 3 and 4 agree, so node 3's copy stands for the site
    and the other sites see no difference; the site's copies do not, and the audit says which node parts where."""
    copy = _copy(cluster, "2", 1, 1)
    inject.flip_value_byte(copy, "b@1", 65)  # in b@1's batch 60..79, the 5th of segment 1: offset 200
    result = audit(spark, cluster, tmp_path / "r")
    assert not result.clean and result.exit_code == EXIT_DIVERGENCE
    assert issues(result) == [("replica_divergence", "a", "orders", 1, "b@1", 60, 79)], result.summary
    (issue,) = result.report["issues"]
    assert (issue["node"], issue["reference_node"], issue["segment"], issue["offset"]) == ("2", "3", 1, 200)
    assert issue["file"].startswith(str(copy)) and issue["reference_site"] is None and issue["records"] == 20
    assert "not prefixes of one another from offset 200" in issue["detail"]
    assert result.report["counts"] == {"replica_divergence": {"issues": 1, "records": 20}}
    assert any("a node 2 vs node 3: segment 1 of orders/1 parts at offset 200" in line for line in result.summary)
    (row,) = pq.read_table(tmp_path / "r" / "discrepancies.parquet").to_pylist()
    assert (row["kind"], row["node"], row["reference_node"], row["segment"]) == ("replica_divergence", "2", "3", 1)


KEY = ("a", "orders", 0, 7)


def _parts(node_a: str, node_b: str, offset: int = 40) -> Parting:
    here = Side(0x11, 500, 1_000, "b@1", 20, 39, 20, f"/a/{node_a}/seg", 1_000)
    there = Side(0x22, 500, 1_000, "b@1", 20, 39, 20, f"/a/{node_b}/seg", 1_000)
    return Parting(KEY, node_a, node_b, offset, here, there)


def test_the_copy_most_others_agree_with_stands_for_the_site_then_the_longest() -> None:
    """Plain Python on the driver, over Spark's few rows per segment: no JVM needed."""

    def copies(*spec: tuple[str, int, int]) -> list[CopyStats]:
        return [CopyStats(KEY, node, end, damaged) for node, end, damaged in spec]

    three = copies(("1", 100, 0), ("2", 100, 0), ("10", 100, 0))
    assert choose_references(three, []) == {KEY: "1"}  # all alike: the lowest node
    assert choose_references(copies(("1", 90, 0), ("10", 100, 0), ("2", 100, 0)), []) == {KEY: "2"}  # the longest
    assert choose_references(copies(("1", 100, 1), ("2", 100, 0)), []) == {KEY: "2"}  # then the undamaged
    # node 1 parts from both others: they agree, so one of them stands for the site, however long node 1's copy
    assert choose_references(copies(("1", 200, 0), ("2", 100, 0), ("10", 100, 0)),
                             [_parts("1", "2"), _parts("1", "10")]) == {KEY: "2"}  # fmt: skip


def test_each_copy_that_parts_is_told_once_against_the_reference_copy() -> None:
    refs = {KEY: "2"}
    (one,) = replica_issues([_parts("1", "2"), _parts("1", "3")], refs)
    assert (one["kind"], one["divergence"], one["node"], one["reference_node"], one["segment"]) == (
        "replica_divergence", True, "1", "2", 7)  # fmt: skip
    assert (one["offset"], one["file"], one["origin"], one["first_seq"], one["last_seq"]) == (40, "/a/1/seg", "b@1",
                                                                                             20, 39)  # fmt: skip
    assert "here batch CRC 0x00000011" in one["detail"] and "there batch CRC 0x00000022" in one["detail"]
    # 1 and 3 both extend the short reference copy 2, in two ways: told once, the later node against the earlier
    (past,) = replica_issues([_parts("1", "3", offset=90)], refs)
    assert (past["node"], past["reference_node"], past["offset"]) == ("3", "1", 90)


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
    no_topic = georep("audit", "--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r"),
                      "--topics", "nothing-*")  # fmt: skip
    assert no_topic.returncode == EXIT_USAGE and "no segment files of topics nothing-*" in no_topic.stderr
    as_of = georep("audit", "--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r"), "--as-of", "soon")
    assert as_of.returncode == EXIT_USAGE and "ISO-8601" in as_of.stderr


def test_georep_audit_exits_0_when_clean_and_1_on_divergence(spark: Any, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The command's verdict as its exit status, from its own argument parser (in this process, on the shared
    session: a process of its own would start a JVM per run; the usage errors above go through the process)."""
    from spark_jobs.audit import cli_parser, main

    dirs = write_sites(tmp_path / "data", SITES, SPEC)
    args = cli_parser().parse_args(["--data-root", str(tmp_path / "data"), "--report", str(tmp_path / "r")])
    assert main(args, spark=spark) == EXIT_CLEAN
    assert "CLEAN: no divergence" in capsys.readouterr().out
    inject.flip_value_byte(part(dirs, "c"), "b@1", 3)
    assert main(args, spark=spark) == EXIT_DIVERGENCE
    out = capsys.readouterr().out
    assert "DIVERGENCE" in out and "orders/0 b@1:3" in out
    assert json.loads((tmp_path / "r" / "report.json").read_text())["exit_code"] == EXIT_DIVERGENCE
    assert spark.range(3).count() == 3, "a session the caller passed is left running"


def test_delays_per_path_origin_and_site_use_the_origin_append_time(spark: Any, sites: dict[str, Path],
                                                                     tmp_path: Path) -> None:  # fmt: skip
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
