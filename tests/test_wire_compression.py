"""Issue 26: replication's compression on the wire (``georep/replication/wire.py``): what it saves on
uncompressed JSON-like batches, that the destination stores what the source holds byte for byte, and that a
hostile upstream's compressed chunk (a bomb, garbage, both forms at once) is refused before anything is stored."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from georep.metadata.topic_entry import Stamp, TopicEntry
from georep.proto import georep_pb2 as pb
from georep.proto.topic_entry import entry_to_pb
from georep.record.batch import RecordInput, encode_batch
from georep.replication import wire
from georep.replication.sink import CorruptChunk
from georep.security.tls import MESSAGE_BYTES_MAX
from georep.server.replicator import Replicator
from offsets.coordinates import LocalOffset, Origin
from tests.support.fake_upstream import replicator_of_b, serve_as_site_a
from tests.support.sites import Sites, check_invariants, converged, origin_batch, produce, until, wait_until

A = Origin("a", 1)  # type: ignore[arg-type]


def json_batch(records: int, seed: int = 0) -> bytes:
    """One uncompressed batch of JSON-like records of about 1 KiB, as a Kafka client produces them."""

    def order(i: int) -> dict[str, object]:
        items = [{"sku": f"SKU-{(i * 7 + k) % 1000:05d}", "qty": k + 1, "price_cents": 1999 + k} for k in range(12)]
        address = {"street": f"{i} Main Street", "city": "Springfield", "country": "US"}
        customer = f"customer-{(seed + i) % 97}"
        return {
            "order_id": seed * 1000 + i,
            "customer": customer,
            "status": "SHIPPED",
            "items": items,
            "address": address,
        }

    values = [json.dumps(order(i)).encode() for i in range(records)]
    return encode_batch([RecordInput(None, v, (), 1_700_000_000_000 + i) for i, v in enumerate(values)])


def test_json_like_batches_go_several_times_smaller_and_come_back_byte_for_byte() -> None:
    batches = json_batch(50) + json_batch(50, seed=1)
    stored, packed = wire.pack(batches)
    assert stored == b"" and len(packed) * 4 < len(batches), f"{len(batches)} -> {len(packed)}"
    assert wire.unpack(stored, packed, MESSAGE_BYTES_MAX) == batches


def test_chunks_that_would_not_shrink_go_as_stored() -> None:
    incompressible = os.urandom(64 * 1024)
    assert wire.pack(incompressible) == (incompressible, b"")
    small = json_batch(1)[: wire.WIRE_MIN_BYTES - 1]
    assert wire.pack(small) == (small, b"")
    assert wire.unpack(incompressible, b"", MESSAGE_BYTES_MAX) == incompressible


@pytest.mark.parametrize(
    ("batches", "batches_zstd", "says"),
    [
        (b"", zstandard.ZstdCompressor().compress(bytes(MESSAGE_BYTES_MAX + 1)), "decompress"),  # declares too much
        (b"", b"\x28\xb5\x2f\xfd garbage", "decompress"),
        (b"x", zstandard.ZstdCompressor().compress(b"y" * 4096), "both"),
    ],
    ids=["bomb", "garbage", "both forms"],
)
def test_a_hostile_compressed_chunk_is_refused(batches: bytes, batches_zstd: bytes, says: str) -> None:
    with pytest.raises(CorruptChunk, match=says):
        wire.unpack(batches, batches_zstd, MESSAGE_BYTES_MAX)


def test_a_frame_that_hides_its_size_and_inflates_past_the_limit_is_refused() -> None:
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    hidden = stream.compress(bytes(1 << 20)) + stream.flush()
    with pytest.raises(CorruptChunk, match="decompress"):
        wire.unpack(b"", hidden, limit_bytes=(1 << 20) - 1)
    assert len(wire.unpack(b"", hidden, limit_bytes=1 << 20)) == 1 << 20


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_two_sites_move_uncompressed_batches_compressed_and_hold_the_same_bytes(
    make_sites: Callable[..., Sites],
) -> None:
    """Records produced uncompressed (padded, so compressible) leave a compressed for the trip, and b holds them
    as a does. Planted: a destination that does not ask for it (``accept_zstd`` false) gets them as stored, and
    the wire bytes equal the batch bytes."""
    sites = make_sites(["a", "b"], [("a", "b")])
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="t", partitions=2))
    expected = asyncio.run(produce(sites.address("a"), "t", "a", 300, value_bytes=1000))
    wait_until("b holds a's records", lambda: converged(sites, ["a", "b"], "t", 300), 30)
    check_invariants(sites, ["a", "b"], "t", expected)
    metrics_a = sites.nodes["a"].metrics_address
    sent, wire_bytes = (
        metric(metrics_a, "georep_replication_sent_bytes_total"),
        metric(metrics_a, "georep_replication_sent_wire_bytes_total"),
    )
    assert sent > 300 * 1000 and wire_bytes * 3 < sent, f"{sent} batch bytes went as {wire_bytes}"


class BombingSiteA:
    """Site a with topic ``t``: its first stream carries a compression bomb; later ones, the batch compressed."""

    def __init__(self, batch: bytes) -> None:
        self.batch = batch
        self.streams = 0
        self.done = threading.Event()

    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse:
        entry = TopicEntry("t", 0, False, 1, (), Stamp(1_000, "a"))
        return pb.ListTopicsResponse(topics=[pb.TopicDescription(name="t", partitions=1, entry=entry_to_pb(entry))])

    def list_acls(self, request: bytes, context: Any) -> pb.ListAclsResponse:
        return pb.ListAclsResponse()

    def report_held(self, request: bytes, context: Any) -> pb.ReportHeldResponse:
        return pb.ReportHeldResponse()

    def replicate(self, request: bytes, context: Any) -> Iterator[pb.ReplicateResponse]:
        assert pb.ReplicateRequest.FromString(request).accept_zstd
        self.streams += 1
        vector = pb.VectorOffset(entries=[pb.OriginSeq(site="a", epoch=1, next_seq=2)])
        packed = zstandard.ZstdCompressor().compress(bytes(MESSAGE_BYTES_MAX + 1) if self.streams == 1 else self.batch)
        yield pb.ReplicateResponse()
        chunk = pb.ReplicaChunk(topic="t", partition=0, batches_zstd=packed, src_vector=vector, src_log_end_offset=2)
        yield pb.ReplicateResponse(chunks=[chunk])
        deadline = time.monotonic() + 10
        while context.is_active() and time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.05)


def test_an_upstreams_compression_bomb_ends_its_stream_and_nothing_of_it_is_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = BombingSiteA(origin_batch(A, 0, tag=b"real-"))
    server, topology, certs = serve_as_site_a(fake, tmp_path)

    async def main() -> None:
        r = replicator_of_b(tmp_path, topology, certs)
        r.start()
        try:
            await until("b holds a's records of t", lambda: _held(r) == {A: 2}, 30)
            data = r.broker.partition("t", 0).log.read(LocalOffset(0), 1 << 20).data
            assert b"real-" in data and len(data) == len(fake.batch), "b stores the batch the compressed chunk held"
            assert fake.streams >= 2
        finally:
            fake.done.set()
            await r.stop()
            r.broker.close()

    with caplog.at_level(logging.INFO):
        try:
            asyncio.run(main())
        finally:
            server.stop(0)
    assert any("does not decompress" in m for m in caplog.messages), caplog.messages


def _held(r: Replicator) -> dict[Origin, int]:
    p = r.broker.partitions.get(("t", 0))
    return {} if p is None else dict(p.log.vector())
