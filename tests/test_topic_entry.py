"""A topic's replicated definition (``georep/metadata/topic_entry.py``): the merge is a join-semilattice, so sites
converge whatever order they hear of creates, alters, growths and deletes in; tombstones and incarnations decide
deletes and re-creation; concurrent changes of a key are found."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from georep.metadata.topic_entry import (
    Merged,
    TopicDeleted,
    TopicEntry,
    TopicExists,
    add_partitions,
    alter,
    create,
    delete,
    merge,
)
from georep.metadata.topics import InvalidTopic
from tests.support.examples import examples

NAME = "orders"
SITES = ("a", "b", "c")
KEYS = ("retention_ms", "segment_bytes_max")


@dataclass
class World:
    """Each site's entry for NAME, its clock, and every entry any site ever held (what a link may deliver late)."""

    held: dict[str, TopicEntry | None] = field(default_factory=lambda: dict.fromkeys(SITES))
    clock: int = 1_000
    sent: list[TopicEntry] = field(default_factory=list)

    def change(self, site: str, op: str, key: str, value: int) -> None:
        self.clock += 1
        held = self.held[site]
        try:
            if op == "create":
                entry = create(NAME, 1 + value % 4, {key: value}, held, self.clock, site)
            elif op == "alter":
                entry = alter(held, NAME, {key: None if value % 5 == 0 else value}, self.clock, site)
            elif op == "grow":
                entry = add_partitions(held, NAME, (held.partitions if held else 0) + 1 + value % 3)
            else:
                entry = delete(held, NAME, self.clock, site)
        except InvalidTopic:
            return  # refused at this site (exists, deleted, unknown): nothing changes
        self.held[site] = entry
        self.sent.append(entry)

    def deliver(self, site: str, entry: TopicEntry) -> Merged:
        merged = merge(self.held[site], entry)
        self.held[site] = merged.entry
        return merged


OPS = st.tuples(
    st.sampled_from(SITES),
    st.sampled_from(("create", "create", "alter", "alter", "grow", "delete", "deliver")),
    st.sampled_from(KEYS),
    st.integers(0, 20),
    st.integers(0, 1_000),
)


def play(ops: list[tuple[str, str, str, int, int]]) -> World:
    world = World()
    for site, op, key, value, pick in ops:
        if op == "deliver":
            if world.sent:
                world.deliver(site, world.sent[pick % len(world.sent)])
        else:
            world.change(site, op, key, value)
    return world


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(OPS, max_size=40), st.randoms(use_true_random=False))
def test_every_site_converges_whatever_order_it_hears_the_changes_in(
    ops: list[tuple[str, str, str, int, int]], rnd: object
) -> None:
    world = play(ops)
    if not world.sent:
        return
    finals = []
    for _ in range(3):  # each site then hears every entry ever sent, in its own shuffled order, some twice
        order = list(world.sent) + list(world.held.values())
        rnd.shuffle(order)  # type: ignore[attr-defined]
        entry: TopicEntry | None = None
        for e in [*order, *order[: len(order) // 2]]:
            if e is not None:
                entry = merge(entry, e).entry
        finals.append(entry)
    assert finals[0] == finals[1] == finals[2]


entries = st.lists(OPS, max_size=25).map(lambda ops: play(ops).sent).filter(bool)


@settings(max_examples=examples(200), deadline=None)
@given(entries, st.data())
def test_the_merge_is_commutative_associative_and_idempotent(sent: list[TopicEntry], data: st.DataObject) -> None:
    a, b, c = (data.draw(st.sampled_from(sent)) for _ in range(3))

    def m(x: TopicEntry, y: TopicEntry) -> TopicEntry:
        return merge(x, y).entry

    assert m(a, b) == m(b, a)
    assert m(m(a, b), c) == m(a, m(b, c))
    assert merge(a, a) == Merged(a, False, ())  # a topic sync skips an entry equal to the one held
    assert not merge(m(a, b), a).changed


def test_a_tombstone_beats_its_incarnation_and_a_recreate_is_the_next_one() -> None:
    live = create(NAME, 4, {"retention_ms": 1000}, None, 1_000, "a")
    grown = add_partitions(live, NAME, 8)  # at b, before it hears of the delete
    gone = delete(live, NAME, 1_001, "a")
    assert merge(grown, gone).entry == gone and merge(gone, grown).entry == gone
    again = create(NAME, 2, {}, gone, 900, "a")  # a clock behind: the stamp still goes above the tombstone's
    assert (again.incarnation, again.partitions, again.config()) == (1, 2, {})
    assert again.stamp > gone.stamp
    # c never heard of the delete: the re-created topic ends incarnation 0 there (its records with it).
    assert merge(grown, again).entry == again
    with pytest.raises(TopicExists, match="already exists"):
        create(NAME, 1, {}, again, 2_000, "c")
    with pytest.raises(TopicDeleted, match="create it first"):
        alter(gone, NAME, {"retention_ms": 5}, 2_000, "b")


def test_concurrent_creates_after_the_same_history_are_one_topic_with_the_larger_count() -> None:
    at_a = create(NAME, 4, {}, None, 1_000, "a")
    at_b = create(NAME, 6, {}, None, 1_000, "b")
    merged = merge(at_a, at_b)
    assert (merged.entry.incarnation, merged.entry.partitions) == (0, 6)
    with pytest.raises(InvalidTopic, match="only grows"):
        add_partitions(merged.entry, NAME, 6)


def test_concurrent_changes_of_one_key_are_found_and_the_later_stamp_is_kept_everywhere() -> None:
    base = create(NAME, 1, {}, None, 1_000, "a")
    at_a = alter(base, NAME, {"retention_ms": 111}, 2_000, "a")
    at_b = alter(base, NAME, {"retention_ms": 222}, 2_500, "b")
    found = merge(at_a, at_b)
    assert found.entry.config() == {"retention_ms": 222} == merge(at_b, at_a).entry.config()
    [conflict] = found.conflicts
    assert (conflict.kept.value, conflict.lost.value) == (222, 111)
    assert "at two sites at once" in conflict.describe() and "site b" in conflict.describe()
    assert not merge(found.entry, at_a).conflicts  # joined: the same conflict is not found again
    # b changed the key after hearing a's change: not concurrent, whatever the clocks say.
    later = alter(merge(at_b, at_a).entry, NAME, {"retention_ms": 333}, 1_500, "c")
    assert not merge(found.entry, later).conflicts
    assert merge(found.entry, later).entry.config() == {"retention_ms": 333}
    # Different keys never conflict; a reset to the default is a change too.
    other = alter(base, NAME, {"segment_bytes_max": 4096, "retention_ms": None}, 3_000, "c")
    assert merge(at_a, other).entry.config() == {"segment_bytes_max": 4096}


def test_every_arrival_order_of_one_history_gives_one_entry() -> None:
    live = create(NAME, 3, {"retention_ms": 10}, None, 1_000, "a")
    history = [
        live,
        alter(live, NAME, {"retention_ms": 20}, 1_100, "b"),
        add_partitions(live, NAME, 5),
        delete(live, NAME, 1_200, "c"),
        create(NAME, 7, {}, delete(live, NAME, 1_200, "c"), 1_300, "a"),
    ]
    finals = set()
    for order in itertools.permutations(history):
        entry: TopicEntry | None = None
        for e in order:
            entry = merge(entry, e).entry
        finals.add(entry)
    assert len(finals) == 1
    [final] = finals
    assert final is not None and (final.incarnation, final.deleted, final.partitions) == (1, False, 7)
