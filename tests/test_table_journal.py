"""The topic table's journal (``georep/storage/table_journal.py``): a create appends its rows instead of rewriting
the table, and what a crash, a torn write, a full disk or damage leaves is read back as the acknowledged table or
refused with what to do."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from georep.metadata.store import AclRecord
from georep.metadata.topic_entry import delete
from georep.metadata.topics import TopicSpec
from georep.storage import table_journal
from georep.storage.metadata_file import FileMetadataStore, MetadataFileDamaged
from tests.support.examples import examples


def store_at(path: Path) -> FileMetadataStore:
    return FileMetadataStore(path, "a", lambda: 1_000)


def journals(path: Path) -> list[Path]:
    return sorted(path.parent.glob("topics.*.journal"))


def create(store: FileMetadataStore, *names: str) -> None:
    store.create_topics([TopicSpec(n, 1) for n in names])


def test_creates_append_their_rows_and_the_table_is_written_whole_only_when_the_journal_outgrows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 topics created ten at a time: the table is written whole a few times, not once per create (planted:
    a store that ignores its journal on load loses every topic created after the last compaction)."""
    monkeypatch.setattr(table_journal, "MIN_COMPACT_BYTES", 20_000)
    path = tmp_path / "topics.json"
    store = store_at(path)
    compactions = []
    real_begin = table_journal.TableJournal.begin

    def counting_begin(journal: table_journal.TableJournal) -> int:
        compactions.append(journal.generation)
        return real_begin(journal)

    monkeypatch.setattr(table_journal.TableJournal, "begin", counting_begin)
    for i in range(0, 1000, 10):
        create(store, *(f"t/{j}" for j in range(i, i + 10)))
    assert 2 <= len(compactions) <= 10, compactions  # 100 creates; a rewrite whenever the journal outgrew the table
    assert len(journals(path)) == 1
    snapshot = json.loads(path.read_text())
    assert len(snapshot["topics"]) < 1000  # the newest creates are in the journal only
    again = store_at(path)
    assert again.entries() == store.entries() and len(again.topics()) == 1000


def test_a_torn_last_change_is_cut_off_and_the_next_appends_follow_it(tmp_path: Path) -> None:
    path = tmp_path / "topics.json"
    store = store_at(path)
    create(store, "one")
    create(store, "two")
    [journal] = journals(path)
    whole = journal.read_bytes()
    with open(journal, "ab") as f:
        f.write(b'deadbeef {"topics": {"three"')  # a change whose write never finished: never acknowledged
    again = store_at(path)
    assert set(again.topics()) == {"one", "two"}
    assert journal.read_bytes() == whole
    create(again, "four")
    assert set(store_at(path).topics()) == {"one", "two", "four"}


@pytest.mark.parametrize("line", [1, 2])
def test_damage_before_the_last_line_is_refused_naming_the_journal_and_what_to_do(tmp_path: Path, line: int) -> None:
    path = tmp_path / "topics.json"
    store = store_at(path)
    for name in ("one", "two", "three"):
        create(store, name)
    [journal] = journals(path)
    lines = journal.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1].replace(b'"', b"'", 1)  # a changed byte in the header, or in a change
    journal.write_bytes(b"\n".join(lines))
    with pytest.raises(MetadataFileDamaged, match=rf"{journal.name}.*Restore them from a backup"):
        store_at(path)


def test_a_missing_journal_is_refused_and_a_stale_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "topics.json"
    store = store_at(path)
    create(store, "one")
    [journal] = journals(path)
    stale = journal.with_name("topics.0.journal")  # what a crash during a compaction leaves: an older generation
    stale.write_bytes(table_journal.encode_line({"generation": 0}) + table_journal.encode_line({"topics": {}}))
    assert set(store_at(path).topics()) == {"one"}
    journal.unlink()
    with pytest.raises(MetadataFileDamaged, match="is missing"):
        store_at(path)


def test_a_crash_between_the_new_journal_and_the_snapshot_keeps_the_old_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction: the new journal, then the snapshot that names it. If the snapshot is never written, the old
    snapshot and its journal are still whole; the next compaction takes a generation above the orphan's."""
    path = tmp_path / "topics.json"
    store = store_at(path)
    create(store, "one")
    create(store, "two")  # appended
    monkeypatch.setattr(
        "georep.storage.metadata_file.replace_file", lambda p, d: (_ for _ in ()).throw(OSError(errno.EIO, "crash"))
    )
    with pytest.raises(OSError):
        store.put_acl(AclRecord("User:x|topic|t|read", True, 1, "a"))
    monkeypatch.undo()
    again = store_at(path)
    assert set(again.topics()) == {"one", "two"} and again.acls() == {}
    generations = [int(p.name.split(".")[1]) for p in journals(path)]
    assert generations == [1, 2]  # the snapshot's and the orphan begun for the crashed compaction
    again.put_acl(AclRecord("User:x|topic|t|read", True, 1, "a"))
    assert [p.name for p in journals(path)] == ["topics.3.journal"]
    assert set(store_at(path).acls()) == {"User:x|topic|t|read"}


def test_a_full_disk_fails_the_create_leaves_nothing_of_it_and_the_next_create_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "topics.json"
    store = store_at(path)
    create(store, "one")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(OSError, match="No space"):
        create(store, "two")
    monkeypatch.undo()
    assert set(store.topics()) == {"one"} and set(store_at(path).topics()) == {"one"}
    create(store, "three")  # compacts: the journal it failed to append to is not appended to again
    assert set(store_at(path).topics()) == {"one", "three"}


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True)),
        st.tuples(st.just("delete"), st.integers(0, 40)),
        st.tuples(st.just("acl"), st.integers(0, 3)),
    ),
    max_size=30,
)


@settings(max_examples=examples(60), deadline=None)
@given(ops=OPS, torn=st.integers(1, 40), min_compact=st.sampled_from([200, 2_000, 1 << 20]))
def test_the_table_read_back_is_every_acknowledged_change_and_a_torn_tail_loses_only_the_last(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, Any]], torn: int, min_compact: int
) -> None:
    """Any sequence of creates, deletes (merged tombstones) and ACL changes, through compactions at any size, reads
    back as the table in memory. Then a last change torn at any byte reads back as the table before it."""
    path = tmp_path_factory.mktemp("journal") / "topics.json"
    original = table_journal.MIN_COMPACT_BYTES
    table_journal.MIN_COMPACT_BYTES = min_compact
    try:
        store = store_at(path)
        for op, arg in ops:
            if op == "create":
                names = [f"t{i}" for i in arg if f"t{i}" not in store.topics()]
                if names:
                    create(store, *names)
            elif op == "delete" and f"t{arg}" in store.topics():
                store.merge_entries([delete(store.entries()[f"t{arg}"], f"t{arg}", 2_000, "b")])
            elif op == "acl":
                store.put_acl(AclRecord(f"User:u{arg}|topic|t|read", True, len(ops), "a"))
        assert store_at(path).entries() == store.entries() and store_at(path).acls() == store.acls()
        before, generation = dict(store.entries()), store._journal.generation
        create(store, "last/one", "last/two")
        if store._journal.generation == generation:  # appended, not compacted: tear it at any byte of its line
            [journal] = journals(path)
            data = journal.read_bytes()
            last = len(data.rstrip(b"\n").rsplit(b"\n", 1)[-1]) + 1
            os.truncate(journal, len(data) - min(torn, last))
            assert store_at(path).entries() == before
    finally:
        table_journal.MIN_COMPACT_BYTES = original
