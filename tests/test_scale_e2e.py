"""Issue 22, "Done when": a 3-site cycle (mutual TLS) keeps its links up at 5,000 partitions and converges.

Not a timing test: it fails on a link flap during an idle window (a link leaving ``streaming``, an error on a
link, or a node logging that it heard nothing from a peer), on a record not acknowledged (a delivery timeout), and on
a record missing at any site.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites, converged, produce, wait_until

PARTITIONS = 5_000
RECORDS = 10_000
IDLE_WINDOW_S = 20.0
CYCLE = [("a", "b"), ("b", "c"), ("c", "a")]
SITES = ["a", "b", "c"]
FLAP_LOG = re.compile(r"no message from \w+ for \d+ ms")


def link_trouble(sites: Sites) -> list[str]:
    """Every link of every site that is not streaming, or that reports an error, as a readable line."""
    out = []
    for s in SITES:
        for link in sites.status(s).links:
            if link.state != "streaming" or link.last_error:
                out.append(f"{link.src}->{link.dst} at {s}: {link.state} {link.last_error!r}")
    return out


def flaps_logged(sites: Sites, root: Path) -> list[str]:
    return [
        f"{s}: {line.strip()}"
        for s in SITES
        for line in (root / s / "node.log").read_text(errors="replace").splitlines()
        if FLAP_LOG.search(line)
    ]


@pytest.mark.slow
def test_5000_partitions_idle_links_hold_and_a_spread_produce_converges(tmp_path: Path) -> None:
    sites = Sites(tmp_path, SITES, CYCLE, tls_dir=tmp_path / "tls")
    try:
        sites.start()
        sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="big", partitions=PARTITIONS), timeout=120)
        wait_until(
            "every site has the 5,000-partition topic",
            lambda: all(len(sites.vectors(s, "big")) == PARTITIONS for s in SITES),
            timeout_s=120,
        )
        wait_until("every link streams", lambda: not link_trouble(sites), timeout_s=60)
        logged_before = flaps_logged(sites, tmp_path)

        # The idle window: polled, never slept through, so a link that drops and comes back is seen.
        trouble: list[str] = []

        def idle_over() -> bool:
            trouble.extend(link_trouble(sites))
            return False

        with pytest.raises(AssertionError, match="timed out"):
            wait_until("the idle window ends", idle_over, timeout_s=IDLE_WINDOW_S)
        flapped = [line for line in flaps_logged(sites, tmp_path) if line not in logged_before]
        assert not trouble and not flapped, f"links flapped while idle: {(trouble + flapped)[:10]}"

        # Keyed records spread over every partition; a delivery timeout raises here.
        sent = asyncio.run(produce(sites.address("a"), "big", "s", RECORDS, tls=sites.tls))
        assert len(sent) == RECORDS
        wait_until(
            "every site holds every record",
            lambda: converged(sites, SITES, "big", expect_total=RECORDS),
            timeout_s=120,
        )
        for s in SITES:
            vectors = sites.vectors(s, "big")
            assert sum(sum(v.values()) for v in vectors.values()) == RECORDS, f"site {s} misses records"
    finally:
        sites.close()
