"""Delete's data path on the wire (issue 23): a pulled chunk is applied only into the live partition of its
incarnation, and an upstream serves a want only for the incarnation it holds live
(``georep/server/incarnation_guard.py``).

The hostile test runs site b's ``Replicator`` in this process, pulling over mutual TLS from a fake site a (with a's
own certificate: an authenticated peer, linked to b) that lists topic ``t`` re-created (incarnation 1) and then
serves, on b's pull, a chunk of the deleted incarnation 0 before one of incarnation 1 holding the same coordinates.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from georep.metadata.topic_entry import Stamp, TopicEntry, create
from georep.metadata.topics import TopicSpec
from georep.proto import georep_pb2 as pb
from georep.proto.topic_entry import entry_to_pb
from georep.server.incarnation_guard import servable_wants
from georep.server.replicator import Replicator
from georep.storage.metadata_file import FileMetadataStore
from offsets.coordinates import LocalOffset, Origin
from tests.support.fake_upstream import replicator_of_b, serve_as_site_a
from tests.support.sites import origin_batch, until
from topology.ids import SiteId

TOPIC = "t"
A = Origin("a", 1)  # type: ignore[arg-type]


class FakeSiteA:
    """Site a with ``t`` re-created (incarnation 1); its stream first carries a chunk of incarnation 0."""

    def __init__(self) -> None:
        self.wants: list[pb.PullWant] = []
        self.done = threading.Event()

    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse:
        entry = TopicEntry(TOPIC, 1, False, 1, (), Stamp(1_000, "a"))
        return pb.ListTopicsResponse(topics=[pb.TopicDescription(name=TOPIC, partitions=1, entry=entry_to_pb(entry))])

    def list_acls(self, request: bytes, context: Any) -> pb.ListAclsResponse:
        return pb.ListAclsResponse()

    def report_held(self, request: bytes, context: Any) -> pb.ReportHeldResponse:
        return pb.ReportHeldResponse()

    def replicate(self, request: bytes, context: Any) -> Iterator[pb.ReplicateResponse]:
        self.wants += pb.ReplicateRequest.FromString(request).wants
        vector = pb.VectorOffset(entries=[pb.OriginSeq(site="a", epoch=1, next_seq=2)])
        yield pb.ReplicateResponse()
        for incarnation, tag in ((0, b"old-"), (1, b"new-")):
            chunk = pb.ReplicaChunk(
                topic=TOPIC,
                partition=0,
                batches=origin_batch(A, 0, tag=tag),
                src_vector=vector,
                src_log_end_offset=2,
                incarnation=incarnation,
            )
            yield pb.ReplicateResponse(chunks=[chunk])
        deadline = time.monotonic() + 10
        while context.is_active() and time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.05)


def test_a_chunk_of_a_deleted_incarnation_is_never_stored_in_the_re_created_topic(tmp_path: Path) -> None:
    fake = FakeSiteA()
    server, topology, certs = serve_as_site_a(fake, tmp_path)

    async def main() -> None:
        r = replicator_of_b(tmp_path, topology, certs)
        r.start()
        try:
            await until("b holds a's records of t", lambda: _held(r) == {A: 2})
            log = r.broker.partition(TOPIC, 0).log
            data = log.read(LocalOffset(0), 1 << 20).data
            assert b"new-" in data and b"old-" not in data, "a record of the deleted incarnation was stored"
            assert r.broker.metadata.get(TOPIC).incarnation == 1
            assert {w.incarnation for w in fake.wants if w.topic == TOPIC} == {1}, "b's want named no incarnation"
            assert r.pullers[SiteId("a")].chunks.dropped_chunks == 1
        finally:
            fake.done.set()
            await r.stop()
            r.broker.close()

    try:
        asyncio.run(main())
    finally:
        server.stop(0)


def _held(r: Replicator) -> dict[Origin, int]:
    p = r.broker.partitions.get((TOPIC, 0))
    return {} if p is None else dict(p.log.vector())


def test_an_upstream_serves_a_want_only_for_the_incarnation_it_holds_live(tmp_path: Path) -> None:
    store = FileMetadataStore(tmp_path / "topics.json", "a")
    store.create_topic(TopicSpec("zero", 1, {}))
    reborn = create("reborn", 2, {}, TopicEntry("reborn", 0, True, 0, (), Stamp(4, "a")), 5, "a")
    store.merge_entries([reborn])
    wants = [
        pb.PullWant(topic="zero", partition=0),  # a peer from before incarnations: 0, right for "zero"
        pb.PullWant(topic="reborn", partition=0),  # the same peer, for a topic deleted since: refused
        pb.PullWant(topic="reborn", partition=1, incarnation=1),
        pb.PullWant(topic="unknown", partition=0),  # fails as before, further on
    ]
    served, incarnations = servable_wants(store, wants, "b")
    assert [(w.topic, w.partition) for w in served] == [("zero", 0), ("reborn", 1), ("unknown", 0)]
    assert incarnations == {"zero": 0, "reborn": 1, "unknown": 0}
