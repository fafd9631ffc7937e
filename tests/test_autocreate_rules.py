"""``auto_create`` patterns (topology/autocreate.py) and the node's one create per missing name (auto_create.py)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from georep.auth.acl import PermissionDenied
from georep.broker.errors import CatalogNotSynced
from georep.metadata.store import TopicExists
from georep.server.auto_create import AutoCreate
from tests.support.examples import examples
from topology.autocreate import AutoCreateRule, rule_for
from topology.filters import TopicFilter
from topology.model import InvalidTopology, parse_topology

SITE = '[sites.a]\nnodes = ["127.0.0.1:7101"]\n'


def _rules(text: str) -> tuple[AutoCreateRule, ...]:
    return parse_topology(SITE + f"auto_create = {text}\n").site("a").auto_create


def test_strings_and_tables_parse_and_the_first_matching_pattern_decides() -> None:
    rules = _rules(
        '[{ pattern = "orders/vip/**", partitions = 8 }, "orders/**", { pattern = "+", config = { a = "1" } }]'
    )
    assert [str(r.pattern) for r in rules] == ["orders/vip/**", "orders/**", "+"]
    assert rule_for(rules, "orders/vip/x") == rules[0] and rules[0].partitions == 8
    assert rule_for(rules, "orders/eu/x") == rules[1] and rules[1].partitions == 1 and rules[1].config == ()
    assert rule_for(rules, "solo") == rules[2] and rules[2].config == (("a", "1"),)
    assert rule_for(rules, "other/x") is None
    assert parse_topology(SITE).site("a").auto_create == ()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('"orders/**"', "must be a list"),
        ('["orders*"]', "a wildcard must be a whole level"),
        ("[{ partitions = 2 }]", "missing 'pattern'"),
        ('[{ pattern = "x", partitions = 0 }]', "from 1 to"),
        ('[{ pattern = "x", partitions = true }]', "whole number"),
        ('[{ pattern = "x", config = { a = 1 } }]', "config must be a table of strings"),
        ('[{ pattern = "x", topics = 1 }]', "unknown key 'topics'"),
        ('["__georep_offsets"]', "never created on first use"),
        ('["x", "x"]', "twice"),
        ("[3]", "a pattern string or a table"),
    ],
)
def test_a_bad_entry_is_refused_naming_it_and_what_to_write(text: str, says: str) -> None:
    with pytest.raises(InvalidTopology, match=r"\[sites\.a\]") as info:
        _rules(text)
    assert says in str(info.value), info.value


@given(st.lists(st.sampled_from(["a", "b", "c", "__georep_x"]), min_size=1, max_size=4))
@settings(max_examples=examples(200), deadline=None)
def test_an_internal_name_is_never_created_whatever_the_patterns(levels: list[str]) -> None:
    name = "/".join(levels)
    rules = (AutoCreateRule(TopicFilter("**")), AutoCreateRule(TopicFilter("+/**")))
    assert (rule_for(rules, name) is None) == name.startswith("__georep")


class _Site:
    """A topic table that ``AutoCreate`` creates into, a ``CreateTopics`` at a time; each yields to the loop, as a
    real one does."""

    def __init__(self, made_elsewhere: bool = False) -> None:
        self.topics: dict[str, int] = {}
        self.creates: list[list[str]] = []
        self.made_elsewhere = made_elsewhere

    async def create(self, requests: list[tuple[str, int, dict[str, str]]]) -> list[object]:
        self.creates.append([name for name, _p, _c in requests])
        await asyncio.sleep(0.01)
        self.topics.update((name, partitions) for name, partitions, _c in requests)
        return [TopicExists(name) if self.made_elsewhere else name for name, _p, _c in requests]


def test_many_produces_of_one_new_name_make_one_create() -> None:
    site = _Site()
    auto = AutoCreate((AutoCreateRule(TopicFilter("orders/**"), 3),), site.topics.__contains__, site.create)

    async def run() -> None:
        await asyncio.gather(*(auto.ensure("orders/x", lambda _n: None) for _ in range(20)))
        await auto.ensure("orders/x", lambda _n: None)  # exists now: nothing to do
        await auto.ensure("misc/y", lambda _n: None)  # no pattern: nothing to do

    asyncio.run(run())
    assert site.creates == [["orders/x"]] and site.topics == {"orders/x": 3} and auto.created == 1


def test_names_asked_for_while_a_create_runs_go_together_in_the_next() -> None:
    site = _Site()
    auto = AutoCreate((AutoCreateRule(TopicFilter("**")),), site.topics.__contains__, site.create)

    async def run() -> None:
        await asyncio.gather(*(auto.ensure(f"t{i}", lambda _n: None) for i in range(50)))

    asyncio.run(run())
    assert len(site.topics) == 50 and auto.created == 50
    assert len(site.creates) <= 2, site.creates  # not one create per name: a table rewritten per create


def test_a_name_made_meanwhile_counts_as_made_and_a_refusal_creates_nothing() -> None:
    site = _Site(made_elsewhere=True)
    auto = AutoCreate((AutoCreateRule(TopicFilter("**")),), site.topics.__contains__, site.create)
    asyncio.run(auto.ensure("t", lambda _n: None))
    assert site.topics == {"t": 1} and auto.created == 0
    with pytest.raises(PermissionDenied, match="client:bob may not create_topic"):
        asyncio.run(auto.ensure("u", lambda _n: "client:bob may not create_topic topic:u"))
    assert "u" not in site.topics and len(site.creates) == 1


def test_a_failed_create_fails_each_of_its_produces_and_the_next_may_succeed() -> None:
    calls = 0

    async def create(requests: list[tuple[str, int, dict[str, str]]]) -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise CatalogNotSynced("no first catalog sync with site b yet")
        return [name for name, _p, _c in requests]

    auto = AutoCreate((AutoCreateRule(TopicFilter("**")),), lambda _n: False, create)
    with pytest.raises(CatalogNotSynced):
        asyncio.run(auto.ensure("t", lambda _n: None))
    asyncio.run(auto.ensure("t", lambda _n: None))
    assert auto.created == 1
