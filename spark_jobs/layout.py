"""Where the audit's input lives: sites, their partition logs and segment files.

A site's data dir (what ``georep node --data-dir`` and ``georep up`` create)::

    <site dir>/site.json                 {"site": "a", "epoch": 1700000000, ...}
    <site dir>/topics.json               topic definitions
    <site dir>/logs/<quoted topic>-<p>/  one partition log (georep.storage.segment_log)

The topic in a partition dir name is ``urllib.parse.quote(topic, safe='')``,
so the last ``-`` separates it from the partition number.

Listing fixes, for every segment, the byte size seen *now*: the reader never
reads past it, so segments that a live node keeps appending to are read as a
consistent prefix (docs/audit.md, "Live sites"). No Spark here: the CLI lists
first, so a bad path fails with a clear message before a JVM starts.
"""

from __future__ import annotations

import fnmatch
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from georep.cli.topology_file import TopologyFileError, load_topology
from georep.storage.recovery_point import read_recovery_point
from georep.storage.segment import LOG_SUFFIX
from topology.model import Topology

LOGS_DIR = "logs"
SITE_FILE = "site.json"  # {"site": "a", "epoch": ...}: written by the node, not needed to read


class AuditInputError(Exception):
    """The audit's input is unusable; the message says what to pass instead."""


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """One ``.log`` file, as listed: read at most ``size_bytes`` of it."""

    site: str
    topic: str
    partition: int
    path: str
    base_offset: int
    size_bytes: int
    last: bool  # the partition's newest segment: the one a live node appends to
    recovery_point: int  # every batch below this local offset was fsynced and validated
    log_start_offset: int  # base offset of the partition's oldest segment (retention deletes older ones)


def parse_site_dirs(text: str) -> dict[str, Path]:
    """``"a=/data/a,b=/data/b"`` -> {site: dir}."""
    out: dict[str, Path] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        site, sep, path = item.partition("=")
        if not sep or not site or not path:
            raise AuditInputError(f"invalid site dir {item!r}: expected SITE=DIR, for example a=/var/lib/georep/a")
        out[site.strip()] = Path(path.strip())
    if not out:
        raise AuditInputError("no sites given: pass SITE=DIR pairs, for example a=/data/a,b=/data/b")
    return out


def site_dirs_from_topology(topology: Topology, data_root: Path) -> dict[str, Path]:
    """``data_root/<site>`` for every site of ``topology`` (the layout of ``georep up --data-dir``)."""
    if not data_root.is_dir():
        raise AuditInputError(
            f"data root {data_root} is not a directory: pass --data-root DIR, the directory that holds one "
            "sub-directory per site (what 'georep up --data-dir DIR' writes)"
        )
    dirs = {str(sid): data_root / sid for sid in topology.site_ids()}
    absent = sorted(s for s, d in dirs.items() if not d.is_dir())
    if absent:
        raise AuditInputError(
            f"no data dir for site(s) {', '.join(absent)} under {data_root} (expected {data_root}/<site>/); "
            "pass the --data-root that 'georep up --data-dir' used, or copy each site's data dir there"
        )
    return dirs


def load_topology_for_audit(spec: str | None) -> Topology:
    try:
        return load_topology(spec)
    except TopologyFileError as exc:
        raise AuditInputError(f"{exc}; pass a valid --topology FILE, or omit it for the default") from None


def topic_matches(topic: str, patterns: tuple[str, ...]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(topic, p) for p in patterns)


def parse_partition_dir(name: str) -> tuple[str, int] | None:
    quoted, sep, number = name.rpartition("-")
    if not sep or not number.isdigit():
        return None
    return urllib.parse.unquote(quoted), int(number)


def list_segments(site_dirs: dict[str, Path], topics: tuple[str, ...] = ()) -> list[SegmentFile]:
    """Every segment file of every matching partition of every site, sorted; sizes fixed now."""
    out: list[SegmentFile] = []
    for site, site_dir in sorted(site_dirs.items()):
        logs = site_dir / LOGS_DIR
        if not logs.is_dir():
            raise AuditInputError(
                f"{site_dir} is not a georep site data dir (it has no {LOGS_DIR}/ directory): "
                f"pass the directory that 'georep node --data-dir' used for site {site}"
            )
        try:
            entries = sorted(logs.iterdir())
        except OSError as exc:
            raise AuditInputError(f"cannot list {logs}: {exc.strerror}; check its permissions") from None
        for part_dir in entries:
            parsed = parse_partition_dir(part_dir.name)
            if parsed is None or not part_dir.is_dir() or not topic_matches(parsed[0], topics):
                continue
            out.extend(_partition_segments(site, parsed[0], parsed[1], part_dir))
    return out


def _partition_segments(site: str, topic: str, partition: int, part_dir: Path) -> list[SegmentFile]:
    bases = sorted(int(p.stem) for p in part_dir.glob("*" + LOG_SUFFIX) if p.stem.isdigit())
    point = read_recovery_point(part_dir)
    recovery = point.recovery_point if point else 0
    out = []
    for i, base in enumerate(bases):
        path = part_dir / f"{base:020d}{LOG_SUFFIX}"
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # retention deleted it since the glob
            continue
        except OSError as exc:
            raise AuditInputError(f"cannot read {path}: {exc.strerror}; check its permissions") from None
        if not _readable(path):
            raise AuditInputError(f"cannot read {path}: permission denied; run the audit as a user that can")
        out.append(SegmentFile(site, topic, partition, str(path), base, size, i == len(bases) - 1, recovery,
                               bases[0]))  # fmt: skip
    return out


def _readable(path: Path) -> bool:
    try:
        with open(path, "rb"):
            return True
    except PermissionError:
        return False
