"""The live audit's plan, without sites: the cut's round trip through report.json, where an incremental run
starts, which batches stay pending, and how ranges become input partitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_jobs import inject
from spark_jobs.cut import Cut, PartitionCut, SiteCut, start_offsets
from spark_jobs.layout import AuditInputError, list_segments
from spark_jobs.live_audit import held_rows, pending_floors
from spark_jobs.live_cli import error_text
from spark_jobs.live_source import Slice, open_channel, pack, plan_slices, slices_from_option, slices_option
from spark_jobs.scan import scan_segment
from spark_jobs.sitegen import SiteSpec, write_sites
from topology.model import default_topology


def _cut(ends: dict[str, int], epoch: int = 1, vector: dict[str, int] | None = None) -> Cut:
    sites = {
        s: SiteCut(s, epoch, {("t", 0): PartitionCut(end, vector or {"a@1": end}, f"127.0.0.1:{i + 1}")})
        for i, (s, end) in enumerate(ends.items())
    }
    return Cut(1_000, sites, 5, ("t",))


def test_the_cut_round_trips_through_json_and_a_malformed_one_is_refused() -> None:
    cut = _cut({"a": 10, "b": 7})
    assert Cut.from_json(json.loads(json.dumps(cut.to_json()))) == cut
    for broken in ({}, {"format": 2}, {"format": 1, "sites": []}, {"format": 1, "taken_at_ms": 1, "sites": {"a": 1}}):
        with pytest.raises(AuditInputError, match="cut"):
            Cut.from_json(broken)


def test_an_incremental_run_starts_at_the_previous_end_unless_the_log_was_rebuilt_or_cut_back() -> None:
    now = _cut({"a": 20, "b": 20, "c": 5})
    before = _cut({"a": 10, "b": 30})  # b: its log is shorter now than then; c: not in the previous cut
    assert start_offsets(now, before) == {("a", "t", 0): 10, ("b", "t", 0): 0, ("c", "t", 0): 0}
    assert start_offsets(now, _cut({"a": 10}, epoch=2))[("a", "t", 0)] == 0  # another incarnation of the site
    assert start_offsets(now, None) == {k: 0 for k in start_offsets(now, before)}
    assert held_rows(before, start_offsets(now, before)) == [("a", "t", 0, "a@1", "a", 9)]


def test_pending_batches_are_those_an_expected_site_lacked_at_the_cut() -> None:
    vectors = {"a": {"a@1": 30, "b@1": 4}, "b": {"a@1": 25, "b@1": 4}, "c": {"b@1": 4}}
    sites = {s: SiteCut(s, 1, {("t", 0): PartitionCut(9, v, "x:1")}) for s, v in vectors.items()}
    floors = pending_floors(default_topology(), Cut(0, sites))
    assert floors == [("t", 0, "a@1", 0), ("t", 0, "b@1", 4)]  # c holds none of a's: all of them are pending


def test_ranges_split_into_slices_and_pack_into_input_partitions_of_one_node() -> None:
    slices = plan_slices([("a", "h:1", "t", 0, 5, 25), ("a", "h:1", "t", 1, 0, 0), ("b", "h:2", "t", 0, 0, 3)], 8)
    assert [(s.site, s.from_offset, s.to_offset, s.first, s.audited_from) for s in slices] == [
        ("a", 5, 13, True, 5),
        ("a", 13, 21, False, 5),
        ("a", 21, 25, False, 5),
        ("b", 0, 3, True, 0),
    ]
    packs = pack(slices, 12)
    assert [[(s.site, s.from_offset) for s in p] for p in packs] == [[("a", 5)], [("a", 13), ("a", 21)], [("b", 0)]]
    assert slices_from_option(slices_option(slices, 12)) == packs
    with pytest.raises(AuditInputError, match="positive"):
        plan_slices([], 0)
    with pytest.raises(AuditInputError, match="not a list of slices"):
        slices_from_option('{"x": 1}')


def test_the_source_needs_tls_or_an_explicit_insecure() -> None:
    with pytest.raises(AuditInputError, match="tlsKeySecret"):
        open_channel("127.0.0.1:1", {"tlsca": "x"})
    with pytest.raises(AuditInputError, match="contradict"):
        open_channel("127.0.0.1:1", {"insecure": "true", "tlsca": "x"})
    assert Slice("a", "h", "t", 0, 0, 1).first


def test_an_executors_error_comes_out_of_sparks_wrapping() -> None:
    wrapped = RuntimeError("Py4JJavaError ...\n  File x\nspark_jobs.layout.AuditInputError: ScanDigests failed: X\n...")
    assert error_text(wrapped) == "ScanDigests failed: X"
    assert error_text(ValueError("one\ntwo")) == "one"


def test_a_value_byte_flipped_in_place_keeps_every_batch_valid_and_changes_one_crc(tmp_path: Path) -> None:
    dirs = write_sites(tmp_path, ["a", "b"], SiteSpec(topic="t", partitions=1, records_per_origin=40, batch_records=8))
    (segment, *_) = list_segments({"b": dirs["b"]}, ("t",))
    before = [s.header for s in scan_segment(segment)]
    origin, seq, position = inject.flip_value_byte_in_place(segment, "a")
    after = list(scan_segment(segment))
    assert all(s.status == "ok" for s in after) and len(after) == len(before)
    changed = [(b, s.header) for b, s in zip(before, after, strict=True) if b != s.header]
    ((old, new),) = changed
    assert new is not None and old is not None and old.crc != new.crc and new.base_origin_seq + 1 == seq
    assert after[[s.position for s in after].index(position)].header == new and str(new.origin) == origin
    with pytest.raises(inject.NothingToInject):
        inject.flip_value_byte_in_place(segment, "z")
