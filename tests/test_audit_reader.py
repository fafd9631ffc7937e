"""The audit's reader: segment files written by the storage layer, read back as Arrow and through Spark."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from georep.record.batch import RecordInput, decode_records, encode_batch, parse_header
from georep.record.compression import Compression
from georep.storage.api import LogConfig
from georep.storage.replica_store import REPLICA_LOG_CONFIG
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from spark_jobs.layout import AuditInputError, list_segments, parse_site_dirs, site_dirs_from_topology
from spark_jobs.scan import BATCH_SCHEMA, RECORD_SCHEMA, read_batches, read_records, record_hash
from topology.ids import SiteId
from topology.model import default_topology

A1 = Origin(SiteId("a"), 1)
B7 = Origin(SiteId("b"), 7)


def write_log(part_dir: Path, batches: list[bytes], segment_bytes_max: int = 1 << 30) -> None:
    log = SegmentLog.open(part_dir, LogConfig(segment_bytes_max=segment_bytes_max), 0)
    for i, batch in enumerate(batches):
        log.append(parse_header(batch), [memoryview(batch)[24:]], 10_000 + i)
    log.close()


def batch(origin: Origin, seq: int, n: int = 3, compression: Compression = Compression.NONE) -> bytes:
    records = [
        RecordInput(
            None if i == 1 else b"k%d" % (seq + i),
            b"v%d" % (seq + i) * 5,
            [("h", b"x")] if i == 2 else [],
            1_000 + seq + i,
        )
        for i in range(n)
    ]
    return encode_batch(records, origin=origin, base_origin_seq=seq, compression=compression)


def site_with(tmp_path: Path, batches: list[bytes], topic: str = "orders/eu", segment_bytes_max: int = 1 << 30) -> Path:
    site = tmp_path / "a"
    write_log(site / "logs" / f"{topic.replace('/', '%2F')}-0", batches, segment_bytes_max)
    return site


def rows(batches: list[pa.RecordBatch]) -> list[dict[str, object]]:
    return pa.Table.from_batches(batches).to_pylist() if batches else []


@pytest.mark.parametrize("compression", list(Compression))
def test_records_come_back_with_their_coordinates_and_hashes_across_segments(
    tmp_path: Path, compression: Compression
) -> None:
    written = [
        batch(A1, 0, compression=compression),
        batch(B7, 0, compression=compression),
        batch(A1, 3, compression=compression),
        batch(B7, 3, 2, compression=compression),
    ]
    site = site_with(tmp_path, written, segment_bytes_max=2 * len(written[0]))
    segments = list_segments({"a": site})
    assert len(segments) > 1 and [s.last for s in segments][-1] and not segments[0].last
    assert {(s.site, s.topic, s.partition) for s in segments} == {("a", "orders/eu", 0)}
    got = [r for s in segments for b in read_records(s) for r in rows([b])]
    assert all(r["status"] == "ok" for r in got)
    expected = [r for b in written for r in decode_records(b)]
    assert [(r["origin"], r["origin_seq"], r["offset"]) for r in got] == [
        (str(r.origin), r.origin_seq, i) for i, r in enumerate(expected)
    ]
    assert [r["record_hash"] for r in got] == [record_hash(r) for r in expected]
    assert [r["timestamp_ms"] for r in got] == [r.timestamp_ms for r in expected]
    assert got[1]["key_hash"] is None and got[0]["key_hash"] is not None
    assert [r["append_time_ms"] for r in got][:6] == [10_000] * 3 + [10_001] * 3
    assert len({r["record_hash"] for r in got if r["origin"] == "a@1"}) == 6
    per_batch = rows([b for s in segments for b in read_batches(s)])
    assert [(r["origin"], r["base_seq"], r["last_seq"], r["records"]) for r in per_batch] == [
        ("a@1", 0, 2, 3),
        ("b@7", 0, 2, 3),
        ("a@1", 3, 5, 3),
        ("b@7", 3, 4, 2),
    ]


def test_schemas_are_what_spark_is_told() -> None:
    from spark_jobs.datasource import spark_schema

    for schema in (RECORD_SCHEMA, BATCH_SCHEMA):
        assert spark_schema(schema).fieldNames() == schema.names


def test_a_corrupt_batch_is_a_row_naming_file_and_position_and_the_next_batches_are_still_read(tmp_path: Path) -> None:
    written = [batch(A1, 0), batch(A1, 3), batch(A1, 6)]
    site = site_with(tmp_path, written)
    (segment,) = list_segments({"a": site})
    position = len(written[0])
    with open(segment.path, "r+b") as f:  # flip a value byte of the second batch, CRC left as it was
        f.seek(position + 120)
        b = f.read(1)
        f.seek(position + 120)
        f.write(bytes([b[0] ^ 0xFF]))
    got = rows(list(read_records(segment)))
    bad = [r for r in got if r["status"] != "ok"]
    assert [(r["status"], r["file"], r["position"], r["offset"]) for r in bad] == [
        ("corrupt", segment.path, position, 3)
    ]
    assert "CRC mismatch" in str(bad[0]["error"])
    assert [r["origin_seq"] for r in got if r["status"] == "ok"] == [0, 1, 2, 6, 7, 8]


def test_a_torn_tail_of_the_newest_segment_is_not_corruption_unless_below_the_recovery_point(tmp_path: Path) -> None:
    written = [batch(A1, 0), batch(A1, 3)]
    site = site_with(tmp_path, written)
    (segment,) = list_segments({"a": site})
    os.truncate(segment.path, segment.size_bytes - 5)  # a write in progress, or a crash before the fsync
    # listed before the truncation (as when recovery cuts a torn tail at a restart): a short read, not a crash
    assert [r["status"] for r in rows(list(read_batches(replace(segment, recovery_point=0))))] == ["ok", "torn_tail"]
    torn = replace(segment, size_bytes=segment.size_bytes - 5, recovery_point=0)
    got = rows(list(read_batches(torn)))
    assert [(r["status"], r["position"]) for r in got] == [("ok", 0), ("torn_tail", len(written[0]))]
    durable = replace(torn, recovery_point=6)  # the node had fsynced both batches: damage, not a tail
    assert [r["status"] for r in rows(list(read_batches(durable)))] == ["ok", "corrupt"]
    sealed = replace(torn, last=False)  # a sealed segment is never written again
    assert [r["status"] for r in rows(list(read_batches(sealed)))] == ["ok", "corrupt"]
    os.unlink(segment.path)  # retention deleted it after the listing
    assert list(read_batches(segment)) == [] and list(read_records(segment)) == []


def test_bytes_appended_after_listing_are_not_read(tmp_path: Path) -> None:
    site = site_with(tmp_path, [batch(A1, 0)])
    (segment,) = list_segments({"a": site})
    log = SegmentLog.open(Path(segment.path).parent, LogConfig(), 0)
    extra = batch(A1, 3)
    log.append(parse_header(extra), [memoryview(extra)[24:]], 20_000)
    half = extra[: len(extra) // 2]  # and a torn write after it
    with open(segment.path, "ab") as f:
        f.write(half)
    log.close()
    assert [r["base_seq"] for r in rows(list(read_batches(segment)))] == [0]
    (now,) = list_segments({"a": site})
    assert [r["status"] for r in rows(list(read_batches(now)))] == ["ok", "ok", "torn_tail"]


def test_bad_input_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(AuditInputError, match="--data-root"):
        site_dirs_from_topology(default_topology(), tmp_path / "nope")
    (tmp_path / "a").mkdir()
    with pytest.raises(AuditInputError, match=r"no data dir for site\(s\) b, c"):
        site_dirs_from_topology(default_topology(), tmp_path)
    with pytest.raises(AuditInputError, match="not a georep site data dir"):
        list_segments({"a": tmp_path / "a"})
    with pytest.raises(AuditInputError, match="expected SITE=DIR"):
        parse_site_dirs("a:/x")


def write_copy(site: Path, node: str, segment_id: int, base: int, batches: list[bytes]) -> Path:
    """One node's copy of a segment of orders/eu-0, as a member's ReplicaStore keeps it."""
    copy = site / node / "replicas" / "orders%2Feu-0" / f"{segment_id:010d}"
    log = SegmentLog.create_at(copy, REPLICA_LOG_CONFIG, base, {}, 0)
    for i, b in enumerate(batches):
        log.append(parse_header(b), [memoryview(b)[24:]], 10_000 + i)
    log.close()
    return copy


def test_a_multi_node_site_is_listed_copy_by_copy_with_where_each_segment_ends(tmp_path: Path) -> None:
    """Every node dir's copies are listed, in segment then node order (node 2 before 10), each with the base of the
    site's next segment, even an empty one; a segment being created (.new) and a node's logs/ are not read."""
    site = tmp_path / "a"
    s0, s1, s2 = [batch(A1, 0)], [batch(A1, 3), batch(B7, 0)], [batch(A1, 6)]
    write_copy(site, "1", 0, 0, s0)
    write_copy(site, "10", 0, 0, s0)
    write_copy(site, "2", 1, 3, s1)
    write_copy(site, "10", 1, 3, s1[:1])  # short: it missed the end of the stream
    write_copy(site, "1", 2, 9, s2)
    write_copy(site, "2", 3, 12, [])  # just opened, empty
    (site / "2" / "replicas" / "orders%2Feu-0" / "0000000004.new").mkdir()
    write_log(site / "1" / "logs" / "orders%2Feu-0", [batch(B7, 0)])  # not where a node of a multi-node site writes
    segments = list_segments({"a": site})
    assert [(s.node, s.segment_id, s.base_offset, s.segment_end, s.log_start_offset) for s in segments] == [
        ("1", 0, 0, 3, 0),
        ("10", 0, 0, 3, 0),
        ("2", 1, 3, 9, 0),
        ("10", 1, 3, 9, 0),
        ("1", 2, 9, 12, 0),
        ("2", 3, 12, None, 0),
    ]
    assert all(s.last and s.topic == "orders/eu" and s.partition == 0 for s in segments)
    got = rows(list(read_batches(segments[3])))
    assert [(r["node"], r["segment"], r["base_offset"], r["status"]) for r in got] == [("10", 1, 3, "ok")]
    assert segments[3].path.startswith(str(site / "10" / "replicas"))
    assert rows(list(read_batches(segments[0])))[0]["node"] == "1"
    one_node = rows(list(read_batches(list_segments({"b": site_with(tmp_path / "b", s0)})[0])))
    assert (one_node[0]["node"], one_node[0]["segment"]) == (None, None)
    with pytest.raises(AuditInputError, match=r"one node of a multi-node site.*pass the site's dir"):
        list_segments({"a": site / "2"})


def test_the_spark_source_reads_sites_in_parallel_with_a_topic_filter(tmp_path: Path, spark) -> None:
    site = site_with(tmp_path, [batch(A1, 0), batch(B7, 0, 4)], segment_bytes_max=200)
    write_log(site / "logs" / "other-0", [batch(A1, 0)])
    df = spark.read.format("georep").option("sites", f"a={site}").option("topics", "orders/*").load()
    assert df.rdd.getNumPartitions() == 2  # one per segment
    assert sorted((r.origin, r.origin_seq) for r in df.select("origin", "origin_seq").collect()) == [
        ("a@1", 0),
        ("a@1", 1),
        ("a@1", 2),
        ("b@7", 0),
        ("b@7", 1),
        ("b@7", 2),
        ("b@7", 3),
    ]
    everything = spark.read.format("georep").option("sites", f"a={site}").option("level", "batches").load()
    assert sorted(r.topic for r in everything.collect()) == ["orders/eu", "orders/eu", "other"]
    topology = tmp_path / "one-site.toml"
    topology.write_text('[sites.a]\nnodes = ["127.0.0.1:7101"]\n')
    by_root = (
        spark.read.format("georep")
        .option("dataRoot", str(tmp_path))
        .option("topology", str(topology))
        .option("topics", "other")
        .load()
    )
    assert [(r.site, r.topic, r.origin_seq) for r in by_root.collect()] == [("a", "other", s) for s in range(3)]
    (second,) = [r for r in everything.collect() if r.origin == "b@7"]
    one = (
        spark.read.format("georep")
        .option("sites", f"a={site}")
        .option("batchPositions", json.dumps({second.file: [second.position]}))
        .load()
    )
    assert sorted((r.origin, r.origin_seq) for r in one.collect()) == [("b@7", s) for s in range(4)]
