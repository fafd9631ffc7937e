"""The fsynced Raft journal (georep/raft/journal.py) on its own: what is on disk after each call, what a crash
leaves, what damage does, and the upgrade from pysyncobj's journal."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from pysyncobj.journal import FileJournal

from cluster.site_state import CreateTopic
from georep.metadata.topics import TopicSpec
from georep.raft.journal import (
    HEADER,
    JOURNAL_FILE,
    META_FILE,
    PYSYNCOBJ_JOURNAL_FILE,
    DurableJournal,
    JournalDamaged,
    JournalFailed,
)
from georep.raft.store import RaftMetadataStore, RaftStartError
from tests.support.ports import free_ports
from tests.support.raft import FAST, ok, wait_until


def entries(n: int, start: int = 1, term: int = 1) -> list[tuple[bytes, int, int]]:
    return [(f"command {i}".encode() * (1 + i % 5), i, term) for i in range(start, start + n)]


def filled(directory: Path, n: int) -> DurableJournal:
    directory.mkdir(exist_ok=True)
    journal = DurableJournal(directory)
    for entry in entries(n):
        journal.add(*entry)
    journal.sync()
    return journal


def reopened(journal: DurableJournal, directory: Path) -> list[tuple[bytes, int, int]]:
    journal._destroy()
    again = DurableJournal(directory)
    try:
        return list(again[:])
    finally:
        again._destroy()


def test_synced_entries_and_the_term_and_vote_are_there_after_a_restart(tmp_path: Path) -> None:
    journal = filled(tmp_path, 10)
    journal.setCurrentTerm(3, "127.0.0.1:7")
    journal.setRaftCommitIndex(8)
    journal.onOneSecondTimer()
    assert reopened(journal, tmp_path) == entries(10)
    again = DurableJournal(tmp_path)
    assert (again.getCurrentTerm(), again.getVotedForNodeId(), again.getRaftCommitIndex()) == (3, "127.0.0.1:7", 8)
    again._destroy()
    assert (tmp_path / JOURNAL_FILE).stat().st_mode & 0o077 == 0


def test_an_entry_reaches_the_file_only_at_a_sync(tmp_path: Path) -> None:
    journal = filled(tmp_path, 3)
    size = (tmp_path / JOURNAL_FILE).stat().st_size
    journal.add(b"not synced", 4, 1)
    assert (tmp_path / JOURNAL_FILE).stat().st_size == size  # a crash now loses it: nobody was told about it
    crashed = DurableJournal(tmp_path)  # what a restart after a crash reads
    assert list(crashed[:]) == entries(3)
    crashed._destroy()
    journal.sync()
    assert reopened(journal, tmp_path)[-1] == (b"not synced", 4, 1)


def test_a_torn_tail_is_cut_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = filled(tmp_path, 5)
    journal._destroy()
    path = tmp_path / JOURNAL_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the last record half written
    with caplog.at_level(logging.WARNING):
        again = DurableJournal(tmp_path)
    assert list(again[:]) == entries(4)
    assert "do not check" in caplog.text and "never acknowledged" in caplog.text
    again.add(*entries(1, start=5)[0])
    assert reopened(again, tmp_path) == entries(5)


def test_a_damaged_record_that_was_synced_refuses_the_start(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    for entry in entries(5):  # one sync per entry: each later record says the file was synced past the earlier ones
        journal.add(*entry)
        journal.sync()
    journal._destroy()
    path = tmp_path / JOURNAL_FILE
    data = bytearray(path.read_bytes())
    data[len(HEADER) + 20] ^= 0xFF  # in the first record
    path.write_bytes(bytes(data))
    with pytest.raises(JournalDamaged, match=f"{path} is damaged: the record at byte {len(HEADER)} does not check"):
        DurableJournal(tmp_path)
    raft_dir = tmp_path / "node" / "raft"
    raft_dir.mkdir(parents=True)
    (raft_dir / JOURNAL_FILE).write_bytes(bytes(data))
    with pytest.raises(RaftStartError, match=r"move .*raft away and start it again"):
        RaftMetadataStore("127.0.0.1:1", [], tmp_path / "node", FAST)


def test_a_truncation_is_durable_at_once_and_appends_follow_it(tmp_path: Path) -> None:
    journal = filled(tmp_path, 6)
    journal.deleteEntriesFrom(3)  # a follower's conflicting suffix: entries 4..6 go
    filled(tmp_path / "three", 3)._destroy()
    assert (tmp_path / JOURNAL_FILE).read_bytes() == (tmp_path / "three" / JOURNAL_FILE).read_bytes()
    journal.add(b"new 4", 4, 2)
    journal.sync()
    assert reopened(journal, tmp_path) == [*entries(3), (b"new 4", 4, 2)]


def test_a_truncation_of_unwritten_entries_only_drops_them(tmp_path: Path) -> None:
    journal = filled(tmp_path, 2)
    journal.add(b"a", 3, 1)
    journal.add(b"b", 4, 1)
    journal.deleteEntriesFrom(3)
    journal.add(b"c", 4, 2)
    journal.sync()
    assert reopened(journal, tmp_path) == [*entries(2), (b"a", 3, 1), (b"c", 4, 2)]


def test_a_compaction_keeps_the_entries_after_it(tmp_path: Path) -> None:
    journal = filled(tmp_path, 8)
    journal.add(b"pending", 9, 1)
    journal.deleteEntriesTo(5)
    assert [e[1] for e in journal[:]] == [6, 7, 8, 9]
    journal.add(b"after", 10, 1)
    journal.sync()
    assert reopened(journal, tmp_path) == [*entries(3, start=6), (b"pending", 9, 1), (b"after", 10, 1)]


def test_clear_empties_it_on_disk(tmp_path: Path) -> None:
    journal = filled(tmp_path, 4)
    journal.clear()
    assert len(journal) == 0 and (tmp_path / JOURNAL_FILE).read_bytes() == HEADER
    journal.add(b"x", 7, 2)
    journal.sync()
    assert reopened(journal, tmp_path) == [(b"x", 7, 2)]


def test_a_failed_fdatasync_stops_every_later_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = filled(tmp_path, 1)
    journal.add(b"y", 2, 1)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with caplog.at_level(logging.CRITICAL), pytest.raises(JournalFailed, match="Input/output error"):
        journal.sync()
    assert "stops taking part in its site's metadata" in caplog.text
    monkeypatch.undo()
    journal.add(b"z", 3, 1)
    with pytest.raises(JournalFailed):  # a retried fsync may say yes about data the kernel dropped: never trust it
        journal.sync()
    journal._destroy()


def test_pysyncobj_journal_of_an_older_georep_is_taken_over(tmp_path: Path) -> None:
    old = FileJournal(str(tmp_path / PYSYNCOBJ_JOURNAL_FILE))
    for entry in entries(12):
        old.add(*entry)
    old.deleteEntriesFrom(10)  # pysyncobj's own truncation, left in its file
    old.setCurrentTerm(4, "127.0.0.1:9")
    old.setRaftCommitIndex(9)
    old.onOneSecondTimer()
    old._destroy()
    journal = DurableJournal(tmp_path)
    assert list(journal[:]) == entries(10)
    meta = (journal.getCurrentTerm(), journal.getVotedForNodeId(), journal.getRaftCommitIndex())
    assert meta == (4, "127.0.0.1:9", 9)
    assert not (tmp_path / PYSYNCOBJ_JOURNAL_FILE).exists()
    assert not (tmp_path / (PYSYNCOBJ_JOURNAL_FILE + ".meta")).exists()
    assert json.loads((tmp_path / META_FILE).read_text())["term"] == 4
    journal._destroy()


def test_a_node_of_an_older_georep_keeps_its_metadata_when_it_starts_with_this_journal(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    old = RaftMetadataStore(address, [], tmp_path, FAST, journal_sync=False)  # pysyncobj's journal, as before
    try:
        wait_until(lambda: old.is_leader, "the one node leads")
        for n in range(5):
            ok(old.propose(CreateTopic(TopicSpec(f"t{n}", 1))))
    finally:
        old.close(snapshot=False)  # no dump: the journal alone holds the commands
    assert (tmp_path / "raft" / PYSYNCOBJ_JOURNAL_FILE).exists()
    with RaftMetadataStore(address, [], tmp_path, FAST) as new:
        wait_until(lambda: sorted(new.topics()) == [f"t{n}" for n in range(5)], "it applies the old journal")
        assert not (tmp_path / "raft" / PYSYNCOBJ_JOURNAL_FILE).exists()
        ok(new.propose(CreateTopic(TopicSpec("after", 1))))
    with pytest.raises(RaftStartError, match="fsynced journal"):
        RaftMetadataStore(address, [], tmp_path, FAST, journal_sync=False)
