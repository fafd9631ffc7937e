from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support import forkserver
from tests.support.examples import examples
from tests.support.node_api import stub_for
from tests.support.sites import Sites

# Tests that share one expensive thing run on one xdist worker (`make test` runs `pytest -n 5 --dist loadgroup`):
# the Spark tests share one JVM (the suite is CPU-bound on two cores: a second JVM for the live audit's tests made
# a quiet run 12:36 where one made it 11:49, issue 24), each simulator module shares one process pool, and the
# Toxiproxy fault tests share two sites behind their proxies (a module fixture: spread over workers, each worker
# would start its own). The groups of GROUPS_FIRST are the longest chains of the run, so they are handed out
# first. The groups are whole files, named here, because xdist's own marks do not group anything under pytest 9.2
# (xdist 3.8 renames items through an attribute pytest no longer reads), so the scheduler below groups by file.
SHARED_ON_ONE_WORKER = {
    "test_audit.py": "spark",
    "test_audit_sites.py": "spark",
    "test_audit_replicas.py": "spark",
    "test_audit_commands.py": "spark",
    "test_audit_reader.py": "spark",
    "test_audit_live.py": "spark",
    "test_audit_live_replicas.py": "spark",
    "test_audit_continuous.py": "spark",
    "test_sim.py": "sim",
    "test_sim_cluster.py": "sim-cluster",
    "test_sim_geo_cluster.py": "sim-geo-cluster",
    "test_faults_toxiproxy.py": "faults-toxiproxy",
}
GROUPS_FIRST = ("spark", "sim", "sim-cluster", "sim-geo-cluster")

# After the groups, the slow scenarios (10-80 s each in a loaded run) go before the quick tests, the files of
# LONGEST_FIRST (the longest single tests of the last runs) first among them, so that the run ends on quick tests:
# handed out in file order, the 5,000-partition scenario of test_scale_e2e.py (76 s) started late and could hold
# one worker after the others had finished. xdist hands out the groups first (the largest first), then the single
# tests in the order pytest_collection_modifyitems leaves them.
LONGEST_FIRST = ("test_spark_cluster.py", "test_scale_e2e.py", "test_faults_e2e.py", "test_bench_scripts.py")

# Property tests that name no example count draw Hypothesis's default 100, scaled as the named ones are
# (tests/support/examples.py: make test-quick draws a quarter).
settings.register_profile("georep", max_examples=examples(100))
settings.load_profile("georep")


def pytest_configure(config: pytest.Config) -> None:
    """Nodes start as forks of a server that has imported their modules (tests/support/forkserver.py: a fresh
    interpreter spends about 0.55 s of CPU importing them); GEOREP_TEST_FORKSERVER=0 starts them with Popen."""
    if forkserver.enabled():
        forkserver.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    forkserver.uninstall()


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _group(nodeid: str) -> str | None:
    return SHARED_ON_ONE_WORKER.get(_file(nodeid))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    spark_groups = {g for g in SHARED_ON_ONE_WORKER.values() if g.startswith("spark")}
    uses_spark = [i for i in items if "spark" in getattr(i, "fixturenames", ())]
    strays = [i.nodeid for i in uses_spark if _group(i.nodeid) not in spark_groups]
    if strays:
        raise pytest.UsageError(
            f"{strays[0]} uses Spark: add its file to a Spark group of SHARED_ON_ONE_WORKER in "
            "tests/conftest.py so that it shares a JVM"
        )
    rank = {g: i for i, g in enumerate(GROUPS_FIRST)}
    longest = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: (
            rank.get(_group(item.nodeid) or "", len(rank)),
            item.get_closest_marker("slow") is None,
            longest.get(_file(item.nodeid), len(longest)),
        )
    )  # stable: file order otherwise


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each group of SHARED_ON_ONE_WORKER is one unit of work; every other test is a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid) or nodeid

    return GroupScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test runs from an empty directory, so no file a user left in the checkout changes it: a ``georep up``
    run there leaves ``.georep/certs``, which every ``georep`` command takes as its default TLS settings."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[object]:
    """Factory: ``start_node(site="a", **kw)`` starts a real ``georep node`` process.

    Every process started here is killed at teardown.
    """
    started: list[NodeProcess] = []

    def factory(site: str = "a", data_dir: Path | None = None, extra_args: list[str] | None = None) -> NodeProcess:
        node = NodeProcess(
            site=site, data_dir=data_dir or tmp_path / f"node-{site}-{len(started)}", extra_args=list(extra_args or [])
        )
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

    def factory(
        sites: list[str], links: list[tuple[str, str]], stall_ms: int = 1000, extra_args: list[str] | None = None
    ) -> Sites:
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
    quick compiler only (C2 and parallel GC threads doubled the JVM's CPU time for data this small). Expressions
    are interpreted, not compiled: generating and compiling Java for every plan cost more than evaluating a few
    thousand rows (about a quarter of the JVM's CPU time in ``tests/test_audit.py``); the audit's results do not
    depend on it, and ``georep audit`` itself keeps Spark's code generation."""
    from spark_jobs.session import DEFAULTS, spark_session

    java_options = DEFAULTS["spark.driver.extraJavaOptions"] + " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    session = spark_session(
        "local[1]",
        "georep-audit-tests",
        {
            "spark.sql.shuffle.partitions": "1",
            "spark.driver.extraJavaOptions": java_options,
            "spark.sql.codegen.wholeStage": "false",
            "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        },
    )
    yield session
    session.stop()
