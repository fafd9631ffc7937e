"""The data dir's lock: one node process per data dir, ever.

Two processes appending to the same segment files interleave their writes
and each trusts its own idea of the log end, so both logs end up corrupt.
That happens with a second ``georep node`` or ``georep up`` on the same
directory, or a restart while the old process is still shutting down.
Kafka refuses it with a ``.lock`` file; so does georep.

A node takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``DATA_DIR/.lock`` before
it reads anything in the directory, and holds it for its lifetime. The lock
belongs to the open file, so the kernel drops it when the process dies,
``kill -9`` included: a stale lock file never blocks a restart. The file
holds the holder's pid and address (JSON), which the refusal names.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from pathlib import Path

from georep.storage.private import FILE_MODE, private_dir

LOCK_FILE = ".lock"


class DataDirLocked(Exception):
    """Another live process holds the data dir."""


class DataDirUnusable(Exception):
    """The data dir cannot be created, opened or written."""


class DataDirLock:
    """An exclusive lock on one data dir, held until :meth:`release` or the process ends."""

    def __init__(self, fd: int, data_dir: Path) -> None:
        self._fd = fd
        self.data_dir = data_dir

    @classmethod
    def acquire(cls, data_dir: Path, address: str) -> DataDirLock:
        """Lock ``data_dir`` (creating it) for this process, which serves on ``address``."""
        path = data_dir / LOCK_FILE
        try:
            private_dir(data_dir)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            raise DataDirUnusable(
                f"data dir {data_dir} is not usable: {exc.strerror or exc}; give the node a directory it can "
                "create and write (--data-dir), or fix its owner and permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DataDirUnusable(f"cannot lock data dir {data_dir}: {exc.strerror or exc}") from None
            raise DataDirLocked(
                f"data dir {data_dir} is in use by another georep node ({holder}); two processes on one data dir "
                "would corrupt its logs: stop that node first, or give this one its own --data-dir"
            ) from None
        lock = cls(fd, data_dir)
        lock.describe(address)
        return lock

    def describe(self, address: str) -> None:
        """Write who holds the lock, for the refusal a second process gets."""
        text = json.dumps({"pid": os.getpid(), "listen": address}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text, 0)
        except OSError:
            pass  # a full disk: the lock holds all the same; the refusal names no holder

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the file drops the lock
            self._fd = -1


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])}, serving on {info['listen']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not written yet"
