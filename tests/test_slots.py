"""The pure plan of what a segment holds (georep/storage/slots.py), against the bytes a log really had.

A segment of real batches is damaged (bits flipped, a range zeroed, the tail torn) and, independently, its origin
index is damaged; the plan must then either be refused, or say exactly what is there: the batches whose bytes
are whole (and whatever an index claims about them does not matter), the damaged slots with the coordinates the
batches really had, never a cut below the durable end.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st

from georep.record.batch import CRC_START, REWRITTEN_BYTES, RecordInput, encode_batch, local_prefix, parse_header
from georep.record.batch import stamp_origin as stamp
from georep.storage.index_format import ORIGIN_ENTRY_BYTES, OriginEntry, entry_for, iter_origin_entries, pack_entries
from georep.storage.segment import LogBytes
from georep.storage.slots import Good, Lost, SegmentPlan, plan_segment
from offsets.coordinates import Origin
from tests.support.examples import examples
from topology.ids import SiteId

BASE = 1000
ORIGINS = [Origin(SiteId("a"), 1), Origin(SiteId("b"), 7)]


def build(counts: list[tuple[int, int]]) -> tuple[bytes, list[OriginEntry]]:
    """A segment of batches (origin index, record count), stored from offset BASE; its bytes and true entries."""
    data = bytearray()
    entries: list[OriginEntry] = []
    seqs = [0, 0]
    offset = BASE
    for origin, count in counts:
        raw = encode_batch([RecordInput(b"k", b"v%d" % i, (), 5_000 + i) for i in range(count)])
        head, crc = stamp(raw, ORIGINS[origin], seqs[origin])
        header = parse_header(head)
        batch = local_prefix(offset, header.batch_length, 77 + offset, crc) + head[REWRITTEN_BYTES:] + raw[len(head) :]
        entries.append(entry_for(parse_header(batch), offset, len(data), 77 + offset))
        data += batch
        seqs[origin] += count
        offset += count
    return bytes(data), entries


@contextmanager
def as_file(data: bytes) -> Iterator[LogBytes]:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        yield LogBytes(f.fileno(), len(data))
        os.fsync(f.fileno())


def plan(data: bytes, evidence: list[OriginEntry] | None, next_base: int | None, durable_end: int) -> SegmentPlan:
    with as_file(data) as view:
        return plan_segment(BASE, view, evidence, next_base=next_base, durable_end=durable_end, running={})


batches = st.lists(st.tuples(st.integers(0, 1), st.integers(1, 4)), min_size=1, max_size=12)


@settings(max_examples=examples(200), deadline=None)
@given(counts=batches, data=st.data(), sealed=st.booleans())
def test_whole_bytes_are_taken_as_they_are_whatever_the_index_says(
    counts: list[tuple[int, int]], data: st.DataObject, sealed: bool
) -> None:
    raw, truth = build(counts)
    end = truth[-1].next_offset
    packed = bytearray(pack_entries(truth))
    for _ in range(data.draw(st.integers(0, 3), label="flips")):  # the index lies, the bytes do not
        at = data.draw(st.integers(0, len(packed) - 1))
        packed[at] ^= data.draw(st.integers(1, 255))
    evidence = list(iter_origin_entries(bytes(packed[: len(packed) // ORIGIN_ENTRY_BYTES * ORIGIN_ENTRY_BYTES])))
    got = plan(raw, evidence, end if sealed else None, end)
    assert got.refused is None and got.cut is None and not got.lost
    assert (
        got.entries == truth
        or [e for e, t in zip(got.entries, truth, strict=True) if e != t and e.append_time_ms == t.append_time_ms] == []
    )  # only an append time can come from the index (its second copy): every other field is the batch's


@settings(max_examples=examples(300), deadline=None)
@given(counts=batches, data=st.data(), kind=st.sampled_from(["flip", "zero", "tear"]), sealed=st.booleans())
def test_damage_is_named_with_the_coordinates_the_batches_had(
    counts: list[tuple[int, int]], data: st.DataObject, kind: str, sealed: bool
) -> None:
    raw, truth = build(counts)
    end = truth[-1].next_offset
    damaged = bytearray(raw)
    first = data.draw(st.integers(0, len(raw) - 1), label="first")
    if kind == "flip":
        last = first + 1
        damaged[first] ^= data.draw(st.integers(1, 255), label="mask")
    elif kind == "zero":
        last = min(len(raw), first + data.draw(st.integers(1, 600), label="length"))
        damaged[first:last] = bytes(last - first)
    else:
        last = len(raw)
        del damaged[first:]
    got = plan(bytes(damaged), truth, end if sealed else None, end)
    assert got.refused is None and got.cut is None
    assert got.entries == truth and got.next_offset == end
    for slot, t in zip(got.slots, truth, strict=True):
        covered = slice(t.position + CRC_START, t.end_position)
        body_hit = bytes(damaged[covered]) != raw[covered]
        if body_hit:
            assert isinstance(slot, Lost), (slot, t)
        else:
            assert isinstance(slot, Good)
            prefix_hit = damaged[t.position : t.position + CRC_START] != raw[t.position : t.position + CRC_START]
            assert (slot.prefix == raw[t.position : t.position + CRC_START]) if prefix_hit else slot.prefix is None


@settings(max_examples=examples(200), deadline=None)
@given(counts=batches, data=st.data())
def test_without_an_index_damage_below_the_durable_end_is_refused_and_above_it_cut(
    counts: list[tuple[int, int]], data: st.DataObject
) -> None:
    raw, truth = build(counts)
    end = truth[-1].next_offset
    victim = data.draw(st.sampled_from(truth), label="victim")
    damaged = bytearray(raw)
    damaged[victim.position + CRC_START + 3] ^= 0x20  # inside the covered bytes: the CRC fails
    durable = data.draw(st.integers(BASE, end), label="durable end")
    got = plan(bytes(damaged), None, None, durable)
    if victim.base_offset >= durable:
        assert got.cut is not None and got.refused is None and got.next_offset == victim.base_offset
        assert got.entries == truth[: truth.index(victim)]
    else:
        assert got.refused is not None and got.cut is None


def test_an_index_entry_that_breaks_its_origins_sequence_is_not_believed() -> None:
    """A damaged slot named by an entry whose seq does not continue its origin: refused, never quarantined under
    coordinates the batch did not have (issue 20, item 2: repair would have written another batch there)."""
    raw, truth = build([(0, 2), (0, 3), (0, 1)])
    damaged = bytearray(raw)
    damaged[truth[1].position + 60] ^= 0x01
    lying = list(truth)
    lying[1] = OriginEntry(
        **{
            **{f: getattr(truth[1], f) for f in OriginEntry.__dataclass_fields__},
            "base_origin_seq": truth[1].base_origin_seq + 2,
        }
    )
    assert plan(bytes(damaged), lying, None, truth[-1].next_offset).refused is not None
    assert plan(bytes(damaged), truth, None, truth[-1].next_offset).lost[0].entry == truth[1]
