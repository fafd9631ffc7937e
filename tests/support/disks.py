"""A small disk for the tests that fill one: a tmpfs mounted under the test's temporary directory (root only)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options`` (``size=256k``, ``nr_inodes=600``...) at ``tmp_path/disk``; unmounted lazily
    afterwards, since a failing test may still hold files open on it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"this test mounts a small tmpfs ({options}) and needs root: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
