"""``georep group reset-offsets`` on a 3-node site (issue 23): the partitions' leaders are spread over the nodes and
the group's coordinator is one of them; a reset run against any node moves the group's positions of every
partition, and both front ends, georep's consumer and confluent-kafka's, resume from them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support.cli import georep, ok
from tests.support.cluster_site import ClusterSite, status, wait_for
from tests.support.kafka_nodes import group_reads

confluent_kafka = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.slow  # three node processes, CLI processes and Kafka consumers

TOPIC = "resets"
PARTITIONS = 3


@pytest.fixture
def site(tmp_path: Path) -> Iterator[ClusterSite]:
    s = ClusterSite(tmp_path, 3, kafka=True)
    s.start()
    # Leaders spread over the nodes live when the topic is created.
    wait_for("every node live in the site's metadata", lambda: sum(n.live for n in status(s).nodes) == 3)
    yield s
    s.close()


def bootstrap(site: ClusterSite) -> str:
    return ",".join(site.address(n) for n in site.nodes)


def produce(site: ClusterSite, values: list[str]) -> None:
    stdin = "".join(v + "\n" for v in values).encode()
    ok(georep("produce", TOPIC, "--bootstrap", bootstrap(site), "--linger-ms", "0", stdin=stdin, timeout=60))


def georep_reads(site: ClusterSite, group: str, n: int) -> list[str]:
    """What georep's consumer of ``group`` reads from its committed positions: ``n`` records (a start at a wrong
    position reads others), or, for ``n`` 0, what comes before it has been idle for 10 s."""
    out = ok(
        georep(
            "consume",
            TOPIC,
            "--group",
            group,
            "--from-beginning",
            "--timeout",
            "10",
            *(["--max-messages", str(n)] if n else []),
            "--bootstrap",
            bootstrap(site),
            timeout=90,
        )
    )
    return sorted(out.splitlines())


def kafka_reads(site: ClusterSite, group: str, n: int) -> list[str]:
    bootstrap = ",".join(site.kafka_address(node) for node in site.nodes)
    return sorted(group_reads(bootstrap, TOPIC, group, n, wait_s=40, idle_s=8))


def reset(site: ClusterSite, node: int, group: str, *to: str) -> str:
    return ok(georep("group", "reset-offsets", group, "--topic", TOPIC, *to, "--bootstrap", site.address(node)))


def test_reset_offsets_on_a_three_node_site_moves_both_front_ends(site: ClusterSite) -> None:
    ok(georep("topic", "create", TOPIC, "--partitions", str(PARTITIONS), "--bootstrap", site.address(1)))
    leaders = {site.wait_leader(TOPIC, i) for i in range(PARTITIONS)}
    early = [f"e{i}" for i in range(9)]
    produce(site, early)
    between = datetime.now(UTC).isoformat()  # after every early record's timestamp: the produce returned
    late = [f"l{i}" for i in range(6)]
    produce(site, late)
    everything = sorted(early + late)
    assert georep_reads(site, "g", len(everything)) == everything

    # Each reset from another node: the one asked neither leads every partition nor, for some, coordinates.
    reset(site, 2, "g", "--to-earliest")
    assert georep_reads(site, "g", len(everything)) == everything, (
        "georep's consumer did not resume from the reset position"
    )
    reset(site, 3, "g", "--to-datetime", between)
    assert kafka_reads(site, "g", len(late)) == sorted(late), "a Kafka consumer did not resume from the reset"
    reset(site, 1, "g", "--to-earliest")
    assert kafka_reads(site, "g", len(everything)) == everything
    reset(site, 2, "g", "--to-datetime", between)
    assert georep_reads(site, "g", len(late)) == sorted(late)
    reset(site, 3, "g", "--to-latest")
    assert kafka_reads(site, "g", 0) == [] and georep_reads(site, "g", 0) == []
    assert len(leaders) > 1, "the partitions' leaders were not spread: the test did not cover a reset across nodes"
