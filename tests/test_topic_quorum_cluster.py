"""A topic's own ``min_insync_replicas`` on a three-node site of real ``georep node`` processes (issue 23): with one
node killed, a topic that asks 3 refuses ``acks=all`` writes with a clear NOT_ENOUGH_REPLICAS, one that asks 2 goes
on taking them, and altering the first to 2 lets it take them again at once (its leader opens a segment with the
new quorum); altering the second to 3 rolls its open segment and refuses its writes. Creates and alters that ask
more than the replication factor are refused."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, status, wait_for

pytestmark = pytest.mark.slow

STRICT, LOOSE = "strict", "loose"


def _leader(site: ClusterSite, topic: str) -> int:
    """The node the site's metadata names as ``topic``-0's leader (it may not serve it: no segment open)."""
    for _, d in site.descriptions(topic):
        leaders = [p.node_id for p in d.leaders if p.partition == 0 and p.node_id in site.live()]
        if leaders:
            return leaders[0]
    raise AssertionError(f"no live node is named leader of {topic}-0")


def produce(site: ClusterSite, topic: str) -> grpc.RpcError | None:
    """One acks=all record to ``topic``-0 at its leader: None once acknowledged, else the error."""
    batch = encode_batch([RecordInput(None, b"x" * 100, (), 1_700_000_000_000)])
    request = pb.ProduceRequest(topic=topic, partition=0, batch=batch, acks=pb.ACKS_ALL, ack_timeout_ms=3_000)
    try:
        with open_channel(site.address(_leader(site, topic))) as channel:
            pbg.NodeStub(channel).Produce(request, timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


def takes_write(site: ClusterSite, topic: str) -> object:
    error = produce(site, topic)
    return True if error is None else f"{error.code()} {error.details()}"


def refused_for_quorum(site: ClusterSite, topic: str) -> object:
    """True once a write to ``topic`` is refused for its quorum (the error otherwise, for wait_for's message)."""
    error = produce(site, topic)
    if (
        error is not None
        and error.code() == grpc.StatusCode.UNAVAILABLE
        and "min_insync_replicas" in (error.details() or "")
    ):
        return True
    return error


def _call(site: ClusterSite, method: str, request: object) -> grpc.RpcError | None:
    with open_channel(site.address(site.live()[0])) as channel:
        try:
            getattr(pbg.NodeStub(channel), method)(request, timeout=15)
        except grpc.RpcError as exc:
            return exc
    return None


def test_a_topics_own_quorum_refuses_writes_it_cannot_meet_until_altered(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
    with site.running():
        wait_for("every node live in the site's metadata", lambda: sum(n.live for n in status(site).nodes) == 3)
        over = _call(
            site, "CreateTopic", pb.CreateTopicRequest(name="over", partitions=1, config={"min_insync_replicas": "4"})
        )
        assert over is not None and over.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ask for min.insync.replicas of 1 to 3" in (over.details() or "")
        for name, aq in ((STRICT, "3"), (LOOSE, "2")):
            assert (
                _call(
                    site,
                    "CreateTopic",
                    pb.CreateTopicRequest(name=name, partitions=1, config={"min_insync_replicas": aq}),
                )
                is None
            )
            wait_for(f"{name} takes a write", partial(takes_write, site, name))
        lowered = _call(site, "AlterTopic", pb.AlterTopicRequest(name=STRICT, set={"replication_factor": "2"}))
        assert lowered is not None and lowered.code() == grpc.StatusCode.INVALID_ARGUMENT  # not silently raised
        assert "a replication factor of at least 3" in (lowered.details() or "")

        victim = next(n for n in (1, 2, 3) if n not in (_leader(site, STRICT), _leader(site, LOOSE)))
        site.nodes[victim].kill9()
        wait_for(f"{LOOSE} takes writes on its two live nodes", partial(takes_write, site, LOOSE))
        wait_for(
            f"{STRICT} refuses writes: 2 live nodes, min_insync_replicas 3", lambda: refused_for_quorum(site, STRICT)
        )
        assert produce(site, LOOSE) is None

        assert _call(site, "AlterTopic", pb.AlterTopicRequest(name=STRICT, set={"min.insync.replicas": "2"})) is None
        wait_for(f"{STRICT} takes writes again once altered to 2", partial(takes_write, site, STRICT))
        # the reverse, on a partition writing its open segment: its leader rolls it, and cannot open the next
        assert _call(site, "AlterTopic", pb.AlterTopicRequest(name=LOOSE, set={"min_insync_replicas": "3"})) is None
        wait_for(f"{LOOSE} refuses writes once altered to 3", lambda: refused_for_quorum(site, LOOSE))
