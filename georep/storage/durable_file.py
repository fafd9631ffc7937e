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


def replace_file(path: Path, data: bytes, *, sync_directory: bool = True, sync: bool = True) -> None:
    """Atomically give ``path`` the contents ``data`` (durable on return).

    ``sync_directory=False`` leaves the directory fsync to a caller that
    replaces several files and syncs the directory once. ``sync=False`` syncs
    nothing: only for a file in a directory that is not in use yet, which the
    caller syncs whole (a new segment copy built aside, ``SegmentLog.stage_at``).
    """
    os.replace(stage_file(path, data, sync=sync), path)
    if sync and sync_directory:
        fsync_directory(path.parent)


def stage_file(path: Path, data: bytes, *, sync: bool = True) -> Path:
    """Write ``data`` to ``<path>.tmp`` (fsynced unless ``sync=False``) and return that path, for the caller to
    rename over ``path`` once it is durable (``georep.storage.sync_waves``: one sync for many callers)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):  # each pass writes at least one byte or raises
            done += os.write(fd, view[done:])
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp
