"""Dedup at apply: each rule, then properties and a state machine against a record-by-record reference.

What a user relies on: whatever an upstream sends (duplicates from a cycle,
resends, a second upstream, reordering, drops), a site holds for every origin
a gap-free prefix, never stores a record twice, keeps each origin in seq
order, and catches up fully once the missing batches arrive in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dedup.apply import (
    Append,
    ApplyPlan,
    BatchSpan,
    BlockedByDivergence,
    BlockedByGap,
    Covered,
    Decision,
    Gap,
    Malformed,
    PartialOverlap,
    extends,
    plan_apply,
)
from georep.record.batch import RecordInput, encode_batch, parse_header
from offsets.coordinates import Origin, OriginSeq
from offsets.vector import SEQ_MAX, VectorOffset
from tests.support.examples import examples
from topology.ids import SiteId

A = Origin(SiteId("a"), 1)
B = Origin(SiteId("b"), 2)
C = Origin(SiteId("c"), 3)
ORIGINS = (A, B, C)


@dataclass(frozen=True)
class Span:
    """A test double for a batch header: only the origin seq range."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq


def span(origin: Origin, base: int, last: int) -> Span:
    return Span(origin, OriginSeq(base), OriginSeq(last))


def vec(**entries: int) -> VectorOffset:
    by_site = {o.site: o for o in ORIGINS}
    return VectorOffset({by_site[SiteId(site)]: seq for site, seq in entries.items()})


# --- the rules one by one ----------------------------------------------------------


def test_empty_response_changes_nothing() -> None:
    have = vec(a=5)
    plan = plan_apply(have, [])
    assert plan == ApplyPlan((), (), have, {}, (), ())
    assert plan.blocked_origins() == []
    assert not plan.diverged


def test_contiguous_batches_are_appended_and_advance_the_vector() -> None:
    plan = plan_apply(VectorOffset(), [span(A, 0, 2), span(A, 3, 3), span(A, 4, 9)])
    assert plan.decisions == (
        Append(A, OriginSeq(0), OriginSeq(2)),
        Append(A, OriginSeq(3), OriginSeq(3)),
        Append(A, OriginSeq(4), OriginSeq(9)),
    )
    assert plan.append_indexes == (0, 1, 2)
    assert plan.vector == vec(a=10)
    assert "appended" in plan.decisions[0].message()


def test_batch_already_held_is_covered_and_skipped() -> None:
    plan = plan_apply(vec(a=10), [span(A, 0, 4), span(A, 5, 9), span(A, 10, 11)])
    assert plan.decisions[:2] == (
        Covered(A, OriginSeq(0), OriginSeq(4), OriginSeq(10)),
        Covered(A, OriginSeq(5), OriginSeq(9), OriginSeq(10)),
    )
    assert plan.append_indexes == (2,)
    assert plan.vector == vec(a=12)
    assert "already held" in plan.decisions[0].message()


def test_duplicate_from_a_cycle_within_one_response_is_appended_once() -> None:
    # a->b->c->a: the same batch comes back around, even later in the same response.
    plan = plan_apply(VectorOffset(), [span(A, 0, 3), span(B, 0, 0), span(A, 0, 3), span(B, 0, 0)])
    assert plan.append_indexes == (0, 1)
    assert plan.decisions[2] == Covered(A, OriginSeq(0), OriginSeq(3), OriginSeq(4))
    assert isinstance(plan.decisions[3], Covered)
    assert plan.vector == vec(a=4, b=1)


def test_gap_is_never_appended_past() -> None:
    plan = plan_apply(vec(a=3), [span(A, 5, 6), span(A, 7, 8), span(A, 3, 4)])
    gap = Gap(A, OriginSeq(3), OriginSeq(5), OriginSeq(6))
    assert plan.decisions[0] == gap
    # Even the missing batch arriving later in the response stays blocked: an
    # upstream sends each origin in seq order, so the response is not trusted.
    assert plan.decisions[1:] == (
        BlockedByGap(A, OriginSeq(7), OriginSeq(8), gap),
        BlockedByGap(A, OriginSeq(3), OriginSeq(4), gap),
    )
    assert plan.append_indexes == ()
    assert plan.vector == vec(a=3)
    assert plan.gaps == {A: gap}
    assert plan.blocked_origins() == [A]
    assert "expected seq 3, got 5" in gap.message()
    assert "3..4" in gap.message()
    assert "waiting for seqs 3..4" in plan.decisions[1].message()


def test_covered_batch_after_a_gap_is_still_reported_as_covered() -> None:
    plan = plan_apply(vec(a=3), [span(A, 5, 6), span(A, 0, 2)])
    assert plan.decisions[1] == Covered(A, OriginSeq(0), OriginSeq(2), OriginSeq(3))


def test_gap_in_one_origin_does_not_block_another() -> None:
    plan = plan_apply(vec(b=1), [span(A, 0, 1), span(B, 4, 4), span(A, 2, 2), span(B, 5, 5), span(C, 0, 0)])
    assert [type(d) for d in plan.decisions] == [Append, Gap, Append, BlockedByGap, Append]
    assert plan.append_indexes == (0, 2, 4)
    assert plan.vector == vec(a=3, b=1, c=1)
    assert list(plan.gaps) == [B]


def test_only_the_first_gap_of_an_origin_is_reported() -> None:
    plan = plan_apply(VectorOffset(), [span(A, 2, 2), span(A, 9, 9)])
    assert plan.gaps == {A: Gap(A, OriginSeq(0), OriginSeq(2), OriginSeq(2))}
    assert isinstance(plan.decisions[1], BlockedByGap)


def test_partial_overlap_is_divergence_and_blocks_its_origin() -> None:
    plan = plan_apply(vec(a=3), [span(A, 2, 4), span(A, 3, 4), span(B, 0, 0), span(A, 0, 1)])
    overlap = PartialOverlap(A, OriginSeq(2), OriginSeq(4), OriginSeq(3))
    assert plan.decisions == (
        overlap,
        BlockedByDivergence(A, OriginSeq(3), OriginSeq(4), overlap),  # would extend, but not after divergence
        Append(B, OriginSeq(0), OriginSeq(0)),
        Covered(A, OriginSeq(0), OriginSeq(1), OriginSeq(3)),
    )
    assert plan.append_indexes == (2,)
    assert plan.vector == vec(a=3, b=1)
    assert plan.overlaps == (overlap,)
    assert plan.gaps == {}
    assert plan.diverged
    assert plan.blocked_origins() == [A]
    assert overlap.message().startswith("divergence:")
    assert "divergence" in plan.decisions[1].message()


def test_overlap_against_a_batch_planned_earlier_in_the_response() -> None:
    plan = plan_apply(VectorOffset(), [span(A, 0, 4), span(A, 3, 6)])
    assert plan.decisions[1] == PartialOverlap(A, OriginSeq(3), OriginSeq(6), OriginSeq(5))
    assert plan.vector == vec(a=5)


def test_malformed_headers_are_rejected_and_block_their_origin() -> None:
    plan = plan_apply(VectorOffset(), [span(A, -1, 0), span(A, 0, 0), span(B, 5, 4), span(C, SEQ_MAX - 1, SEQ_MAX)])
    assert [type(d) for d in plan.decisions] == [Malformed, BlockedByDivergence, Malformed, Malformed]
    assert plan.append_indexes == ()
    assert plan.vector == VectorOffset()
    assert len(plan.malformed) == 3
    assert plan.diverged
    assert plan.blocked_origins() == [A, B, C]
    assert "unstamped" in plan.decisions[0].message()


def test_extends() -> None:
    have = vec(a=3)
    assert extends(have, span(A, 3, 3))
    assert extends(have, span(B, 0, 7))
    assert not extends(have, span(A, 0, 2))
    assert not extends(have, span(A, 4, 5))
    assert not extends(have, span(A, 2, 5))
    assert not extends(have, span(B, 0, -1))


def test_real_batch_headers_fit() -> None:
    def header(base: int, count: int) -> BatchSpan:
        records = [RecordInput(None, b"v", (), 1000)] * count
        return parse_header(encode_batch(records, origin=A, base_origin_seq=base))

    headers = [header(0, 3), header(3, 2), header(0, 3), header(9, 1)]
    plan = plan_apply(VectorOffset(), headers)
    assert [type(d) for d in plan.decisions] == [Append, Append, Covered, Gap]
    assert plan.vector == vec(a=5)
    assert extends(plan.vector, header(5, 4))


def test_planning_is_pure() -> None:
    have = vec(a=1)
    headers = [span(A, 1, 2), span(B, 3, 3)]
    assert plan_apply(have, headers) == plan_apply(have, headers)
    assert have == vec(a=1)


# --- the reference: per origin, the set of seqs held, applied record by record ------


class Reference:
    """A site as a set of held seqs per origin, applied record by record.

    Deliberately naive: a batch is classified by looking at each of its
    records, and appended one record at a time, each only if it is max held + 1.
    """

    def __init__(self, start: dict[Origin, int]) -> None:
        self.held: dict[Origin, set[int]] = {o: set(range(n)) for o, n in start.items()}
        self.log: list[tuple[Origin, int]] = [(o, s) for o, n in start.items() for s in range(n)]

    def next_of(self, origin: Origin) -> int:
        held = self.held.get(origin, set())
        return max(held) + 1 if held else 0

    def apply(self, batches: list[Span]) -> tuple[list[str], list[int], dict[Origin, tuple[int, int]]]:
        kinds: list[str] = []
        appended: list[int] = []
        first_gap: dict[Origin, tuple[int, int]] = {}
        blocked: set[Origin] = set()
        for index, b in enumerate(batches):
            held = self.held.setdefault(b.origin, set())
            seqs = range(b.base_origin_seq, b.last_origin_seq + 1)
            if all(s in held for s in seqs):
                kinds.append("covered")
            elif b.origin in blocked:
                kinds.append("blocked")
            elif any(s in held for s in seqs):
                kinds.append("overlap")
                blocked.add(b.origin)
            elif b.base_origin_seq != self.next_of(b.origin):
                kinds.append("gap")
                first_gap[b.origin] = (self.next_of(b.origin), b.base_origin_seq)
                blocked.add(b.origin)
            else:
                for s in seqs:
                    assert s == self.next_of(b.origin)
                    held.add(s)
                    self.log.append((b.origin, s))
                kinds.append("append")
                appended.append(index)
        return kinds, appended, first_gap

    def vector(self) -> VectorOffset:
        return VectorOffset({o: self.next_of(o) for o in self.held})


KIND = {
    Append: "append",
    Covered: "covered",
    Gap: "gap",
    PartialOverlap: "overlap",
    BlockedByGap: "blocked",
    BlockedByDivergence: "blocked",
    Malformed: "malformed",
}


def kind(decision: Decision) -> str:
    return KIND[type(decision)]


class Site:
    """The system under test: a vector driven only by plan_apply, plus the log it appends."""

    def __init__(self, start: dict[Origin, int]) -> None:
        self.vector = VectorOffset(start)
        self.log: list[tuple[Origin, int]] = [(o, s) for o, n in start.items() for s in range(n)]

    def apply(self, batches: list[Span]) -> ApplyPlan:
        plan = plan_apply(self.vector, batches)
        for i in plan.append_indexes:
            b = batches[i]
            self.log.extend((b.origin, s) for s in range(b.base_origin_seq, b.last_origin_seq + 1))
        self.vector = plan.vector
        return plan


def check_invariants(site: Site) -> None:
    held: dict[Origin, list[int]] = {}
    for origin, seq in site.log:
        held.setdefault(origin, []).append(seq)
    for origin in ORIGINS:
        seqs = held.get(origin, [])
        assert len(seqs) == len(set(seqs)), f"I2: {origin} stored a seq twice: {seqs}"
        assert seqs == sorted(seqs), f"I3: {origin} out of order: {seqs}"
        assert set(seqs) == set(range(site.vector.get(origin))), f"I1: {origin} holds {seqs}, vector {site.vector}"


def check_against_reference(site: Site, ref: Reference, batches: list[Span]) -> ApplyPlan:
    expected_kinds, expected_appends, expected_gaps = ref.apply(batches)
    plan = site.apply(batches)
    assert [kind(d) for d in plan.decisions] == expected_kinds
    assert list(plan.append_indexes) == expected_appends
    assert {o: (g.expected, g.got) for o, g in plan.gaps.items()} == expected_gaps
    assert site.vector == ref.vector()
    assert site.log == ref.log
    check_invariants(site)
    return plan


# --- generated histories -------------------------------------------------------------


def chunk(sizes: list[int], origin: Origin) -> list[Span]:
    out: list[Span] = []
    base = 0
    for size in sizes:
        out.append(span(origin, base, base + size - 1))
        base += size
    return out


@st.composite
def true_logs(draw: st.DrawFn) -> dict[Origin, list[Span]]:
    """Per origin, its batches as the origin cut them: contiguous from seq 0."""
    origins = draw(st.lists(st.sampled_from(ORIGINS), min_size=1, max_size=3, unique=True))
    return {o: chunk(draw(st.lists(st.integers(1, 4), max_size=6)), o) for o in sorted(origins)}


@st.composite
def starts(draw: st.DrawFn, logs: dict[Origin, list[Span]]) -> dict[Origin, int]:
    """What the site already holds: for each origin, a prefix ending on a batch boundary."""
    start: dict[Origin, int] = {}
    for origin, batches in logs.items():
        held = draw(st.integers(0, len(batches)))
        start[origin] = batches[held - 1].last_origin_seq + 1 if held else 0
    return start


def in_order_interleavings(logs: dict[Origin, list[Span]], picks: list[int]) -> list[Span]:
    """Every batch once, each origin in seq order, origins interleaved as ``picks`` say."""
    queues = {o: list(batches) for o, batches in logs.items()}
    out: list[Span] = []
    for pick in picks:
        live = [o for o in sorted(queues) if queues[o]]
        if not live:
            break
        out.append(queues[live[pick % len(live)]].pop(0))
    for origin in sorted(queues):
        out.extend(queues[origin])
    return out


def split(batches: list[Span], cuts: list[int]) -> list[list[Span]]:
    points = sorted({c % (len(batches) + 1) for c in cuts})
    parts: list[list[Span]] = []
    prev = 0
    for p in [*points, len(batches)]:
        parts.append(batches[prev:p])
        prev = p
    return parts


PROPERTY = settings(max_examples=examples(300), deadline=None)


@PROPERTY
@given(data=st.data())
def test_faulty_delivery_matches_reference_and_converges(data: st.DataObject) -> None:
    logs = data.draw(true_logs(), label="logs")
    start = data.draw(starts(logs), label="start")
    all_batches = [b for batches in logs.values() for b in batches]
    # Faults: any batches, duplicated, reordered, with drops, over several responses.
    faulty = (
        data.draw(st.lists(st.lists(st.sampled_from(all_batches), max_size=8), max_size=5), label="faulty")
        if all_batches
        else []
    )
    site, ref = Site(start), Reference(start)
    for response in faulty:
        plan = check_against_reference(site, ref, response)
        assert not plan.diverged, "verbatim origin batches can never overlap partially"
    # Heal: every batch once, in order per origin, split into successive responses.
    healed = in_order_interleavings(logs, data.draw(st.lists(st.integers(0, 2)), label="interleave"))
    for response in split(healed, data.draw(st.lists(st.integers(0, 50), max_size=4), label="cuts")):
        plan = check_against_reference(site, ref, response)
        assert not plan.diverged
        assert not plan.gaps, "in-order delivery after any faults never meets a gap"
    for origin, batches in logs.items():
        end = batches[-1].last_origin_seq + 1 if batches else 0
        assert site.vector.get(origin) == end, f"{origin} did not converge"


@PROPERTY
@given(data=st.data())
def test_divergent_boundaries_never_break_the_invariants(data: st.DataObject) -> None:
    # An upstream that re-batched an origin's seqs (a bug): its batches straddle ours.
    logs = data.draw(true_logs(), label="logs")
    alternates = [
        b for o in logs for b in chunk(data.draw(st.lists(st.integers(1, 5), max_size=5), label=f"alt {o}"), o)
    ]
    pool = [b for batches in logs.values() for b in batches] + alternates
    if not pool:
        return
    start = data.draw(starts(logs), label="start")
    site, ref = Site(start), Reference(start)
    for response in data.draw(st.lists(st.lists(st.sampled_from(pool), max_size=8), max_size=5), label="responses"):
        plan = check_against_reference(site, ref, response)
        assert len(plan.overlaps) == sum(k == "overlap" for k in map(kind, plan.decisions))


@PROPERTY
@given(logs=true_logs(), data=st.data())
def test_plan_agrees_with_extends_and_never_moves_backwards(
    logs: dict[Origin, list[Span]], data: st.DataObject
) -> None:
    pool = [b for batches in logs.values() for b in batches]
    have = VectorOffset(data.draw(starts(logs)))
    response = data.draw(st.lists(st.sampled_from(pool), max_size=10)) if pool else []
    plan = plan_apply(have, response)
    assert have <= plan.vector
    if response:
        assert isinstance(plan.decisions[0], Append) == extends(have, response[0])
    assert len(plan.decisions) == len(response)
    assert all(isinstance(plan.decisions[i], Append) for i in plan.append_indexes)


# --- stateful: origins keep writing while responses arrive --------------------------------


class ApplyMachine(RuleBasedStateMachine):
    """Origins append batches; upstreams deliver any mix; the site must track the reference."""

    logs: dict[Origin, list[Span]]
    site: Site
    ref: Reference

    @initialize()
    def start(self) -> None:
        self.logs = {o: [] for o in ORIGINS}
        self.site = Site({})
        self.ref = Reference({})

    @rule(origin=st.sampled_from(ORIGINS), size=st.integers(1, 4))
    def origin_writes(self, origin: Origin, size: int) -> None:
        batches = self.logs[origin]
        base = batches[-1].last_origin_seq + 1 if batches else 0
        batches.append(span(origin, base, base + size - 1))

    @rule(data=st.data())
    def faulty_response(self, data: st.DataObject) -> None:
        pool = [b for o in ORIGINS for b in self.logs[o]]
        response = data.draw(st.lists(st.sampled_from(pool), max_size=6)) if pool else []
        assert not check_against_reference(self.site, self.ref, response).diverged

    @rule(origin=st.sampled_from(ORIGINS), budget=st.integers(1, 4))
    def upstream_serves_have_vector(self, origin: Origin, budget: int) -> None:
        # A correct upstream: it sends only batches that extend the vector the site told it.
        nxt = self.site.vector.get(origin)
        response = [b for b in self.logs[origin] if b.base_origin_seq >= nxt][:budget]
        plan = check_against_reference(self.site, self.ref, response)
        assert plan.append_indexes == tuple(range(len(response)))

    @invariant()
    def holds_a_prefix_of_each_origin(self) -> None:
        if hasattr(self, "site"):
            check_invariants(self.site)
            for origin in ORIGINS:
                end = self.logs[origin][-1].last_origin_seq + 1 if self.logs[origin] else 0
                assert self.site.vector.get(origin) <= end

    def teardown(self) -> None:
        if hasattr(self, "site"):
            # Liveness: heal, then every origin's whole log in order converges the site.
            healed = in_order_interleavings(self.logs, [])
            check_against_reference(self.site, self.ref, healed)
            for origin in ORIGINS:
                end = self.logs[origin][-1].last_origin_seq + 1 if self.logs[origin] else 0
                assert self.site.vector.get(origin) == end


ApplyMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=30, deadline=None)
TestApplyMachine = ApplyMachine.TestCase
