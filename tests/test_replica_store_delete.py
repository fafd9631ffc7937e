"""A multi-node site's member after a topic delete (georep/storage/replica_store.py, "Incarnations"): the copies of
a deleted incarnation go, those of a live one stay, and a later incarnation's segment 0 is never the earlier's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from georep.metadata.topic_entry import create, delete
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.cluster_member import _newly_deleted
from georep.storage.replica_store import DELETED_REPLICAS_DIR, REPLICAS_DIR, ReplicaStore
from tests.support.channels import aio_channel
from tests.support.segments import read_all
from tests.test_ensemble import serve_member
from tests.test_replica_store import leader_log
from topology.ids import LeaderEpoch, SegmentId

KEY = ("orders", 0)
OTHER = ("kept", 0)
S0 = SegmentId(0)
E1, E5 = LeaderEpoch(1), LeaderEpoch(5)


def _written(store: ReplicaStore, key: tuple[str, int], batches: list[bytes], epoch: LeaderEpoch = E1) -> None:
    store.open_segment(key, epoch, S0, 0, {}, now_ms=0)
    for b in batches:
        store.append(key, epoch, S0, b)
    store.flush(key, S0)


def test_a_deleted_incarnations_copies_go_and_the_next_incarnation_starts_empty(tmp_path: Path) -> None:
    _, old = leader_log(tmp_path / "a", 4)
    _, new = leader_log(tmp_path / "b", 1)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    _written(store, KEY, old)
    _written(store, OTHER, old)
    store.lacs.announce(KEY, S0, 500)  # what incarnation 0's leader confirmed: none of it holds for incarnation 1
    live0 = create("orders", 1, {}, None, 1_000, "a")
    tombstone = delete(live0, "orders", 2_000, "a")
    # Incarnation 1 is live in the node's view before the removal pass ran: its leader's open must not find the
    # deleted incarnation's segment 0 (opening an existing copy again changes nothing, so it would have been kept).
    store.incarnation_of = lambda topic: 1 if topic == "orders" else 0
    _written(store, KEY, new, E5)
    copy = store.copy(KEY, S0)
    assert copy is not None and read_all(copy) == new  # not one record of incarnation 0
    assert store.lacs.get(KEY, S0) is None  # a follower serves nothing of it until its own leader confirms it
    replicas = tmp_path / "node" / REPLICAS_DIR
    assert sorted(p.name for p in replicas.iterdir()) == ["kept-0", "orders@1-0"]
    entries = {"orders": create("orders", 1, {}, tombstone, 3_000, "a"), "kept": create("kept", 1, {}, None, 0, "a")}
    assert store.remove_deleted(entries) == []  # nothing of a live incarnation, nor of another topic
    store.close()


def test_a_node_down_during_the_delete_removes_its_copies_at_start(tmp_path: Path) -> None:
    _, batches = leader_log(tmp_path / "a", 3)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    _written(store, KEY, batches)
    _written(store, OTHER, batches)
    store.close()
    # A removal a crash interrupted: a copy already moved out, left in deleted-replicas/.
    moved = tmp_path / "node" / DELETED_REPLICAS_DIR / "orders-1.0.abcd"
    moved.mkdir(parents=True)
    (moved / "leftover").write_bytes(b"x")
    reopened = ReplicaStore(tmp_path / "node", now_ms=0)
    assert not moved.exists()
    tombstone = delete(create("orders", 1, {}, None, 1_000, "a"), "orders", 2_000, "a")
    assert reopened.remove_deleted({"orders": tombstone}) == ["orders-0"]  # "kept": not in the entries, kept
    assert reopened.partitions() == [OTHER] and reopened.segment_ids(KEY) == []
    assert sorted(p.name for p in (tmp_path / "node" / REPLICAS_DIR).iterdir()) == ["kept-0"]
    kept = reopened.copy(OTHER, S0)
    assert kept is not None and read_all(kept) == batches
    reopened.close()


def test_a_member_refuses_calls_about_an_incarnation_its_view_does_not_hold_live(tmp_path: Path) -> None:
    """The Segments service (georep/server/segment_refs.py): a member still holding incarnation 0's copies while
    its view holds incarnation 1 refuses a late call of incarnation 0's leader or repair, serves incarnation 1's
    calls from empty copies (the old ones moved out first), lists only incarnation 1's, and once its view holds the
    topic deleted refuses every call about it."""
    _, old = leader_log(tmp_path / "a", 3)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    _written(store, KEY, old)
    view: dict[str, int | None] = {"orders": 1}
    store.incarnation_of = lambda topic: view.get(topic, 0)

    async def scenario() -> None:
        with ThreadPoolExecutor(2) as executor:
            server, address = await serve_member(store, executor)
            try:
                async with aio_channel(address) as channel:
                    stub = pbg.SegmentsStub(channel)

                    async def read(incarnation: int) -> bytes:
                        ref = pb.SegmentRef(topic=KEY[0], partition=KEY[1], segment_id=S0, incarnation=incarnation)
                        request = pb.ReadSegmentRequest(segment=ref, offset=0)
                        return b"".join([r.batches async for r in stub.ReadSegment(request)])

                    fence = pb.FenceSegmentsRequest(topic=KEY[0], partition=KEY[1], leader_epoch=9, incarnation=0)
                    calls: list[Callable[[], Awaitable[object]]] = [lambda: stub.FenceSegments(fence), lambda: read(0)]
                    for call in calls:
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await call()
                        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                        assert "holds as incarnation 1" in (refused.value.details() or "")
                    assert store.held() == []  # incarnation 0's copy is not listed to repair as this one's
                    await stub.FenceSegments(pb.FenceSegmentsRequest(**{**_fields(fence), "incarnation": 1}))
                    with pytest.raises(grpc.aio.AioRpcError) as unknown:
                        await read(1)  # the copy of incarnation 0 was moved out: nothing of it is read
                    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                    view["orders"] = None  # deleted in this member's view
                    with pytest.raises(grpc.aio.AioRpcError) as deleted:
                        await read(1)
                    assert "holds as deleted" in (deleted.value.details() or "")
            finally:
                await server.stop(None)

    asyncio.run(scenario())
    assert sorted(p.name for p in (tmp_path / "node" / REPLICAS_DIR).iterdir()) == ["orders@1-0"]
    store.close()


def _fields(request: pb.FenceSegmentsRequest) -> dict[str, object]:
    return {f.name: v for f, v in request.ListFields()}


def test_a_member_forgets_a_topics_metrics_series_once_per_delete() -> None:
    """``_newly_deleted``: the deletes a member's pass finds new, whose ``georep_produced_*`` series go (as a one-node
    site's ``TopicRemoval`` drops them); a re-create after a delete already seen keeps counting."""
    tombstone = (("orders", 0, True),)
    assert _newly_deleted((), tombstone) == ["orders"]
    assert _newly_deleted(tombstone, tombstone) == []
    assert _newly_deleted(tombstone, (("orders", 1, False),)) == []  # re-created: the delete was seen
    assert _newly_deleted((("orders", 1, False),), (("orders", 2, False),)) == ["orders"]  # deleted and re-created
    assert _newly_deleted((("orders", 1, False),), (("orders", 1, True),)) == ["orders"]
