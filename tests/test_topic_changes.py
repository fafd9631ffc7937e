"""Topic alter and add-partitions on a one-node site (issue 23), in process: the replicated entry stored in
``topics.json`` (``georep/storage/metadata_file.py``), the merge through two real stores, and a change taking
effect on the node without a restart (``georep/server/topic_changes.py``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.node import NodeConfig
from cluster.placement import NodeLoad
from cluster.repair import SegmentView, under_replicated
from cluster.site_state import CreateTopic, MergeTopicEntry, RefusalCode, SiteState, command_from_dict
from georep.broker.errors import BatchTooLarge
from georep.metadata.kafka_config import InvalidConfig, alter_changes
from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry import add_partitions, alter, delete
from georep.metadata.topic_entry_codec import legacy_entry
from georep.metadata.topics import InvalidTopic, TopicSpec
from georep.server.broker import Broker
from georep.server.topic_changes import TopicChanges
from georep.storage.metadata_file import FileMetadataStore, load_or_create_identity
from tests.support.node_api import batch
from tests.support.site_state import applied, refused
from topology.ids import NodeId, SegmentId


def store_at(path: Path, site: str, clock: list[int]) -> FileMetadataStore:
    return FileMetadataStore(path, site, lambda: clock[0])


def test_a_topic_table_from_before_entries_reads_as_incarnation_0_and_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "topics.json"
    old = {"version": 1, "topics": {"orders": {"partitions": 3, "config": {"retention_ms": 5000}}}}
    path.write_text(json.dumps(old))
    store = store_at(path, "a", [1_000])
    assert store.entries()["orders"] == legacy_entry("orders", 3, {"retention_ms": 5000})
    assert store.get("orders") == TopicSpec("orders", 3, {"retention_ms": 5000})
    store.create_topic(TopicSpec("events", 1))
    written = json.loads(path.read_text())["topics"]
    # What a node from before entries reads of the table is still there, beside the entry's fields.
    assert written["orders"]["partitions"] == 3 and written["orders"]["config"] == {"retention_ms": 5000}
    assert written["events"]["incarnation"] == 0 and written["events"]["stamp"] == [1_000, "a"]
    assert store_at(path, "a", [0]).entries() == store.entries()


def test_alters_merged_through_two_real_stores_converge_and_a_concurrent_change_is_found(tmp_path: Path) -> None:
    clock = [1_000]
    a, b = store_at(tmp_path / "a.json", "a", clock), store_at(tmp_path / "b.json", "b", clock)
    a.create_topic(TopicSpec("orders", 2, {"retention_ms": 1}))
    b.merge_entries(list(a.entries().values()))
    clock[0] = 2_000
    a.merge_entries([alter(a.entries()["orders"], "orders", {"retention_ms": 111}, clock[0], "a")])
    clock[0] = 2_500  # b changes the key before it hears of a's change: concurrent
    b.merge_entries([alter(b.entries()["orders"], "orders", {"retention_ms": 222}, clock[0], "b")])
    [at_b] = b.merge_entries([a.entries()["orders"]])
    [at_a] = a.merge_entries([b.entries()["orders"]])
    assert [(c.kept.value, c.lost.value) for c in at_b.conflicts] == [(222, 111)]
    assert not at_a.conflicts  # b's joined register has seen both changes: found once, where they met
    assert a.get("orders").config == b.get("orders").config == {"retention_ms": 222}
    # Durable: both tables, read again from disk, hold the same entry.
    reread = [store_at(tmp_path / f"{s}.json", s, clock).entries()["orders"] for s in "ab"]
    assert reread[0] == reread[1] == a.entries()["orders"]
    # A tombstone replicates as an entry too: the topic is gone from the live table, its entry stays.
    b.merge_entries([delete(a.entries()["orders"], "orders", 3_000, "a")])
    assert "orders" not in b.topics() and b.entries()["orders"].deleted
    with pytest.raises(UnknownTopic):
        b.get("orders")


def test_alter_names_are_checked_as_kafka_names_or_georep_keys() -> None:
    assert alter_changes({"retention.ms": "10"}, ["segment.bytes"]) == {
        "retention_ms": 10,
        "segment_bytes_max": None,
    }
    with pytest.raises(InvalidConfig, match="no log compaction"):
        alter_changes({"cleanup.policy": "compact"}, [])
    with pytest.raises(InvalidConfig, match="unknown topic config"):
        alter_changes({}, ["bogus"])


def test_an_alter_and_a_growth_take_effect_on_the_node_without_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
        try:
            changes = TopicChanges(broker)
            broker.create_topic("orders", 1, {})
            big = batch(4, value_bytes=1500)
            await broker.produce("orders", 0, big)
            await changes.alter("orders", {"max_batch_bytes": 1024, "segment_bytes_max": 4096})
            with pytest.raises(BatchTooLarge):
                await broker.produce("orders", 0, big)
            assert broker.partition("orders", 0).log.config.segment_bytes_max == 4096  # type: ignore[attr-defined]
            await changes.alter("orders", {"max_batch_bytes": None})  # back to the default: taken again
            await broker.produce("orders", 0, big)
            with pytest.raises(InvalidTopic, match="only grows"):
                await changes.add_partitions("orders", 1)
            await changes.add_partitions("orders", 3)
            await broker.produce("orders", 2, batch(1))
            assert broker.topic("orders").partitions == 3 and broker.partition("orders", 2).log.log_end_offset == 1
        finally:
            broker.close()
        again = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))  # and after a restart, the same
        try:
            assert again.topic("orders").partitions == 3 and ("orders", 2) in again.partitions
            assert again.topic("orders").config == {"segment_bytes_max": 4096}
        finally:
            again.close()

    asyncio.run(scenario())


def test_a_tombstone_merged_here_stops_the_topic_and_tells_the_data_path_once(tmp_path: Path) -> None:
    """Delete's metadata half: the tombstone another site made is stored, the topic leaves the live table, the
    data path's hook hears of it once, and a create after it is the next incarnation."""

    async def scenario() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1))
        try:
            changes = TopicChanges(broker)
            told: list[tuple[str, int]] = []
            changes.on_deleted = lambda entry: told.append((entry.name, entry.incarnation))
            broker.create_topic("orders", 2, {})
            assert changes.incarnation_of("orders") == 0
            tombstone = delete(changes.held("orders"), "orders", broker.clock_ms() + 1, "a")
            changes.merge([tombstone])
            changes.merge([tombstone])  # again (a cycle of links): nothing more happens
            assert told == [("orders", 0)] and changes.incarnation_of("orders") is None
            with pytest.raises(UnknownTopic):
                broker.topic("orders")
            with pytest.raises(UnknownTopic):
                await changes.alter("orders", {"retention_ms": 1})
            # A create makes the next incarnation, in directories of its own: the old partitions' files, still there
            # (this test's data path leaves them), are never under it.
            broker.create_topic("orders", 1, {})
            assert changes.incarnation_of("orders") == 1 and broker.topic("orders").incarnation == 1
            assert (tmp_path / "logs" / "orders@1-0").is_dir() and (tmp_path / "logs" / "orders-0").is_dir()
            # The live incarnation 0 a late link still sends ranks below the tombstone: it changes nothing.
            [late] = changes.merge([replace(tombstone, deleted=False, partitions=4)])
            assert not late.changed and broker.topic("orders").partitions == 1
        finally:
            broker.close()

    asyncio.run(scenario())


def test_a_multi_node_sites_state_takes_entries_as_raft_commands() -> None:
    """``MergeTopicEntry`` (cluster/site_state.py): an alter changes the topic's config, a growth adds partitions
    with no leader (the controller places them as a create's), both survive a snapshot and the command's log
    form, a repeat changes nothing, and what the state cannot take is refused, not half-applied."""
    state = SiteState()
    applied(state, CreateTopic(TopicSpec("orders", 2, {"retention_ms": 5})))
    held = state.entries()["orders"]
    assert held == legacy_entry("orders", 2, {"retention_ms": 5})
    altered = alter(held, "orders", {"retention_ms": 7, "segment_bytes_max": 4096}, 1_000, "a")
    grown = add_partitions(altered, "orders", 4)
    for command in (MergeTopicEntry(altered), MergeTopicEntry(grown)):
        applied(state, command_from_dict(json.loads(json.dumps(command.to_dict()))))
    assert state.topic("orders") == TopicSpec("orders", 4, {"retention_ms": 7, "segment_bytes_max": 4096})
    new_partition = state.partition("orders", 3)
    assert new_partition is not None and new_partition.leader is None
    assert not applied(state, MergeTopicEntry(altered)).changed  # older than what is held: nothing
    assert SiteState.restore(json.loads(json.dumps(state.snapshot()))).entries() == state.entries()
    refused(state, MergeTopicEntry(legacy_entry("nowhere", 1, {})), RefusalCode.UNKNOWN_TOPIC)
    assert state.topic("orders") is not None and "nowhere" not in state.topics()
    applied(state, MergeTopicEntry(delete(grown, "orders", 2_000, "a")))  # tests/test_site_state_delete.py
    assert state.topic("orders") is None and state.entries()["orders"].deleted


def test_a_topics_replication_factor_sets_its_leads_ensembles_and_what_repair_wants() -> None:
    config = NodeConfig(3, 2, session_timeout_ms=1, tick_ms=1, retry_ms=1, roll_wait_ms=1)
    assert config.lead(TopicSpec("t", 1, {"replication_factor": 2})).replication_factor == 2
    assert config.lead(TopicSpec("t", 1, {"replication_factor": 1})).replication_factor == 2  # >= min_insync
    assert config.lead(TopicSpec("t", 1)).replication_factor == config.lead().replication_factor == 3
    nodes = [NodeLoad(NodeId(n), 1 << 30, 0, alive=True, draining=False) for n in (1, 2, 3)]
    pair = SegmentView("t", 0, SegmentId(1), (NodeId(1), NodeId(2)), True, 0, replication_factor=2)
    assert under_replicated([pair], nodes, replication_factor=3) == ()
    [short] = under_replicated([replace(pair, replication_factor=None)], nodes, replication_factor=3)
    assert short.wanted == 3
