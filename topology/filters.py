"""Topic filters on replication links. Pure.

A topic name is a sequence of levels separated by ``/``; each level is
``[A-Za-z0-9._-]+`` (``georep/metadata/topics.py``). A filter has the same shape, and
a filter level is one of:

- a literal, which matches the same level exactly (case-sensitive);
- ``+``, which matches exactly one level, whatever it is;
- ``**``, which matches any number of levels, **zero included**, and may stand
  anywhere in the filter.

Because ``**`` may match zero levels, ``orders/**`` matches ``orders`` itself as
well as ``orders/eu`` and ``orders/eu/paris`` (like MQTT's ``orders/#``), and
``a/**/z`` matches ``a/z`` as well as ``a/x/y/z``. ``**`` on its own matches
every topic. ``+`` never matches zero levels: ``orders/+`` does not match
``orders``.

``*`` and ``#`` are not wildcards here (they cannot appear in topic names), so
a filter containing them is rejected with a hint, rather than silently
matching nothing. So are empty levels (``a//b``, a leading or trailing ``/``),
and a wildcard that is only part of a level (``orders+``, ``a**``).

A link carries a topic if *any* of its filters matches it (:func:`matches_any`).

Internal topics (names starting with ``__georep``, such as the committed
consumer positions of ``__georep_offsets``) travel over every link, whatever
its filters (:func:`is_internal`, ``Link.carries``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

FILTER_MAX_CHARS = 249  # the same limit as topic names
INTERNAL_TOPIC_PREFIX = "__georep"
ONE_LEVEL = "+"
ANY_LEVELS = "**"
_LITERAL = re.compile(r"[A-Za-z0-9._-]+")


def is_internal(topic: str) -> bool:
    """Whether ``topic`` is georep's own (reserved for georep, carried by every link)."""
    return topic.startswith(INTERNAL_TOPIC_PREFIX)


class InvalidTopicFilter(ValueError):
    """A topic filter that cannot be parsed."""


def _level_problem(level: str) -> str | None:
    """Why ``level`` is not a valid filter level, or None when it is."""
    if level in (ONE_LEVEL, ANY_LEVELS):
        return None
    if level == "":
        return "has an empty level (check for '//' or a leading or trailing '/')"
    if level in (".", ".."):
        return f"has the level {level!r}, which no topic name can have"
    if level in ("*", "#"):
        return f"uses {level!r}, which is not a wildcard here: use '+' for exactly one level or '**' for any number"
    if "*" in level or "+" in level or "#" in level:
        return (
            f"has the level {level!r}: a wildcard must be a whole level "
            "('+' for exactly one level, '**' for any number), for example 'orders/+/paris' or 'orders/**'"
        )
    if not _LITERAL.fullmatch(level):
        return f"has the level {level!r}: a literal level may hold only letters, digits, '.', '_' or '-'"
    return None


@dataclass(frozen=True, slots=True)
class TopicFilter:
    """One validated filter, for example ``orders/+/paris`` or ``metrics/**``."""

    text: str
    levels: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # What every matching name starts with: the literal levels before the first wildcard, joined (:func:`prefix_of`).
    prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidTopicFilter(f"topic filter must be a string, got {self.text!r}")
        if self.text == "":
            raise InvalidTopicFilter("topic filter is empty: use '**' for every topic, or a name such as 'orders/**'")
        if len(self.text) > FILTER_MAX_CHARS:
            raise InvalidTopicFilter(
                f"topic filter is {len(self.text)} characters long; the limit is {FILTER_MAX_CHARS}"
            )
        levels = tuple(self.text.split("/"))
        for level in levels:
            problem = _level_problem(level)
            if problem is not None:
                raise InvalidTopicFilter(f"invalid topic filter {self.text!r}: it {problem}")
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "prefix", prefix_of(levels))

    @classmethod
    def parse(cls, text: str) -> TopicFilter:
        return cls(text)

    def __str__(self) -> str:
        return self.text

    @property
    def matches_everything(self) -> bool:
        """True when this filter matches every topic (it has a ``**`` and nothing else but ``**``)."""
        return all(level == ANY_LEVELS for level in self.levels)

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` (a valid topic name) matches this filter. A name without the filter's literal prefix is
        refused without splitting it: a site of 100,000 topics matches each against a narrow filter cheaply."""
        return topic.startswith(self.prefix) and match_levels(self.levels, topic.split("/"))


def prefix_of(levels: Sequence[str]) -> str:
    """The text every name the filter ``levels`` match starts with: its literal levels before the first wildcard,
    joined by "/" ("" when it starts with one). A matching name's first levels are those literals, so it starts with
    them; "orders/**" gives "orders", which "orders2/x" starts with too: the prefix narrows, ``matches`` decides."""
    literal: list[str] = []
    for level in levels:
        if level in (ONE_LEVEL, ANY_LEVELS):
            break
        literal.append(level)
    return "/".join(literal)


def match_levels(pattern: Sequence[str], topic: Sequence[str]) -> bool:
    """Do the filter levels ``pattern`` (literals, ``+``, ``**``) match the levels of a name? Topic filters use it,
    and so do the ACLs' principal patterns (``georep/auth/acl.py``)."""
    if ANY_LEVELS not in pattern:
        if len(pattern) != len(topic):
            return False
        return all(p in (ONE_LEVEL, t) for p, t in zip(pattern, topic, strict=True))
    # reached[j]: the filter levels seen so far match the first j topic levels.
    # Linear in len(pattern) * len(topic): no backtracking, however many '**'.
    reached = [True] + [False] * len(topic)
    for p in pattern:
        if p == ANY_LEVELS:
            seen = False
            for j in range(len(reached)):
                seen = seen or reached[j]
                reached[j] = seen
        else:
            for j in range(len(topic), 0, -1):
                reached[j] = reached[j - 1] and (p == ONE_LEVEL or p == topic[j - 1])
            reached[0] = False
    return reached[len(topic)]


ALL_TOPICS: tuple[TopicFilter, ...] = (TopicFilter(ANY_LEVELS),)


def matches_any(filters: Iterable[TopicFilter], topic: str) -> bool:
    """Whether any filter in ``filters`` matches ``topic`` (a link's filter list)."""
    return any(f.matches(topic) for f in filters)
