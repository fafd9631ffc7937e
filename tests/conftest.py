from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support.node_api import stub_for
from tests.support.sites import Sites

# Tests that share one expensive thing run on one xdist worker (`make test` runs `pytest -n 3 --dist loadgroup`):
# every test that uses Spark shares one JVM, and each simulator module shares one process pool. These groups
# are the longest chains of the run, so they are handed out first.
SHARED_ON_ONE_WORKER = {"test_sim.py": "sim", "test_sim_cluster.py": "sim-cluster"}
GROUPS_FIRST = ("spark", "sim", "sim-cluster")


def _group(item: pytest.Item) -> str | None:
    if "spark" in getattr(item, "fixturenames", ()):
        return "spark"
    return SHARED_ON_ONE_WORKER.get(item.path.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        if groups[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    rank = {g: i for i, g in enumerate(GROUPS_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid] or "", len(rank)))  # stable: file order otherwise


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[object]:
    """Factory: ``start_node(site="a", **kw)`` starts a real ``georep node`` process.

    Every process started here is killed at teardown.
    """
    started: list[NodeProcess] = []

    def factory(site: str = "a", data_dir: Path | None = None, extra_args: list[str] | None = None) -> NodeProcess:
        node = NodeProcess(site=site, data_dir=data_dir or tmp_path / f"node-{site}-{len(started)}",
                           extra_args=list(extra_args or []))
        started.append(node)
        return node.start()

    yield factory
    for node in started:
        node.kill9()


@pytest.fixture
def node(start_node) -> NodeProcess:  # type: ignore[no-untyped-def]
    """One running node of site ``a`` with default settings."""
    return start_node()  # type: ignore[no-any-return]


@pytest.fixture
def api(node: NodeProcess) -> Iterator[pbg.NodeStub]:
    """A raw gRPC stub on ``node``, with topic ``t`` of 2 partitions created."""
    channel, stub = stub_for(node)
    stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=2))
    yield stub
    channel.close()


@pytest.fixture
def make_sites(tmp_path: Path) -> Iterator[Callable[..., Sites]]:
    """Factory: ``make_sites(["a", "b"], [("a", "b")])`` writes a topology and makes one node per site (not started).

    Every node made here is killed at teardown.
    """
    made: list[Sites] = []

    def factory(sites: list[str], links: list[tuple[str, str]], stall_ms: int = 1000,
                extra_args: list[str] | None = None) -> Sites:  # fmt: skip
        s = Sites(tmp_path, sites, links, stall_ms, extra_args)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole run: starting a JVM costs seconds.

    Tuned for many small jobs on a shared 2-core machine: one task slot and one shuffle partition, and the JVM's
    quick compiler only (C2 and parallel GC threads doubled the JVM's CPU time for data this small)."""
    from spark_jobs.session import DEFAULTS, spark_session

    java_options = DEFAULTS["spark.driver.extraJavaOptions"] + " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    session = spark_session("local[1]", "georep-audit-tests", {"spark.sql.shuffle.partitions": "1",
                                                                "spark.driver.extraJavaOptions": java_options})
    yield session
    session.stop()
