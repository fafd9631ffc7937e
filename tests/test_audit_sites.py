"""The audit against real sites: ``georep node`` processes that replicated to quiescence over gRPC.

The audit reads their data dirs while they run (a live snapshot), then again
after a divergence is injected into a stopped site's log.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from georep.cli.topology_arg import load_topology
from georep.proto import georep_pb2 as pb
from georep.server.replicator import TICK_S
from spark_jobs import inject
from spark_jobs.audit import AuditResult, run_audit
from spark_jobs.layout import list_segments
from tests.support.sites import TRIANGLE, Sites, converged, produce, wait_until

TOPIC = "orders"


def audit_sites(spark: Any, sites: Sites, names: list[str], report: Path, as_of_ms: int) -> AuditResult:
    dirs = {s: sites.nodes[s].data_dir for s in names}
    return run_audit(spark, load_topology(sites.topology), dirs, list_segments(dirs), report, as_of_ms)


def origin_of(sites: Sites, site: str) -> str:
    return f"{site}@{json.loads((sites.nodes[site].data_dir / 'site.json').read_text())['epoch']}"


def kinds(result: AuditResult) -> list[tuple[str, str, str, int]]:
    return sorted((i["kind"], i["site"], i["origin"], i["first_seq"]) for i in result.report["issues"])


@pytest.mark.slow
def test_replicated_sites_audit_clean_live_then_a_flipped_byte_is_caught(
    make_sites: Callable[..., Sites], spark: Any, tmp_path: Path
) -> None:
    names = ["a", "b", "c"]
    sites = make_sites(names, TRIANGLE)
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2))
    wait_until("the topic reaches b and c", lambda: all(sites.vectors(s, TOPIC) for s in ("b", "c")), 10)

    async def everyone() -> None:
        await asyncio.gather(*(produce(sites.address(s), TOPIC, s, 300) for s in names))

    asyncio.run(everyone())
    wait_until("every site holds every record", lambda: converged(sites, names, TOPIC, 900), 30)
    live = audit_sites(spark, sites, names, tmp_path / "live", as_of_ms=int(time.time() * 1000))
    assert live.clean and live.report["issues"] == [], live.summary
    assert {s: t["records"] for s, t in live.report["sites"].items()} == {s: 900 for s in names}

    for node in sites.nodes.values():
        node.stop()
    a = origin_of(sites, "a")
    part = sites.nodes["b"].data_dir / "logs" / f"{TOPIC}-1"
    inject.flip_value_byte(part, a, 7)
    caught = audit_sites(spark, sites, names, tmp_path / "flipped", as_of_ms=int(time.time() * 1000))
    assert not caught.clean
    assert kinds(caught) == [("mismatch", "b", a, 7)]
    (issue,) = caught.report["issues"]
    assert issue["partition"] == 1 and issue["reference_site"] == "a" and issue["records"] == 1


@pytest.mark.slow
def test_a_site_behind_a_cut_link_is_in_flight_not_divergent(
    make_sites: Callable[..., Sites], spark: Any, tmp_path: Path
) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1))
    wait_until("the topic reaches b", lambda: sites.vectors("b", TOPIC) != {}, 10)
    asyncio.run(produce(sites.address("a"), TOPIC, "before", 200))
    wait_until("b holds a's records", lambda: converged(sites, ["a", "b"], TOPIC, 200), 20)
    sites.stub("b").SetLink(pb.SetLinkRequest(src="a", enabled=False), timeout=5)
    time.sleep(2 * TICK_S)  # the pull session notices the cut at its next tick
    cut_ms = int(time.time() * 1000)
    asyncio.run(produce(sites.address("a"), TOPIC, "after", 100))
    a = origin_of(sites, "a")

    lagging = audit_sites(spark, sites, ["a", "b"], tmp_path / "r1", as_of_ms=cut_ms)
    assert lagging.clean, lagging.summary
    ((kind, site, origin, first),) = kinds(lagging)
    assert (kind, site, origin, first) == ("in_flight", "b", a, 200)
    assert lagging.report["issues"][0]["last_seq"] == 299

    # judged as of a time after the writes, the same gap is a divergence: b should have had them by then
    strict = audit_sites(spark, sites, ["a", "b"], tmp_path / "r2", as_of_ms=int(time.time() * 1000) + 1)
    assert kinds(strict) == [("missing", "b", a, 200)] and not strict.clean

    sites.stub("b").SetLink(pb.SetLinkRequest(src="a", enabled=True), timeout=5)
    wait_until("b catches up", lambda: converged(sites, ["a", "b"], TOPIC, 300), 20)
    healed = audit_sites(spark, sites, ["a", "b"], tmp_path / "r3", as_of_ms=int(time.time() * 1000))
    assert healed.clean and healed.report["issues"] == []
