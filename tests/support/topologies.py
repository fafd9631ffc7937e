"""Topologies that several link tests share, parsed from the same TOML a user writes."""

from __future__ import annotations

from topology.model import Topology, parse_topology

# d's records reach a by two paths, d -> b -> a and d -> c -> a: a can fail over from one upstream to the other.
DIAMOND_TOML = """
[sites.a]
nodes = ["127.0.0.1:1"]
[sites.b]
nodes = ["127.0.0.1:2"]
[sites.c]
nodes = ["127.0.0.1:3"]
[sites.d]
nodes = ["127.0.0.1:4"]
[[links]]
src = "d"
dst = "b"
[[links]]
src = "d"
dst = "c"
[[links]]
src = "b"
dst = "a"
[[links]]
src = "c"
dst = "a"
"""


def diamond() -> Topology:
    return parse_topology(DIAMOND_TOML)
