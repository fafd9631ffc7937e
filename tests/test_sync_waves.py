"""One sync for many writers (georep/storage/sync_waves.py), and a replica store that answers an open or a fence only
after a sync that covers its files (georep/storage/replica_store.py).

A sync here is real (``syncfs``, or its stand-in where the kernel cannot report its errors) and recorded: what the
file system looked like when it *started* is what it made durable. A call may answer only once such a snapshot,
of a sync that returned before the answer, shows what the call promises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from georep.storage.replica_store import GUARD_FILE, NEW_SUFFIX, ReplicaStore, partition_dir_name
from georep.storage.sync_waves import SyncWaves
from offsets.coordinates import OriginSeq
from tests.support.segments import A
from topology.ids import LeaderEpoch, SegmentId

WAIT_S = 30.0


class RecordedSyncs:
    """A sync that records what it covered: ``covered(i)`` is a snapshot taken when sync ``i`` started, and ``done``
    how many returned. ``gate``: each sync waits for it, so that callers pile up behind a running one."""

    def __init__(self, snapshot: Callable[[], object], gate: threading.Event | None = None) -> None:
        self.snapshot = snapshot
        self.gate = gate
        self.started: list[object] = []
        self.done = 0
        self.fail_next = False
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.started.append(self.snapshot())
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        with self.lock:
            self.done += 1
            if self.fail_next:
                self.fail_next = False
                raise OSError(5, "Input/output error")

    def synced(self) -> list[object]:
        """The snapshots of the syncs that returned."""
        with self.lock:
            return self.started[: self.done]


def test_every_waiter_returns_after_a_sync_that_started_after_it_and_waiters_share_syncs() -> None:
    written: set[int] = set()
    lock = threading.Lock()

    def snapshot() -> frozenset[int]:
        with lock:
            return frozenset(written)

    gate = threading.Event()
    syncs = RecordedSyncs(snapshot, gate)
    waves = SyncWaves(syncs)
    late: list[int] = []

    def writer(i: int) -> None:
        with lock:
            written.add(i)
        waves.wait()
        if not any(i in covered for covered in syncs.synced()):  # type: ignore[operator]
            late.append(i)

    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(writer, 0)
        while not syncs.started:  # the first sync runs (and waits on the gate): the others arrive behind it
            threading.Event().wait(0.01)
        rest = [pool.submit(writer, i) for i in range(1, 8)]
        while waves.waits < 8:
            threading.Event().wait(0.01)
        gate.set()
        for f in [first, *rest]:
            f.result(WAIT_S)
    assert late == []
    assert waves.syncs == 2  # the first writer's, then one for the seven that came while it ran


def test_a_failed_sync_fails_every_waiter_it_covered_and_the_next_wait_syncs_again() -> None:
    gate = threading.Event()
    syncs = RecordedSyncs(lambda: None, gate)
    waves = SyncWaves(syncs)
    syncs.fail_next = True
    gate.set()
    with pytest.raises(OSError, match="Input/output error"):
        waves.wait()
    waves.wait()  # a new sync, which succeeds
    assert waves.syncs == 2


# -- the replica store's opens and fences --------------------------------------------------------------------

KEY = ("orders", 0)
E1, E2 = LeaderEpoch(1), LeaderEpoch(2)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its contents, and every directory (as b"/")."""
    out: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        try:
            out[str(path.relative_to(root))] = b"/" if path.is_dir() else path.read_bytes()
        except FileNotFoundError:  # moved or removed while we looked
            continue
    return out


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[ReplicaStore, RecordedSyncs, Path]:
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    syncs = RecordedSyncs(lambda: tree(store.root))
    store.waves = SyncWaves(syncs)
    return store, syncs, store.root


def test_an_opened_copy_answers_only_after_a_sync_covering_its_files_then_their_rename(
    recorded: tuple[ReplicaStore, RecordedSyncs, Path],
) -> None:
    store, syncs, root = recorded
    store.open_segment(KEY, E1, SegmentId(3), 500, {A: OriginSeq(40)}, now_ms=0)
    opened = store.copy(KEY, SegmentId(3))
    assert opened is not None
    copy = f"{partition_dir_name(KEY)}/{opened.directory.name}"
    synced: list[dict[str, bytes]] = syncs.synced()  # type: ignore[assignment]
    final = [i for i, t in enumerate(synced) if copy in t]
    assert final, "the copy answered before a sync covered its rename"
    files = {name.removeprefix(copy + "/") for name in synced[final[0]] if name.startswith(copy + "/")}
    building = copy + NEW_SUFFIX + "/"
    staged = [
        i
        for i, t in enumerate(synced[: final[0]])
        if files <= {n.removeprefix(building) for n in t if n.startswith(building)}
    ]
    assert staged, "the copy was renamed into place before its files were synced"
    guard = f"{partition_dir_name(KEY)}/{GUARD_FILE}"
    assert b'"fenced_epoch": 1' in synced[-1][guard]  # the open raised the guard: durable too
    store.close()
    reopened = ReplicaStore(root.parent, now_ms=0)
    assert reopened.end_offset(KEY, SegmentId(3)) == 500
    reopened.close()


def test_a_fence_answers_only_after_a_sync_covering_its_guard(
    recorded: tuple[ReplicaStore, RecordedSyncs, Path],
) -> None:
    store, syncs, _ = recorded
    store.open_segment(KEY, E1, SegmentId(3), 0, {}, now_ms=0)
    store.fence(KEY, E2)
    guard = f"{partition_dir_name(KEY)}/{GUARD_FILE}"
    synced: list[dict[str, bytes]] = syncs.synced()  # type: ignore[assignment]
    assert b'"fenced_epoch": 2' in synced[-1].get(guard, b""), "the fence answered before its guard was synced"
    store.close()
