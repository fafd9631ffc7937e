"""Replacing a small file so that a crash leaves either the old or the new contents.

Write ``<name>.tmp``, fsync it, rename it over ``<name>``, fsync the directory.
A crash can leave a stray ``.tmp`` behind; ``SegmentLog.open`` removes those.
The file is its owner's only (0600: ``georep/storage/private.py``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from georep.storage.private import FILE_MODE

TMP_SUFFIX = ".tmp"


def fsync_directory(directory: Path) -> None:
    """Make creations, renames and deletions in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, *, sync_directory: bool = True) -> None:
    """Atomically give ``path`` the contents ``data`` (durable on return).

    ``sync_directory=False`` leaves the directory fsync to a caller that
    replaces several files and syncs the directory once.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):  # each pass writes at least one byte or raises
            done += os.write(fd, view[done:])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync_directory:
        fsync_directory(path.parent)
