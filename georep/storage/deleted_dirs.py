"""The files of a deleted topic incarnation, on their way out (docs/design.md, "Topic changes across sites",
"Storage").

A delete is (1) the tombstone made durable in ``topics.json``, (2) the topic no longer served, (3) each of its
partition directories renamed into ``deleted/`` beside ``logs/`` (the renames, then one fsync of each of the two
directories: from there the files are out of every partition's way), and (4) ``deleted/`` emptied in the
background. A crash between any two steps is finished at the next start (:func:`finish_removals`): a partition
directory of an incarnation at or below a tombstone the table holds is moved out whatever its files say (the
tombstone is the operator's decision, not a derived file), and whatever ``deleted/`` holds is removed.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from georep.metadata.topic_entry import TopicEntry, incarnation_deleted
from georep.storage.durable_file import fsync_directory
from georep.storage.partition_dirs import parse_incarnation_dir
from georep.storage.recovery_checkpoint import RecoveryCheckpoint

log = logging.getLogger(__name__)

DELETED_DIR = "deleted"


def move_to_deleted(logs_dir: Path, deleted_dir: Path, names: Iterable[str], incarnation: int) -> list[Path]:
    """Rename each partition directory ``names`` of ``logs_dir`` into ``deleted_dir`` and make the renames durable;
    the paths they now have. A name already gone (a removal a crash interrupted, finished before) is skipped."""
    deleted_dir.mkdir(mode=0o700, exist_ok=True)
    moved = []
    for name in names:
        target = deleted_dir / f"{name}.{incarnation}.{secrets.token_hex(4)}"  # unique: a name may be deleted again
        try:
            os.rename(logs_dir / name, target)
        except FileNotFoundError:
            continue
        moved.append(target)
    if moved:
        fsync_directory(logs_dir)
        fsync_directory(deleted_dir)
    return moved


def remove_moved(paths: Iterable[Path]) -> None:
    """Remove what :func:`move_to_deleted` moved (in the background: a removal that fails is retried at start)."""
    for path in paths:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("cannot remove %s yet (%s): the next start removes it", path, exc)


def deleted_incarnation_dirs(logs_dir: Path, entries: Mapping[str, TopicEntry]) -> dict[int, list[str]]:
    """The partition directories of ``logs_dir`` whose incarnation the table holds deleted, by incarnation: at or
    below a tombstone, or below the live incarnation (a live k + 1 implies the tombstone of k)."""
    found: dict[int, list[str]] = {}
    for directory in sorted(logs_dir.iterdir()):
        parsed = parse_incarnation_dir(directory.name)
        if parsed is None or not directory.is_dir():
            continue
        topic, _, incarnation = parsed
        if incarnation_deleted(entries.get(topic), incarnation):
            found.setdefault(incarnation, []).append(directory.name)
    return found


def finish_removals(
    logs_dir: Path, deleted_dir: Path, entries: Mapping[str, TopicEntry], checkpoint: RecoveryCheckpoint | None
) -> list[str]:
    """At start: finish the deletes a crash interrupted (module docstring); the partition directories moved out
    (``checkpoint`` forgets them)."""
    moved: list[str] = []
    for incarnation, names in deleted_incarnation_dirs(logs_dir, entries).items():
        move_to_deleted(logs_dir, deleted_dir, names, incarnation)
        moved.extend(names)
    if moved:
        if checkpoint is not None:
            checkpoint.forget(moved)
        log.warning(
            "removing %d partition director%s of deleted topic incarnations that a stop interrupted the removal of: %s",
            len(moved),
            "y" if len(moved) == 1 else "ies",
            ", ".join(moved[:10]) + (" ..." if len(moved) > 10 else ""),
        )
    if deleted_dir.is_dir():
        remove_moved(sorted(deleted_dir.iterdir()))
    return moved
