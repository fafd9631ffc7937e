"""The audit of a multi-node site: each segment's copies, one of which stands for the site (spark_jobs/replicas.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from georep.record.batch import RecordInput, decode_records, encode_batch, parse_header
from georep.storage.replica_store import REPLICA_LOG_CONFIG
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from spark_jobs import inject
from spark_jobs.audit import EXIT_DIVERGENCE
from spark_jobs.replicas import CopyStats, Parting, Side, choose_references, replica_issues
from spark_jobs.sitegen import segment_dir, to_cluster_site
from tests.support.audit import SITES, SPEC, audit, issues, synthetic_sites
from topology.ids import SiteId


@pytest.fixture
def sites(tmp_path: Path) -> dict[str, Path]:
    return synthetic_sites(tmp_path)


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


@pytest.mark.slow  # a 3-node site and two one-node sites, then Spark: 12 s of make test-quick's Spark worker
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
    assert choose_references(
        copies(("1", 200, 0), ("2", 100, 0), ("10", 100, 0)), [_parts("1", "2"), _parts("1", "10")]
    ) == {KEY: "2"}


def test_each_copy_that_parts_is_told_once_against_the_reference_copy() -> None:
    refs = {KEY: "2"}
    (one,) = replica_issues([_parts("1", "2"), _parts("1", "3")], refs)
    assert (one["kind"], one["divergence"], one["node"], one["reference_node"], one["segment"]) == (
        "replica_divergence",
        True,
        "1",
        "2",
        7,
    )
    assert (one["offset"], one["file"], one["origin"], one["first_seq"], one["last_seq"]) == (
        40,
        "/a/1/seg",
        "b@1",
        20,
        39,
    )
    assert "here batch CRC 0x00000011" in one["detail"] and "there batch CRC 0x00000022" in one["detail"]
    # 1 and 3 both extend the short reference copy 2, in two ways: told once, the later node against the earlier
    (past,) = replica_issues([_parts("1", "3", offset=90)], refs)
    assert (past["node"], past["reference_node"], past["offset"]) == ("3", "1", 90)
