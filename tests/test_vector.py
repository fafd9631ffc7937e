"""Vector offsets: lattice laws, coverage, the text form and the protobuf form."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from georep.proto import georep_pb2
from georep.proto.convert import vector_from_proto, vector_to_proto
from offsets.coordinates import EPOCH_MAX, Origin
from offsets.vector import SEQ_MAX, Coverage, InvalidVectorOffset, VectorOffset
from tests.support.examples import examples
from topology.ids import SiteId

PROPERTY = settings(max_examples=examples(200), deadline=None)

# A few origins, so that generated vectors share keys and the laws get exercised.
origins = st.builds(
    Origin, site=st.sampled_from([SiteId(s) for s in ("a", "b", "us-east", "c9")]), epoch=st.integers(0, 3)
)
seqs = st.integers(0, 50) | st.integers(0, SEQ_MAX)
vectors = st.dictionaries(origins, seqs, max_size=5).map(VectorOffset)

A1 = Origin(SiteId("a"), 1)
B3 = Origin(SiteId("b"), 3)


@PROPERTY
@given(vectors, vectors)
def test_merge_is_commutative(x: VectorOffset, y: VectorOffset) -> None:
    assert x.merge(y) == y.merge(x)


@PROPERTY
@given(vectors, vectors, vectors)
def test_merge_is_associative(x: VectorOffset, y: VectorOffset, z: VectorOffset) -> None:
    assert x.merge(y).merge(z) == x.merge(y.merge(z))


@PROPERTY
@given(vectors)
def test_merge_is_idempotent(x: VectorOffset) -> None:
    assert x.merge(x) == x
    assert x.merge(VectorOffset()) == x


@PROPERTY
@given(vectors, vectors)
def test_merge_is_the_least_upper_bound(x: VectorOffset, y: VectorOffset) -> None:
    m = x.merge(y)
    assert x <= m and y <= m
    for origin in set(x.origins()) | set(y.origins()):
        assert m.get(origin) == max(x.get(origin), y.get(origin))
    assert (x <= y) == (x.merge(y) == y)


@PROPERTY
@given(vectors, vectors)
def test_dominated_by_is_pointwise(x: VectorOffset, y: VectorOffset) -> None:
    keys = sorted(set(x.origins()) | set(y.origins()))
    assert x.dominated_by(y) == all(x.get(o) <= y.get(o) for o in keys)
    assert (x <= y and y <= x) == (x == y)
    assert (x >= y) == y.dominated_by(x)


@PROPERTY
@given(vectors, origins, seqs)
def test_advanced_never_moves_backwards(x: VectorOffset, origin: Origin, seq: int) -> None:
    y = x.advanced(origin, seq)
    assert x <= y
    assert y.get(origin) == max(x.get(origin), seq)
    for other in x.origins():
        if other != origin:
            assert y.get(other) == x.get(other)
    assert y == x.merge(VectorOffset({origin: seq}))


@PROPERTY
@given(vectors, origins, st.integers(0, 200))
def test_covers_agrees_with_get(x: VectorOffset, origin: Origin, seq: int) -> None:
    assert x.covers(origin, seq) == (seq < x.get(origin))


@PROPERTY
@given(vectors, origins, st.integers(0, 60), st.integers(0, 10))
def test_covers_batch_agrees_with_covers(x: VectorOffset, origin: Origin, base: int, extra: int) -> None:
    last = base + extra
    covered = [x.covers(origin, s) for s in range(base, last + 1)]
    expected = Coverage.ALL if all(covered) else Coverage.NONE if not any(covered) else Coverage.PARTIAL
    assert x.covers_batch(origin, base, last) is expected


def test_covers_batch_cases() -> None:
    v = VectorOffset({A1: 10})
    assert v.covers_batch(A1, 0, 9) == "all"
    assert v.covers_batch(A1, 5, 14) == "partial"
    assert v.covers_batch(A1, 10, 12) == "none"
    assert v.covers_batch(B3, 0, 0) is Coverage.NONE
    with pytest.raises(ValueError):
        v.covers_batch(A1, 5, 4)


@PROPERTY
@given(vectors, vectors)
def test_equality_and_hash_follow_meaning(x: VectorOffset, y: VectorOffset) -> None:
    if x == y:
        assert hash(x) == hash(y)
    assert VectorOffset(x.items()) == x
    assert hash(VectorOffset(dict(reversed(x.items())))) == hash(x)


def test_absent_is_zero() -> None:
    assert VectorOffset({A1: 0}) == VectorOffset()
    assert hash(VectorOffset({A1: 0})) == hash(VectorOffset())
    assert VectorOffset().get(A1) == 0
    assert not VectorOffset({A1: 0})
    assert len(VectorOffset({A1: 0, B3: 2})) == 1


@PROPERTY
@given(vectors)
def test_items_are_sorted(x: VectorOffset) -> None:
    keys = [o for o, _ in x.items()]
    assert keys == sorted(keys) == x.origins()
    assert all(seq > 0 for _, seq in x.items())


@PROPERTY
@given(vectors)
def test_text_round_trip(x: VectorOffset) -> None:
    assert VectorOffset.parse(x.to_text()) == x
    assert VectorOffset.parse(x.to_text()).to_text() == x.to_text()
    assert eval(repr(x), {"VectorOffset": VectorOffset}) == x  # repr is the parse call


def test_text_form() -> None:
    v = VectorOffset.parse("b@3:0, a@1:10")
    assert v == VectorOffset({A1: 10})
    assert v.to_text() == "a@1:10"
    assert VectorOffset({B3: 7, A1: 10}).to_text() == "a@1:10,b@3:7"
    assert VectorOffset.parse("") == VectorOffset() == VectorOffset.parse("  ")
    assert VectorOffset().to_text() == ""


@pytest.mark.parametrize(
    "text",
    [
        "a@1",  # no seq
        "a:10",  # no epoch
        "a@1:10,",  # trailing comma
        "a@1:-1",
        "A@1:1",  # site ids are lowercase
        "a@1:1;b@2:2",
        "a@1:1,a@1:2",  # the same origin twice
        f"a@{EPOCH_MAX + 1}:1",
        f"a@1:{SEQ_MAX + 1}",
        "a@\u0661:1",  # a non-ASCII digit
        "a@1:1 2",
    ],
)
def test_bad_text_says_the_format(text: str) -> None:
    with pytest.raises(InvalidVectorOffset, match=r"site@epoch:next_seq|exceeds|twice") as info:
        VectorOffset.parse(text)
    assert isinstance(info.value, ValueError)
    assert repr(text) in str(info.value)


@PROPERTY
@given(st.text(max_size=30))
def test_parse_raises_only_invalid_vector_offset(text: str) -> None:
    try:
        v = VectorOffset.parse(text)
    except InvalidVectorOffset:
        return
    assert VectorOffset.parse(v.to_text()) == v


def test_bad_values_are_refused() -> None:
    with pytest.raises(InvalidVectorOffset):
        VectorOffset({A1: -1})
    with pytest.raises(InvalidVectorOffset):
        VectorOffset([(A1, 1), (A1, 2)])
    with pytest.raises(InvalidVectorOffset):
        VectorOffset().advanced(A1, -5)
    with pytest.raises(TypeError):
        VectorOffset({("a", 1): 1})  # type: ignore[dict-item]


def test_update_returns_new_vectors() -> None:
    v = VectorOffset({A1: 5})
    assert v.advanced(A1, 3) is v  # nothing to do
    w = v.advanced(A1, 6)
    assert (v.get(A1), w.get(A1)) == (5, 6)
    d = w.to_dict()
    d[A1] = 0
    assert w.get(A1) == 6


@PROPERTY
@given(vectors)
def test_proto_round_trip(x: VectorOffset) -> None:
    message = vector_to_proto(x)
    assert [(e.site, e.epoch) for e in message.entries] == [(o.site, o.epoch) for o in x.origins()]
    wire = georep_pb2.VectorOffset.FromString(message.SerializeToString())
    assert vector_from_proto(wire) == x


def test_proto_refuses_bad_entries() -> None:
    bad_site = georep_pb2.VectorOffset(entries=[georep_pb2.OriginSeq(site="Bad Site", epoch=1, next_seq=1)])
    with pytest.raises(InvalidVectorOffset, match="site id"):
        vector_from_proto(bad_site)
    negative = georep_pb2.VectorOffset(entries=[georep_pb2.OriginSeq(site="a", epoch=1, next_seq=-1)])
    with pytest.raises(InvalidVectorOffset):
        vector_from_proto(negative)
    twice = georep_pb2.VectorOffset(
        entries=[
            georep_pb2.OriginSeq(site="a", epoch=1, next_seq=1),
            georep_pb2.OriginSeq(site="a", epoch=1, next_seq=2),
        ]
    )
    with pytest.raises(InvalidVectorOffset, match="twice"):
        vector_from_proto(twice)
