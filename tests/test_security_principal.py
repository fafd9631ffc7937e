"""Principals: the three forms, what each speaks for, and the messages for everything else."""

from __future__ import annotations

import pytest

from georep.auth.principal import (
    InvalidPrincipal,
    Principal,
    parse_principal,
    principal_file_name,
    principal_from_uri,
    principal_of_names,
)


@pytest.mark.parametrize(
    ("text", "kind", "name", "site"),
    [
        ("site:a", "site", "a", "a"),
        ("node:us-east/2", "node", "us-east/2", "us-east"),
        ("client:alice", "client", "alice", None),
        ("client:svc.orders@prod", "client", "svc.orders@prod", None),
    ],
)
def test_the_three_forms_parse_and_print_back(text: str, kind: str, name: str, site: str | None) -> None:
    p = parse_principal(text)
    assert (p.kind, p.name, p.site) == (kind, name, site)
    assert str(p) == text
    assert parse_principal(str(p)) == p


def test_a_node_principal_names_its_node_and_speaks_for_its_site() -> None:
    p = parse_principal("node:b/12")
    assert (p.site, p.node) == ("b", 12)
    assert parse_principal("site:b").node is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "alice",
        "user:alice",
        "site:",
        "site:A",
        "site:a/1",
        "node:a",
        "node:a/",
        "node:a/0",
        "node:a/01",
        "node:a/x",
        "node:/1",
        "client:",
        "client:-x",
        "client:a b",
        "client:" + "x" * 65,
        "site:" + "a" * 33,
    ],
)
def test_anything_else_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(InvalidPrincipal) as info:
        parse_principal(text)
    assert "site:<site>" in str(info.value) and "node:<site>/<n>" in str(info.value)
    assert "client:<name>" in str(info.value)


def test_principals_sort_by_kind_then_name() -> None:
    ps = [parse_principal(t) for t in ("site:b", "client:z", "node:a/1", "site:a")]
    assert [str(p) for p in sorted(ps)] == ["client:z", "node:a/1", "site:a", "site:b"]


def test_the_san_uri_comes_before_the_common_name() -> None:
    assert principal_of_names(["spiffe://x/y", "georep:site:a"], "client:bob") == Principal("site", "a")
    assert principal_of_names(["spiffe://x/y"], "client:bob") == Principal("client", "bob")
    assert principal_of_names([], "node-1.example.com") is None  # a host-name CN names nobody
    assert principal_of_names([], None) is None
    assert principal_from_uri("https://example.com") is None
    with pytest.raises(InvalidPrincipal):
        principal_from_uri("georep:user:x")  # a georep URI that is not a principal is an error, not ignored


def test_file_names_have_no_separators() -> None:
    assert principal_file_name(parse_principal("node:a/2")) == "node-a-2"
    assert principal_file_name(parse_principal("client:alice")) == "client-alice"
