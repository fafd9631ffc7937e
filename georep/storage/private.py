"""A node's files are its own: its data dir and every directory in it 0700, every file 0600.

A data dir holds what no other user of the machine may read: records, and in ``topics.json`` (or the Raft
metadata of a multi-node site) the SCRAM salts, stored keys and server keys of every user, which let their holder
pose as the server to a client or mount an offline guess at a password. Three layers keep it private:

* the processes that write data dirs (``georep node``, ``georep up``, ``georep certs init``) run with the umask
  :data:`UMASK` (:func:`restrict_umask`), so whatever they create, libraries included (pysyncobj's journal), is
  private from the start;
* the helpers that create files and directories give :data:`FILE_MODE` and :data:`DIR_MODE` explicitly
  (``durable_file.replace_file``, the segment files, the lock file, ``topics.json`` and ``node.json``), so no
  umask of a caller (a test, an embedding) can open them up;
* a node tightens its data dir at start (:func:`tighten`): a data dir made by an older version, copied with
  ``cp -r`` or restored from a backup loses the group's and others' access, and the node says what it changed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700
UMASK = 0o077  # what the processes that write data dirs create: 0600 files, 0700 directories
SHOWN = 3  # paths a warning names


def restrict_umask() -> None:
    """From now on this process creates files 0600 and directories 0700 (unless a mode says less)."""
    os.umask(UMASK)


def append_private(path: Path) -> BinaryIO:
    """``path`` opened to append (a node's log), created 0600 if missing."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE), "ab")


def private_dir(path: Path) -> None:
    """``path`` and its missing parents, created 0700 (an existing directory is left as it is)."""
    if path.is_dir():
        return
    if not path.parent.is_dir():
        private_dir(path.parent)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise


@dataclass
class Tightened:
    """What :func:`tighten` changed: the paths that were open to the group or to others."""

    files: list[str] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.files or self.directories)

    def describe(self, root: Path) -> str:
        shown = ", ".join([*self.directories, *self.files][:SHOWN])
        more = len(self.files) + len(self.directories) - SHOWN
        return (
            f"data dir {root} was open to other users: removed their access to {len(self.directories)} "
            f"director{'y' if len(self.directories) == 1 else 'ies'} and {len(self.files)} file(s) ({shown}"
            f"{f', and {more} more' if more > 0 else ''}). A node keeps its data dir 0700 and its files 0600: "
            "they hold records and users' SCRAM keys"
        )


def tighten(root: Path) -> Tightened:
    """Take the group's and others' access away from ``root`` and everything under it (symbolic links are not
    followed); what was changed, by path relative to ``root``. A missing ``root`` changes nothing.

    One ``lstat`` per entry, through ``os.scandir`` (a node with 10,000 partitions has 40,000 of them: paths
    built and stat'ed twice each were a seventh of its start)."""
    out = Tightened()
    if not root.is_dir():
        return out
    try:
        st = root.lstat()
    except FileNotFoundError:
        return out
    _restrict(str(root), st.st_mode, ".", out)
    pending = [(str(root), "")]
    while pending:  # each directory once: bounded by the tree, symbolic links are never followed
        directory, relative = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:  # deleted meanwhile (a node's own files are not, but a stray tmp may be)
                continue
            name = relative + entry.name
            _restrict(entry.path, mode, name, out)
            if stat.S_ISDIR(mode):
                pending.append((entry.path, name + "/"))
    out.files.sort()
    out.directories.sort()
    return out


def _restrict(path: str, mode: int, name: str, out: Tightened) -> None:
    if stat.S_ISLNK(mode) or not mode & 0o077:
        return
    os.chmod(path, stat.S_IMODE(mode) & ~0o077)
    (out.directories if stat.S_ISDIR(mode) else out.files).append(name)
