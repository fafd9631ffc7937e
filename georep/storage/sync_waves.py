"""Group commit of a node's small metadata writes: one ``syncfs`` for every thread that waits for one at the same
time (segment copies opened, guards persisted: ``georep/storage/replica_store.py``).

A failover or a topic's creation opens thousands of segment copies on the executor's threads, each a handful of
files and two directories, and fences thousands of partitions, each a guard file replaced: each of those was its
own fsync (seven per open), and each waited for a disk shared with the Raft journal (docs/design.md, "Metadata at
scale", the fifth session's list). Now a caller writes its files without syncing them and calls
:meth:`SyncWaves.wait`: it returns once a ``syncfs`` that *started after the call* has returned, so everything the
caller wrote before it is durable. The first waiter to find no sync running runs one for everyone waiting; callers
that arrive while it runs wait for the next, which one of them runs. A sync that fails raises in every caller it
was to cover (each then fails as if its own fsync had failed), and the next wait runs a new one.

Only where ``syncfs`` reports writeback errors (``GROUP_FLUSH_SUPPORTED``, Linux 5.8 and later): elsewhere the
store keeps its per-file fsyncs (:func:`sync_waves_for`). The store does not use it yet (``ReplicaStore.waves`` is
None): with it on, bench runs on the shared machine had several times main's Raft elections while a topic's segments
were created, maybe because a ``syncfs`` writes back the whole file system's dirty data, the Raft journal's
included; docs/design.md, "Seventh session", says what would decide it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

from georep.storage.segment_log import GROUP_FLUSH_SUPPORTED


def syncfs_of(path: Path) -> Callable[[], None]:
    """``syncfs`` of the file system holding ``path`` (raises ``OSError`` with what the kernel said)."""
    syncfs = ctypes.CDLL(None, use_errno=True).syncfs

    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of {path} failed: {os.strerror(err)}")
        finally:
            os.close(fd)

    return sync


class _Wave:
    """The callers one sync covers: every one that asked before it started."""

    def __init__(self) -> None:
        self.done = False
        self.error: OSError | None = None


class SyncWaves:
    """Threads that need what they wrote durable share one sync per wave (see the module docstring)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._cond = threading.Condition()
        self._next = _Wave()  # the wave the next sync covers: callers join it until it starts
        self._running = False
        self.syncs = 0  # syncs run, and the waits they covered (for tests and the bench)
        self.waits = 0

    def wait(self) -> None:
        """Return once everything this thread wrote before the call is durable; ``OSError`` if the sync that was to
        cover it failed."""
        with self._cond:
            self.waits += 1
            wave = self._next
            while self._running and not wave.done:
                self._cond.wait()
            if not wave.done:  # no sync runs, and none covered this caller yet: run one for the whole wave
                self._running = True
                self._next = _Wave()
        if not wave.done:
            try:
                self._sync()
            except OSError as exc:
                wave.error = exc
            with self._cond:
                wave.done = True
                self._running = False
                self.syncs += 1
                self._cond.notify_all()
        if wave.error is not None:
            raise OSError(wave.error.errno, f"{wave.error} (one sync for several writers)")


def sync_waves_for(root: Path) -> SyncWaves | None:
    """The store's group commit over ``root``'s file system, or None where ``syncfs`` cannot be trusted."""
    return SyncWaves(syncfs_of(root)) if GROUP_FLUSH_SUPPORTED else None
