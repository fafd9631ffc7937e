"""Topic delete's data path on a one-node site (issue 23), in process: the removal of a deleted incarnation's
partitions (``georep/server/topic_removal.py``), its end at start-up after a crash between the steps
(``georep/storage/deleted_dirs.py``), and a re-created topic in its own directories (incarnation 1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry import create, delete
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_to_proto
from georep.server.broker import Broker
from georep.server.groups import GroupService
from georep.server.late_records import log_records_taken_after
from georep.server.metrics import NodeMetrics
from georep.server.topic_changes import TopicChanges
from georep.server.topic_removal import TopicRemoval
from georep.storage.api import PartitionLog, SegmentBatches
from georep.storage.deleted_dirs import DELETED_DIR, move_to_deleted
from georep.storage.metadata_file import load_or_create_identity
from offsets.coordinates import Origin
from offsets.hlc import HlcStamp
from offsets.vector import VectorOffset
from tests.support.node_api import batch
from topology.ids import SiteId


def broker_at(data_dir: Path) -> Broker:
    return Broker(data_dir, load_or_create_identity(data_dir, "b", 1))


def partition_dirs(data_dir: Path) -> list[str]:
    return sorted(d.name for d in (data_dir / "logs").iterdir() if d.is_dir())


def leftovers(data_dir: Path) -> list[str]:
    deleted = data_dir / DELETED_DIR
    return sorted(d.name for d in deleted.iterdir()) if deleted.is_dir() else []


async def orders_with_records(broker: Broker) -> TopicChanges:
    changes = TopicChanges(broker)
    broker.create_topic("orders", 2, {})
    broker.create_topic("events", 1, {})
    for index in (0, 1):
        await broker.produce("orders", index, batch(3))
    return changes


def test_a_delete_stops_the_topic_removes_its_files_and_a_re_create_starts_empty(tmp_path: Path) -> None:
    async def scenario() -> None:
        broker = broker_at(tmp_path)
        try:
            metrics = NodeMetrics(broker)
            changes = await orders_with_records(broker)
            removal = TopicRemoval(broker, metrics.forget_topic)
            changes.on_deleted = removal
            assert metrics.registry.get_sample_value("georep_produced_records_total", {"topic": "orders"}) == 6
            assert partition_dirs(tmp_path) == ["events-0", "orders-0", "orders-1"]
            changes.merge([delete(changes.held("orders"), "orders", broker.clock_ms() + 1, "a")])
            with pytest.raises(UnknownTopic, match="was deleted \\(at site a\\)"):
                broker.partition("orders", 0)
            assert not [key for key in broker.partitions if key[0] == "orders"]
            concurrent.futures.wait(removal.pending)
            assert metrics.registry.get_sample_value("georep_produced_records_total", {"topic": "orders"}) is None
            assert partition_dirs(tmp_path) == ["events-0"] and leftovers(tmp_path) == []
            # Re-created: incarnation 1, in its own directory, with none of incarnation 0's records.
            broker.create_topic("orders", 1, {})
            assert broker.topic("orders").incarnation == 1
            assert partition_dirs(tmp_path) == ["events-0", "orders@1-0"]
            assert broker.partition("orders", 0).log.log_end_offset == 0
            await broker.produce("orders", 0, batch(2))
        finally:
            broker.close()
        again = broker_at(tmp_path)  # and after a restart, the same
        try:
            assert again.topic("orders").incarnation == 1 and again.partition("orders", 0).log.log_end_offset == 2
            assert partition_dirs(tmp_path) == ["events-0", "orders@1-0"]
        finally:
            again.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("crash", ["after the tombstone", "after one rename", "after the renames"])
def test_a_delete_a_crash_interrupted_is_finished_at_start(tmp_path: Path, crash: str) -> None:
    """The node stops between the steps of a delete (the removal planted to stop there): the next start removes
    every directory of the deleted incarnation, whatever its files hold, and serves nothing of it."""

    async def scenario() -> None:
        broker = broker_at(tmp_path)
        try:
            changes = await orders_with_records(broker)
            changes.on_deleted = lambda entry: None  # the node stops before its removal starts
            changes.merge([delete(changes.held("orders"), "orders", broker.clock_ms() + 1, "a")])
            logs, deleted = tmp_path / "logs", tmp_path / DELETED_DIR
            if crash == "after one rename":
                move_to_deleted(logs, deleted, ["orders-1"], 0)
            elif crash == "after the renames":
                move_to_deleted(logs, deleted, ["orders-0", "orders-1"], 0)
        finally:
            broker.close()
        assert leftovers(tmp_path) or "orders-0" in partition_dirs(tmp_path)  # what the crash left
        again = broker_at(tmp_path)
        try:
            assert partition_dirs(tmp_path) == ["events-0"] and leftovers(tmp_path) == []
            with pytest.raises(UnknownTopic, match="was deleted"):
                again.partition("orders", 0)
            again.create_topic("orders", 2, {})  # no longer refused: nothing of incarnation 0 is left
            assert [again.partition("orders", i).log.log_end_offset for i in (0, 1)] == [0, 0]
        finally:
            again.close()

    asyncio.run(scenario())


def test_a_re_created_topic_has_no_committed_position_even_when_an_old_commit_arrives_late(tmp_path: Path) -> None:
    """Groups: a commit of the deleted incarnation is no position in the topic created again, whether it was
    folded before the delete or arrives afterwards with a later stamp (a site that had not heard of the delete)."""

    async def scenario() -> None:
        broker = broker_at(tmp_path)
        try:
            groups = GroupService(broker)
            changes = await orders_with_records(broker)
            changes.on_deleted = TopicRemoval(broker)
            have = VectorOffset({Origin(SiteId("b"), 1): 3})
            commit = pb.CommitOffsetsRequest(
                group="g",
                generation=-1,
                commits=[pb.PartitionCommit(topic="orders", partition=0, vector=vector_to_proto(have), hint_offset=-1)],
            )
            await groups.commit(commit)
            asked = pb.FetchCommittedRequest(group="g")
            assert [c.topic for c in (await groups.fetch_committed(asked)).offsets] == ["orders"]
            changes.merge([delete(changes.held("orders"), "orders", broker.clock_ms() + 1, "a")])
            broker.create_topic("orders", 1, {})
            assert list((await groups.fetch_committed(asked)).offsets) == []
            # A late commit of incarnation 0, stamped after the re-create, still is no position in incarnation 1.
            [old] = groups.table.of_group("g")
            groups.table.apply(replace(old, hlc=HlcStamp(old.hlc + (10_000 << 16))))
            assert list((await groups.fetch_committed(asked)).offsets) == []
            await groups.commit(commit)  # a commit now: of incarnation 1, which any of incarnation 0 never beats
            [new] = (await groups.fetch_committed(asked)).offsets
            assert groups.table.get("g", "orders", 0) is not None
            assert groups.table.get("g", "orders", 0).incarnation == 1  # type: ignore[union-attr]
            assert not groups.table.apply(replace(old, hlc=HlcStamp(new.hlc + (10_000 << 16))))
        finally:
            broker.close()

    asyncio.run(scenario())


def test_a_site_that_hears_of_the_re_create_before_the_delete_takes_both(tmp_path: Path) -> None:
    """b holds incarnation 0 live and a topic sync brings incarnation 1 (a deleted and re-created the topic before
    b synced): b removes incarnation 0's files and serves incarnation 1, empty, in its own directories."""

    async def scenario() -> None:
        broker = broker_at(tmp_path)
        try:
            changes = await orders_with_records(broker)
            removal = TopicRemoval(broker)
            changes.on_deleted = removal
            tombstone = delete(changes.held("orders"), "orders", broker.clock_ms() + 1, "a")
            changes.merge([create("orders", 3, {}, tombstone, broker.clock_ms() + 2, "a")])
            assert broker.topic("orders").incarnation == 1
            assert [broker.partition("orders", i).log.log_end_offset for i in range(3)] == [0, 0, 0]
            await broker.produce("orders", 2, batch(1))
            concurrent.futures.wait(removal.pending)
            assert partition_dirs(tmp_path) == ["events-0", "orders@1-0", "orders@1-1", "orders@1-2"]
        finally:
            broker.close()

    asyncio.run(scenario())


class CountedReads:
    """A partition log that counts the segments read through it (the count's bound)."""

    def __init__(self, log: PartitionLog) -> None:
        self.log = log
        self.segments_read = 0
        self.log_start_offset = log.log_start_offset
        self.log_end_offset = log.log_end_offset

    def segment_at(self, offset: int) -> SegmentBatches:
        self.segments_read += 1
        return self.log.segment_at(offset)


def test_a_delete_counts_the_records_this_site_took_after_it_naming_the_deleting_site(tmp_path: Path) -> None:
    """b takes produces into orders before and after the moment a deletes it (b has not heard of the delete yet):
    when the tombstone arrives, b counts the records removed that it took after the delete, per deleting site,
    reading only the segments that can hold one."""
    clock = [1_000_000]

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1), clock_ms=lambda: clock[0])
        try:
            metrics = NodeMetrics(broker)
            broker.create_topic("orders", 2, {"segment_bytes_max": "1024"})
            for _ in range(12):  # several segments, all taken before the delete
                clock[0] += 1
                await broker.produce("orders", 0, batch(3, value_bytes=60))
            first = broker.partition("orders", 0).log
            assert first.segment_count >= 4
            deleted_at = clock[0]  # a deletes now; b takes more, one batch at the delete's very ms
            await broker.produce("orders", 1, batch(1))
            clock[0] += 1
            await broker.produce("orders", 0, batch(2))
            await broker.produce("orders", 1, batch(4))
            counted = CountedReads(first)
            assert log_records_taken_after(cast(PartitionLog, counted), deleted_at) == 2
            assert counted.segments_read <= 2
            changes = TopicChanges(broker)
            removal = TopicRemoval(broker, metrics.forget_topic, metrics.delete_records)
            changes.on_deleted = removal
            changes.merge([delete(changes.held("orders"), "orders", deleted_at, "a")])
            concurrent.futures.wait(removal.pending)
            assert metrics.registry.get_sample_value("georep_topic_delete_records_total", {"site": "a"}) == 6
            assert partition_dirs(tmp_path) == []
        finally:
            broker.close()

    asyncio.run(scenario())
