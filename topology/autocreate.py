"""Topics created on first use: a site's ``auto_create`` patterns. Pure.

A site's table in the topology file may list patterns; a produce to a topic that does not exist at the site, whose
name one of them matches, creates the topic first (``georep/server/auto_create.py``), as Kafka's
``auto.create.topics.enable`` does for every name and Solace does for its dynamic topics::

    [sites.a]
    nodes = ["127.0.0.1:7101"]
    auto_create = [
        "metrics/**",                                                  # 1 partition, the node's defaults
        { pattern = "orders/**", partitions = 4, config = { retention_ms = "604800000" } },
    ]

A string is a pattern alone (one partition, the node's default config). A table names the pattern, and may give
``partitions`` and ``config`` (string values, as ``georep topic create --config`` takes them; the node checks them
when it starts). The first pattern that matches decides, so list the narrower ones first. Patterns are
``topology/filters.py``'s: ``+`` one level, ``**`` any number. Internal names (``__georep...``) are never created
this way, whatever the patterns say.

Without the key a site creates nothing on first use: a produce to an unknown topic is refused, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from topology.filters import InvalidTopicFilter, TopicFilter, is_internal

AUTO_CREATE_KEYS = ("pattern", "partitions", "config")
DEFAULT_PARTITIONS = 1  # Kafka's num.partitions default
PARTITIONS_MAX = 10_000  # as georep/metadata/topics.py's


@dataclass(frozen=True, slots=True)
class AutoCreateRule:
    """One pattern, with what a topic it creates gets."""

    pattern: TopicFilter
    partitions: int = DEFAULT_PARTITIONS
    config: tuple[tuple[str, str], ...] = field(default=())

    def describe(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.config)
        return f"{self.pattern} ({self.partitions} partition{'s' if self.partitions != 1 else ''}{extra})"


def rule_for(rules: tuple[AutoCreateRule, ...], topic: str) -> AutoCreateRule | None:
    """The first rule whose pattern matches ``topic`` (a valid topic name); None for an internal name or no match."""
    if is_internal(topic):
        return None
    for rule in rules:
        if rule.pattern.matches(topic):
            return rule
    return None


class InvalidAutoCreate(ValueError):
    """An ``auto_create`` entry that cannot be taken; the message says what to write instead."""


EXAMPLE = '{ pattern = "orders/**", partitions = 4 }'


def parse_rules(value: object, where: str) -> tuple[AutoCreateRule, ...]:
    """A site table's ``auto_create`` list. Raises :class:`InvalidAutoCreate` naming the entry and the fix."""
    if not isinstance(value, list):
        raise InvalidAutoCreate(f'{where}: auto_create must be a list of patterns, for example ["orders/**"]')
    rules = tuple(_parse_rule(entry, f"{where} auto_create entry #{n}") for n, entry in enumerate(value, start=1))
    seen: set[str] = set()
    for rule in rules:
        if rule.pattern.text in seen:
            raise InvalidAutoCreate(f"{where}: auto_create lists {rule.pattern.text!r} twice: keep one")
        seen.add(rule.pattern.text)
    return rules


def _parse_rule(entry: object, where: str) -> AutoCreateRule:
    if isinstance(entry, str):
        return AutoCreateRule(_pattern(entry, where))
    if not isinstance(entry, dict):
        raise InvalidAutoCreate(f"{where}: write a pattern string or a table such as {EXAMPLE}, got {entry!r}")
    extra = sorted(k for k in entry if k not in AUTO_CREATE_KEYS)
    if extra:
        raise InvalidAutoCreate(f"{where}: unknown key {extra[0]!r}; allowed keys are {', '.join(AUTO_CREATE_KEYS)}")
    if "pattern" not in entry:
        raise InvalidAutoCreate(f"{where}: missing 'pattern', for example {EXAMPLE}")
    partitions = entry.get("partitions", DEFAULT_PARTITIONS)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= PARTITIONS_MAX:
        raise InvalidAutoCreate(f"{where}: partitions must be a whole number from 1 to {PARTITIONS_MAX}")
    return AutoCreateRule(_pattern(entry["pattern"], where), partitions, _config(entry.get("config", {}), where))


def _pattern(text: object, where: str) -> TopicFilter:
    if not isinstance(text, str):
        raise InvalidAutoCreate(f"{where}: the pattern must be a string such as 'orders/**', got {text!r}")
    try:
        pattern = TopicFilter(text)
    except InvalidTopicFilter as exc:
        raise InvalidAutoCreate(f"{where}: {exc}") from None
    if is_internal(pattern.levels[0]):
        raise InvalidAutoCreate(f"{where}: {text!r} names internal topics, which are never created on first use")
    return pattern


def _config(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidAutoCreate(
            f'{where}: config must be a table of strings, for example config = {{ retention_ms = "86400000" }}'
        )
    return tuple(sorted((str(k), v) for k, v in value.items()))
