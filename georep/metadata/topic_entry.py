"""A topic's definition as it replicates: created, altered, grown and deleted at any site, merged in any order. Pure.

docs/design.md, "Topic changes across sites (issue 23)", is the design; this module is its decision core. A site
holds one :class:`TopicEntry` per topic name, and :func:`merge` folds in the entry another site sends.

**Identity.** A topic is its name and its *incarnation*: the number of deletes of the name it has outlived. A
create at a site holding the tombstone of incarnation ``k`` makes ``k + 1``; with no tombstone, ``0``. Two sites
that create a name after the same history make the same incarnation, so a race of two creates (issue 25 creates
topics on first use) is one topic, not two of which one must lose its acknowledged records.

**The order.** An entry ranks by ``(incarnation, deleted)``: live ``k`` < tombstone of ``k`` < live ``k + 1``. A
tombstone of ``k`` stands for "every incarnation up to ``k`` is deleted"; a live ``k + 1`` implies it.

**Why every site converges.** :func:`merge` is

* the higher-ranked entry, whole, when the ranks differ;
* for two tombstones of one incarnation, the one with the higher stamp;
* for two live entries of one incarnation: the partition count by max (it only grows), the creation stamp by
  max, and each config key by its :class:`Setting` register: the value with the higher ``(stamp, value)``,
  and the pointwise max of the two version vectors (``seen``).

Max over a total order and pointwise max over vectors are each commutative, associative and idempotent; a
product of such operations is too, and so is the lexicographic product of a total order (the rank) with one
(the live fields), where the higher rank wins whole and equal ranks merge field by field. So the merge is a
join-semilattice: sites that have received the same entries, in any order, any number of times, over any graph
of links, cycles included, hold the same entry (``tests/test_topic_entry.py`` checks it over random histories and
every arrival order).

**Conflicts are found, not prevented.** A change of a key at a site counts one more change by that site in the
key's version vector. Two registers whose vectors are incomparable were written without either seeing the
other: concurrent. The higher stamp wins everywhere (last writer wins, as the issue asks), and a merge that
joins two concurrent registers holding different values returns a :class:`ConfigConflict` for the caller to
show (``georep status``, a metric). Once joined, the vector dominates both, so the same conflict is not found
twice at one site.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from georep.metadata.topics import InvalidTopic, validate_partitions, validate_topic_name


@dataclass(frozen=True, slots=True, order=True)
class Stamp:
    """When and where a change was made: the site's clock, kept above what the site held (:func:`stamp_above`)."""

    ms: int
    site: str


def stamp_above(held: Stamp | None, now_ms: int, site: str) -> Stamp:
    """A change's stamp: ``now_ms``, or just above ``held`` if the clock is not, so a change always wins over
    the state it changed, whatever the other site's clock said."""
    return Stamp(now_ms if held is None else max(now_ms, held.ms + 1), site)


Vector = tuple[tuple[str, int], ...]  # site -> changes of one key made there, sorted by site


def _join(a: Vector, b: Vector) -> Vector:
    merged = dict(a)
    for site, n in b:
        merged[site] = max(merged.get(site, 0), n)
    return tuple(sorted(merged.items()))


def _dominates(a: Vector, b: Vector) -> bool:
    """Whether ``a`` has seen every change ``b`` has."""
    have = dict(a)
    return all(have.get(site, 0) >= n for site, n in b)


@dataclass(frozen=True, slots=True)
class Setting:
    """One config key's register: its value (``None``: reset to the node's default), the change's stamp, and the
    changes of the key it has seen, per site."""

    value: int | None
    stamp: Stamp
    seen: Vector

    def order(self) -> tuple[Stamp, bool, int]:
        return (self.stamp, self.value is not None, self.value or 0)


@dataclass(frozen=True, slots=True)
class ConfigConflict:
    """Two concurrent changes of one key with different values: which was kept everywhere, and which lost."""

    topic: str
    key: str
    kept: Setting
    lost: Setting

    def describe(self) -> str:
        def say(s: Setting) -> str:
            return f"{'default' if s.value is None else s.value} (set at site {s.stamp.site}, {s.stamp.ms} ms)"

        return (
            f"topic {self.topic!r}: {self.key} was changed at two sites at once; {say(self.kept)} is kept "
            f"everywhere over {say(self.lost)}. Change a topic's config at one site at a time, or set it again"
        )


@dataclass(frozen=True, slots=True)
class TopicEntry:
    """A site's state of one topic name: live (``partitions`` and ``settings``) or a tombstone of
    ``incarnation``; ``stamp`` is the create's, or the delete's for a tombstone."""

    name: str
    incarnation: int
    deleted: bool
    partitions: int  # 0 on a tombstone
    settings: tuple[tuple[str, Setting], ...]  # by key; none on a tombstone
    stamp: Stamp

    def rank(self) -> tuple[int, bool]:
        return (self.incarnation, self.deleted)

    def config(self) -> dict[str, int]:
        """The overrides in force: every key set, and not reset to the default."""
        return {k: s.value for k, s in self.settings if s.value is not None}

    def setting(self, key: str) -> Setting | None:
        return dict(self.settings).get(key)


@dataclass(frozen=True, slots=True)
class Merged:
    entry: TopicEntry
    changed: bool  # the entry differs from the one held
    conflicts: tuple[ConfigConflict, ...]


class TopicExists(InvalidTopic):
    """A create of a name that is live at this site."""


class TopicDeleted(InvalidTopic):
    """A change of a topic this site holds as deleted (or never held)."""


def create(
    name: str, partitions: int, config: Mapping[str, int], held: TopicEntry | None, now_ms: int, site: str
) -> TopicEntry:
    """A create at ``site``: incarnation 0, or one above the tombstone held."""
    validate_topic_name(name)
    validate_partitions(partitions)
    if held is not None and not held.deleted:
        raise TopicExists(f"topic {name!r} already exists with {held.partitions} partitions: use another name")
    incarnation = 0 if held is None else held.incarnation + 1
    stamp = stamp_above(None if held is None else held.stamp, now_ms, site)
    settings = tuple(sorted((k, Setting(v, stamp, ((site, 1),))) for k, v in config.items()))
    return TopicEntry(name, incarnation, False, partitions, settings, stamp)


def _live(held: TopicEntry | None, name: str) -> TopicEntry:
    if held is None or held.deleted:
        raise TopicDeleted(f"unknown topic {name!r}: it does not exist at this site, or was deleted; create it first")
    return held


def alter(held: TopicEntry | None, name: str, changes: Mapping[str, int | None], now_ms: int, site: str) -> TopicEntry:
    """An alter at ``site``: each key of ``changes`` set (``None``: back to the default), stamped above what it
    replaces, its vector counting one more change by ``site``."""
    entry = _live(held, name)
    settings = dict(entry.settings)
    for key, value in changes.items():
        old = settings.get(key)
        seen = dict(old.seen) if old is not None else {}
        seen[site] = seen.get(site, 0) + 1
        settings[key] = Setting(
            value, stamp_above(None if old is None else old.stamp, now_ms, site), tuple(sorted(seen.items()))
        )
    return replace(entry, settings=tuple(sorted(settings.items())))


def add_partitions(held: TopicEntry | None, name: str, total: int) -> TopicEntry:
    """Grow to ``total`` partitions; the count only grows (Kafka's CreatePartitions too)."""
    entry = _live(held, name)
    validate_partitions(total)
    if total <= entry.partitions:
        raise InvalidTopic(
            f"topic {name!r} has {entry.partitions} partitions; the count only grows: ask for more than "
            f"{entry.partitions}"
        )
    return replace(entry, partitions=total)


def delete(held: TopicEntry | None, name: str, now_ms: int, site: str) -> TopicEntry:
    """The tombstone of the live incarnation held."""
    entry = _live(held, name)
    return TopicEntry(name, entry.incarnation, True, 0, (), stamp_above(entry.stamp, now_ms, site))


def incarnation_deleted(held: TopicEntry | None, incarnation: int) -> bool:
    """Whether ``held`` (a site's entry of a name) says the name's ``incarnation`` was deleted: at or below its
    tombstone, or below its live incarnation (a live k + 1 implies the tombstone of k). A name never heard of
    deletes nothing: files of a topic the entries do not know yet are never removed."""
    if held is None:
        return False
    return incarnation < held.incarnation or (held.deleted and incarnation == held.incarnation)


def merge(held: TopicEntry | None, received: TopicEntry) -> Merged:
    """``held`` joined with ``received`` (see the module docstring), and the concurrent changes found."""
    if held is None:
        return Merged(received, True, ())
    if held.name != received.name:
        raise ValueError(f"merge of two names: {held.name!r} and {received.name!r}")
    if held.rank() != received.rank():
        entry = max(held, received, key=TopicEntry.rank)
        return Merged(entry, entry is not held, ())
    if held.deleted:
        entry = max(held, received, key=lambda e: e.stamp)
        return Merged(entry, entry != held, ())
    settings, conflicts = _merge_settings(held.name, dict(held.settings), dict(received.settings))
    entry = replace(
        held,
        partitions=max(held.partitions, received.partitions),
        settings=settings,
        stamp=max(held.stamp, received.stamp),
    )
    return Merged(entry, entry != held, conflicts)


def _merge_settings(
    topic: str, held: dict[str, Setting], received: dict[str, Setting]
) -> tuple[tuple[tuple[str, Setting], ...], tuple[ConfigConflict, ...]]:
    out = dict(held)
    conflicts: list[ConfigConflict] = []
    for key, theirs in received.items():
        mine = held.get(key)
        if mine is None:
            out[key] = theirs
            continue
        kept, lost = (mine, theirs) if mine.order() >= theirs.order() else (theirs, mine)
        concurrent = not _dominates(mine.seen, theirs.seen) and not _dominates(theirs.seen, mine.seen)
        if concurrent and kept.value != lost.value:
            conflicts.append(ConfigConflict(topic, key, kept, lost))
        out[key] = Setting(kept.value, kept.stamp, _join(mine.seen, theirs.seen))
    return tuple(sorted(out.items())), tuple(conflicts)
