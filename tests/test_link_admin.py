"""georep link cut|heal: an operator cuts one link; data routes around it; healing restores the route."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

from georep.proto import georep_pb2 as pb
from tests.support.sites import TRIANGLE, Sites, check_invariants, converged, produce, wait_until


def georep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=60)


def upstream_of(sites: Sites, site: str, origin_site: str) -> str:
    (ps,) = [p for p in sites.status(site).partitions if p.topic == "t"]
    return next(lag.upstream for lag in ps.lags if lag.origin.startswith(origin_site + "@"))


def test_cut_link_is_routed_around_and_heal_restores_it(make_sites: Callable[..., Sites]) -> None:
    names = ["a", "b", "c"]
    sites = make_sites(names, TRIANGLE)
    sites.start()
    sites.stub("c").CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
    wait_until("the topic reaches a", lambda: sites.vectors("a", "t") != {}, 15)
    expected = asyncio.run(produce(sites.address("c"), "t", "before", 200))
    wait_until("all sites converge", lambda: converged(sites, names, "t", 200), 20)
    # The direct link is a's route for c's records. Under load a stalls on it for a moment and takes them
    # through b (the stall rule); once c's link has caught up, the route comes back.
    wait_until("a pulls c's records from c directly", lambda: upstream_of(sites, "a", "c") == "c", 15)

    cut = georep("link", "cut", "c", "a", "--topology", str(sites.topology))
    assert cut.returncode == 0, cut.stderr
    assert "link c -> a: cut (state down)" in cut.stdout
    expected |= asyncio.run(produce(sites.address("c"), "t", "cut", 200))
    wait_until("a gets c's records through b", lambda: converged(sites, names, "t", 400), 20)
    links = {lk.src: lk for lk in sites.status("a").links}
    assert links["c"].state == "down" and "georep link heal" in links["c"].last_error
    assert upstream_of(sites, "a", "c") == "b"
    show = georep("topology", "show", str(sites.topology), "--output", str(sites.topology.with_suffix(".svg")))
    assert show.returncode == 0, show.stderr
    rows = {line.split()[0] + line.split()[2]: line for line in show.stdout.splitlines() if " -> " in line}
    assert "down" in rows["ca"] and "streaming" in rows["ba"]  # live state from the running sites
    assert "<svg" in sites.topology.with_suffix(".svg").read_text()

    heal = georep("link", "heal", "c", "a", "--topology", str(sites.topology))
    assert heal.returncode == 0, heal.stderr
    assert "link c -> a: healed, streaming" in heal.stdout  # it said "healed (state down)", the state before
    wait_until("a pulls c directly again", lambda: upstream_of(sites, "a", "c") == "c", 15)
    expected |= asyncio.run(produce(sites.address("c"), "t", "healed", 200))
    wait_until("all sites converge", lambda: converged(sites, names, "t", 600), 20)
    check_invariants(sites, names, "t", expected)


def test_unknown_links_are_refused_clearly(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b")])
    sites.start()
    proc = georep("link", "cut", "b", "a", "--topology", str(sites.topology))
    assert proc.returncode == 2 and "b -> a" in proc.stderr and "Traceback" not in proc.stderr
    proc = georep("link", "cut", "zz", "a", "--topology", str(sites.topology))
    assert proc.returncode == 2 and "zz" in proc.stderr
