"""Costs that grew with the topic count at 20,000 topics (issue 25, bench/first_use.py --py-spy): a create of many
topics at a one-node site syncs the file system once, not each new partition directory (fsyncs of new directories
were most of a topic's create at b and c), and a failed sync creates none of them; a group's partition counts read
one topic each."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import georep.server.broker as broker_module
import georep.storage.durable_file as durable_file
import georep.storage.segment_log as segment_log
from georep.broker.errors import WriteFailed
from georep.metadata.store import SiteIdentity
from georep.server.broker import Broker
from topology.ids import site_id


def new_broker(data_dir: Path) -> Broker:
    return Broker(data_dir, SiteIdentity(site_id("a"), 1))


def test_a_create_of_200_topics_syncs_once_and_fsyncs_no_new_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = new_broker(tmp_path)
    fsyncs: list[Path] = []
    syncs: list[Path] = []
    real_fsync, real_sync = durable_file.fsync_directory, segment_log.sync_filesystem

    def fsync(directory: Path) -> None:
        fsyncs.append(directory)
        real_fsync(directory)

    def sync(directory: Path) -> None:
        syncs.append(directory)
        real_sync(directory)

    monkeypatch.setattr(segment_log, "fsync_directory", fsync)
    monkeypatch.setattr(broker_module, "sync_filesystem", sync)
    outcomes = broker.create_topics([(f"t{i}", 2, {}) for i in range(200)])
    assert not [o for o in outcomes if isinstance(o, Exception)]
    assert fsyncs == [] and syncs == [tmp_path / "logs"]
    broker.close()
    again = new_broker(tmp_path)  # the logs open again as they were made
    assert len(again.metadata.topics()) == 200 and len(again.partitions) == 400
    again.close()


def test_a_failed_sync_creates_none_of_the_topics_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = new_broker(tmp_path)

    def fails(directory: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(broker_module, "sync_filesystem", fails)
    outcomes = broker.create_topics([(f"t{i}", 2, {}) for i in range(5)])
    assert all(isinstance(o, WriteFailed) and "Input/output error" in str(o) for o in outcomes), outcomes
    assert broker.metadata.topics() == {} and not broker.partitions
    assert list((tmp_path / "logs").glob("t*")) == [] and list((tmp_path / "creating").iterdir()) == []
    monkeypatch.undo()
    assert not [o for o in broker.create_topics([("t0", 2, {})]) if isinstance(o, Exception)]  # made again
    broker.close()


def test_a_groups_partition_counts_read_one_topic_each_not_a_copy_of_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's expiry check asks the count of each subscribed topic every tick: each answer is one lookup.
    Once each copied the whole table (200 topics at a site of 20,000: 4 million entries a second, 44% of c's
    samples while a subscription began in bench/first_use.py --py-spy)."""
    from georep.server.groups import GroupService
    from georep.storage.metadata_file import FileMetadataStore

    broker = new_broker(tmp_path)
    broker.create_topics([(f"t{i}", 3, {}) for i in range(50)])
    groups = GroupService(broker)

    def no_copies(self: FileMetadataStore) -> None:
        raise AssertionError("the whole topic table copied for one topic's count")

    monkeypatch.setattr(FileMetadataStore, "topics", no_copies)
    assert [groups._partition_count(f"t{i}") for i in (0, 49)] == [3, 3]
    assert groups._partition_count("missing") == 0 and groups._partition_count("__georep_offsets") == 0
    broker.close()
