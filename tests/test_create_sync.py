"""A create of many topics at a one-node site syncs the file system once, not each new partition directory (issue
25: fsyncs of new directories were most of a topic's create at b and c while 20,000 topics arrived), and a failed
sync creates none of them."""

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
