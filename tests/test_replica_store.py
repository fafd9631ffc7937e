"""A node's copies of segments (georep/storage/replica_store.py): byte-for-byte copies, the guard on disk,
seal-then-cut, and what survives a kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.quorum import Fenced, NotContiguous, SegmentSealed
from georep.record.batch import iter_headers
from georep.storage.api import LogConfig
from georep.storage.replica_store import GUARD_FILE, CorruptReplicaChunk, ReplicaError, ReplicaStore, UnknownSegment
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, OriginSeq
from tests.support.segments import A, B, Writer, open_log, read_all
from topology.ids import LeaderEpoch, SegmentId

KEY = ("orders/eu", 3)
WAIT_S = 10.0  # a bound on each wait, never reached when the store works
SEG = SegmentId(4)
E1, E2 = LeaderEpoch(1), LeaderEpoch(2)


def leader_log(tmp_path: Path, batches: int, base: int = 0) -> tuple[SegmentLog, list[bytes]]:
    """A leader's log of one segment starting at ``base``: its batches as stored, local prefixes included."""
    log = (
        open_log(tmp_path / "leader")
        if base == 0
        else SegmentLog.create_at(tmp_path / "leader", LogConfig(), base, {A: OriginSeq(7)}, 0)
    )
    w = Writer(log, next_seq={A: 7} if base else {})
    for i in range(batches):
        w.append((A, B)[i % 2], 1 + i % 3)
    return log, read_all(log)


def test_a_copy_holds_the_leaders_bytes_exactly_and_starts_at_the_segments_base(tmp_path: Path) -> None:
    leader, batches = leader_log(tmp_path, 6, base=1000)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    store.open_segment(KEY, E1, SEG, 1000, {A: OriginSeq(7)}, now_ms=0)
    for b in batches:
        store.append(KEY, E1, SEG, b)
    assert store.flush(KEY, SEG) == leader.log_end_offset
    store.close()
    reopened = ReplicaStore(tmp_path / "node", now_ms=0)
    copy = SegmentLog.open(tmp_path / "node" / "replicas" / "orders%2Feu-3" / "0000000004", LogConfig(), 0)
    try:
        assert read_all(copy) == batches  # prefix (base offset, append time) and body, byte for byte
        assert copy.log_start_offset == 1000 and copy.vector() == leader.vector()
    finally:
        copy.close()
    assert reopened.segment_ids(KEY) == [SEG] and reopened.end_offset(KEY, SEG) == leader.log_end_offset
    reopened.close()
    leader.close()


def test_the_guard_refuses_old_epochs_sealed_segments_and_gaps_and_changes_nothing(tmp_path: Path) -> None:
    leader, batches = leader_log(tmp_path, 4)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    store.open_segment(KEY, E1, SEG, 0, {}, now_ms=0)
    store.append(KEY, E1, SEG, batches[0])
    with pytest.raises(NotContiguous) as gap:
        store.append(KEY, E1, SEG, batches[2])
    assert gap.value.local_end == iter_headers(batches[0])[0].next_offset  # where the leader resends from
    store.fence(KEY, E2)
    with pytest.raises(Fenced):
        store.append(KEY, E1, SEG, batches[1])
    with pytest.raises(Fenced):  # a deposed leader's stream is refused as it opens, not only at its first batch
        store.open_segment(KEY, E1, SEG, 0, {}, now_ms=0)
    with pytest.raises(CorruptReplicaChunk):
        store.append(KEY, E2, SEG, batches[1][:-1])
    with pytest.raises(UnknownSegment, match="ask a member"):
        store.append(KEY, E2, SegmentId(9), batches[1])
    with pytest.raises(UnknownSegment):
        store.read(("other", 0), SEG, LocalOffset(0), 100)
    assert store.partitions() == [KEY]  # a read of what the node does not hold creates nothing
    end = store.append(KEY, E2, SEG, batches[1])
    store.seal(KEY, E2, SEG, end, now_ms=0)
    with pytest.raises(SegmentSealed):
        store.append(KEY, E2, SEG, batches[2])
    with pytest.raises(SegmentSealed):
        store.open_segment(KEY, E2, SegmentId(3), 0, {}, now_ms=0)
    assert store.end_offset(KEY, SEG) == end
    store.close()
    leader.close()


def test_fence_and_seal_survive_a_restart_and_a_longer_copy_is_cut_only_at_the_seal(tmp_path: Path) -> None:
    leader, batches = leader_log(tmp_path, 5)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    store.open_segment(KEY, E1, SEG, 0, {}, now_ms=0)
    for b in batches:
        store.append(KEY, E1, SEG, b)
    ends = store.fence(KEY, E2)
    assert ends == {SEG: leader.log_end_offset}
    sealed_end = iter_headers(batches[2])[0].next_offset  # recovery kept 3 batches: the copy is cut after them
    store.close()
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    with pytest.raises(Fenced):
        store.append(KEY, E1, SEG, batches[0])
    assert store.seal(KEY, E2, SEG, sealed_end, now_ms=0) == sealed_end
    store.close()
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    assert store.end_offset(KEY, SEG) == sealed_end
    assert json.loads((store.root / "orders%2Feu-3" / GUARD_FILE).read_text())["sealed_through"] == SEG
    assert store.read(KEY, SEG, LocalOffset(0), 1 << 20).data == b"".join(batches[:3])
    with pytest.raises(SegmentSealed):
        store.append(KEY, E2, SEG, batches[3])
    store.close()
    leader.close()


def test_a_cut_must_fall_between_batches_of_the_last_segment(tmp_path: Path) -> None:
    leader, batches = leader_log(tmp_path, 3)
    leader.close()
    third = iter_headers(batches[2])[0]
    assert third.records_count == 3
    with pytest.raises(ValueError, match="between batches"):
        SegmentLog.cut(tmp_path / "leader", LogConfig(), third.base_offset + 1, 0)
    with pytest.raises(ValueError, match="the log ends at"):
        SegmentLog.cut(tmp_path / "leader", LogConfig(), third.next_offset + 5, 0)
    cut = SegmentLog.cut(tmp_path / "leader", LogConfig(), 0, 0)
    assert cut.log_end_offset == 0 and read_all(cut) == []
    cut.close()


def test_an_unreadable_guard_stops_the_store_rather_than_forgetting_the_fence(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    store.open_segment(KEY, E2, SEG, 0, {}, now_ms=0)
    store.close()
    (tmp_path / "node" / "replicas" / "orders%2Feu-3" / GUARD_FILE).write_text("{trunc")
    with pytest.raises(ReplicaError, match="cannot know which leaders it fenced"):
        ReplicaStore(tmp_path / "node", now_ms=0)


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from topology.ids import LeaderEpoch, SegmentId
    from georep.storage.replica_store import ReplicaStore
    chunks = Path(sys.argv[2]).read_bytes().split(b"\\n--8<--\\n")
    store = ReplicaStore(Path(sys.argv[1]), now_ms=0)
    store.open_segment(("t", 0), LeaderEpoch(1), SegmentId(0), 0, {}, now_ms=0)
    for i, chunk in enumerate(chunks):
        epoch = LeaderEpoch(1 + i // 10)  # a new leader every 10 batches: the fence rises on disk
        store.append(("t", 0), epoch, SegmentId(0), chunk)
        end = store.flush(("t", 0), SegmentId(0))
        print(f"acked {epoch} {end}", flush=True)  # the member's ack: only after the fsync and the guard
    print("done", flush=True)
    sys.stdin.read()
""")


def test_a_member_killed_mid_stream_keeps_every_acked_batch_and_every_fence(tmp_path: Path) -> None:
    leader, batches = leader_log(tmp_path, 40)
    leader.close()
    assert all(b"\n--8<--\n" not in b for b in batches)
    (tmp_path / "chunks").write_bytes(b"\n--8<--\n".join(batches))
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "node"), str(tmp_path / "chunks")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": "."},
        cwd=Path(__file__).resolve().parent.parent,
    ) as child:
        assert child.stdout is not None
        acked: list[tuple[int, int]] = []
        for line in child.stdout:
            if line.startswith(b"acked"):
                _, epoch, end = line.split()
                acked.append((int(epoch), int(end)))
            if len(acked) == 25:
                os.kill(child.pid, signal.SIGKILL)
                break
        child.wait(timeout=30)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    last_epoch, last_end = acked[-1]
    assert store.end_offset(("t", 0), SegmentId(0)) >= last_end
    assert store.guard_state(("t", 0)).fenced_epoch >= last_epoch
    with pytest.raises(Fenced):
        store.append(("t", 0), LeaderEpoch(last_epoch - 1), SegmentId(0), batches[0])
    held = store.read(("t", 0), SegmentId(0), LocalOffset(0), 1 << 24).data
    assert b"".join(batches).startswith(held)  # a prefix of the leader's stream, byte for byte
    store.close()


def test_opening_a_copy_syncs_each_file_and_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover at 5,000 partitions opens thousands of copies, and each fsync waits on a shared disk: an open
    made the new log durable, then opened it twice more, each time syncing its directory and rewriting its
    recovery point (13 fsyncs where 7 make it durable). The copy still comes back after a restart."""
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    store.open_segment(KEY, E1, SegmentId(1), 0, {}, now_ms=0)  # the partition's directory and guard exist
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    store.open_segment(KEY, E1, SEG, 1000, {A: OriginSeq(7)}, now_ms=0)
    # log-start and recovery point (file and directory each), the segment's directory, its parent before and after
    # the rename
    assert len(synced) <= 7, f"{len(synced)} fsyncs to open one copy"
    store.close()
    reopened = ReplicaStore(tmp_path / "node", now_ms=0)
    assert reopened.segment_ids(KEY) == [SegmentId(1), SEG] and reopened.end_offset(KEY, SEG) == 1000
    reopened.close()


def test_a_slow_open_holds_up_only_its_own_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover opens thousands of copies on the executor's threads, each a few fsyncs. Under one store-wide lock
    a slow fsync of one partition held up every other partition's open, fence and append; now only its own."""
    from georep.storage import replica_store

    store = ReplicaStore(tmp_path / "node", now_ms=0)
    slow_key, other = ("slow", 0), ("other", 0)
    store.open_segment(other, E1, SEG, 0, {}, now_ms=0)
    in_fsync, release = threading.Event(), threading.Event()
    real = replica_store.fsync_directory

    def fsync_directory(path: Path) -> None:
        if path.name == replica_store.partition_dir_name(slow_key):
            in_fsync.set()
            release.wait(WAIT_S)  # the disk holds this partition's open
        real(path)

    monkeypatch.setattr(replica_store, "fsync_directory", fsync_directory)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(store.open_segment, slow_key, E1, SEG, 0, {}, 0)
        try:
            assert in_fsync.wait(WAIT_S)
            fenced = pool.submit(store.fence, other, E2)
            assert fenced.result(WAIT_S) == {SEG: 0}, "another partition's fence waited for the slow open"
            assert other in store.partitions()
        finally:
            release.set()
        slow.result(WAIT_S)
    assert store.segment_ids(slow_key) == [SEG] and store.guard_state(other).fenced_epoch == E2
    store.close()
