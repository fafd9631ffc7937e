"""The consistency audit (issue 5) on synthetic sites: clean, then each kind of injected divergence.

Sites are written straight through the storage layer (spark_jobs.sitegen), as
replication leaves them, then edited through it (spark_jobs.inject) so that
storage-level checks pass and only the cross-site comparison can catch them.
The tests on real, replicating processes are in test_audit_sites.py; a
multi-node site's copies in test_audit_replicas.py; the commands in
test_audit_commands.py. They run on two workers, each with its one JVM
(tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from georep.record.batch import RecordInput, decode_records, encode_batch, parse_header
from spark_jobs import inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_DIVERGENCE
from spark_jobs.layout import list_segments
from spark_jobs.sitegen import SiteSpec, write_sites
from tests.support.audit import (
    ALWAYS_IN_FLIGHT_MS,
    NEVER_IN_FLIGHT_MS,
    SITES,
    SPEC,
    audit,
    issues,
    part,
    synthetic_sites,
)
from topology.model import default_topology, parse_topology


@pytest.fixture
def sites(tmp_path: Path) -> dict[str, Path]:
    return synthetic_sites(tmp_path)


def test_clean_sites_give_a_clean_report_and_an_empty_parquet(
    spark: Any, sites: dict[str, Path], tmp_path: Path
) -> None:
    result = audit(spark, sites, tmp_path / "report")
    assert result.clean and result.exit_code == EXIT_CLEAN and result.report["issues"] == []
    assert {s: t["records"] for s, t in result.report["sites"].items()} == {s: 3 * 2 * 200 for s in SITES}
    on_disk = json.loads((tmp_path / "report" / "report.json").read_text())
    assert on_disk["clean"] is True and on_disk["counts"] == {}
    assert pq.read_table(tmp_path / "report" / "discrepancies.parquet").num_rows == 0
    assert "CLEAN" in result.summary[-2]


@pytest.mark.slow
def test_each_injected_divergence_is_named_by_site_coordinate_and_kind(
    spark: Any, sites: dict[str, Path], tmp_path: Path
) -> None:
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
        ("a", None, "c@1", 100),
        ("b", "a", "a@1", 57),
        ("b", None, "a@1", 20),
        ("c", None, "b@1", 40),
    }
    assert any("b vs a" in line and "orders/0 a@1:57" in line for line in result.summary)
    table = pq.read_table(tmp_path / "r" / "discrepancies.parquet").to_pylist()
    assert sorted((r["kind"], r["site"], r["first_seq"]) for r in table) == [
        ("duplicate", "a", 100),
        ("mismatch", "b", 57),
        ("missing", "c", 40),
        ("order", "b", 20),
    ]


@pytest.mark.slow
def test_a_batch_cut_otherwise_than_at_its_origin_is_a_mismatch(
    spark: Any, sites: dict[str, Path], tmp_path: Path
) -> None:
    """Same records, other batch boundaries: not the origin's bytes (dedup never re-cuts a batch)."""

    def split(batches: list[inject.Stored]) -> list[inject.Stored]:

        i = next(i for i, (_t, b) in enumerate(batches) if str(parse_header(b).origin) == "a@1")
        appended, batch = batches[i]
        records = [RecordInput(r.key, r.value, r.headers, r.timestamp_ms) for r in decode_records(batch)]
        h = parse_header(batch)
        halves = [
            (appended, encode_batch(records[:5], origin=h.origin, base_origin_seq=0)),
            (appended, encode_batch(records[5:], origin=h.origin, base_origin_seq=5)),
        ]
        return [*batches[:i], *halves, *batches[i + 1 :]]

    inject.rewrite_partition(part(sites, "c"), split)
    result = audit(spark, sites, tmp_path / "r")
    assert issues(result) == [("mismatch", "c", "orders", 0, "a@1", 0, 4), ("mismatch", "c", "orders", 0, "a@1", 5, 19)]
    assert all("other batches; the records themselves are identical" in i["detail"] for i in result.report["issues"])


def test_a_corrupt_batch_is_named_by_site_file_and_position(spark: Any, sites: dict[str, Path], tmp_path: Path) -> None:
    segment = next(s for s in list_segments(sites) if s.site == "c" and not s.last)
    inject.corrupt_byte(Path(segment.path), 200)
    result = audit(spark, sites, tmp_path / "r")
    corrupt = [i for i in result.report["issues"] if i["kind"] == "corrupt"]
    assert [(i["site"], i["file"], i["position"]) for i in corrupt] == [("c", segment.path, 0)]
    assert "CRC" in corrupt[0]["detail"]
    # its records are not counted as held: c now lacks them, in the middle of its log
    assert {i["kind"] for i in result.report["issues"]} == {"corrupt", "missing"}


@pytest.mark.slow
def test_a_site_behind_by_a_recent_tail_is_in_flight_and_an_old_one_is_missing(
    spark: Any, sites: dict[str, Path], tmp_path: Path
) -> None:
    for _ in range(2):  # b lacks a's last two batches of partition 0
        inject.rewrite_partition(part(sites, "b"), lambda batches: _drop_last_of(batches, "a@1"))
    recent = audit(spark, sites, tmp_path / "r1", as_of_ms=ALWAYS_IN_FLIGHT_MS)
    assert issues(recent) == [("in_flight", "b", "orders", 0, "a@1", 160, 199)]
    assert recent.clean and recent.exit_code == EXIT_CLEAN
    old = audit(spark, sites, tmp_path / "r2", as_of_ms=NEVER_IN_FLIGHT_MS)
    assert issues(old) == [("missing", "b", "orders", 0, "a@1", 160, 199)]
    assert old.report["issues"][0]["reference_site"] == "a" and not old.clean


def _drop_last_of(batches: list[inject.Stored], origin: str) -> list[inject.Stored]:

    last = max(i for i, (_t, b) in enumerate(batches) if str(parse_header(b).origin) == origin)
    return batches[:last] + batches[last + 1 :]


@pytest.mark.slow
def test_expected_reach_follows_link_filters(spark: Any, tmp_path: Path) -> None:
    """c's link from b carries only 'audit/**': c must not hold, and need not hold, 'orders'."""
    dirs = write_sites(tmp_path / "data", ["a", "b"], SPEC)
    write_sites(tmp_path / "data", ["c"], SiteSpec(topic="other", records_per_origin=20))
    text = "\n".join(
        [
            *(f'[sites.{s}]\nnodes = ["127.0.0.1:{7000 + i}"]' for i, s in enumerate(SITES)),
            '[[links]]\nsrc = "a"\ndst = "b"',
            '[[links]]\nsrc = "b"\ndst = "a"',
            '[[links]]\nsrc = "b"\ndst = "c"\ntopics = ["audit/**"]',
            '[[links]]\nsrc = "c"\ndst = "b"\ntopics = ["audit/**"]',
        ]
    )
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
