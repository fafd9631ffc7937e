"""Where the audit's input lives: sites, their partition logs and segment files.

A one-node site's data dir (what ``georep node --data-dir`` and ``georep up``
create)::

    <site dir>/site.json                 {"site": "a", "epoch": 1700000000, ...}
    <site dir>/topics.json               topic definitions
    <site dir>/logs/<quoted topic>-<p>/  one partition log (georep.storage.segment_log)

A multi-node site's dir holds one data dir per node (``georep up`` writes
``DATA_DIR/<site>/<node id>/``), and each node keeps the copies of the
segments whose ensembles it is a member of (georep.storage.replica_store)::

    <site dir>/<node>/replicas/<quoted topic>-<p>/<segment id, 10 digits>/   one SegmentLog from the segment's base

The layout is told apart per site: a site dir with sub-directories that hold
``replicas/`` is a multi-node site, and each of them is a node (named by its
dir). Every copy of every segment is listed (``node``, ``segment_id``), and
the site's own partition log is assembled from them later
(:mod:`spark_jobs.replicas`); what the listing adds for that is where each
segment ends in the site's chain: the base offset of the site's next segment
(``segment_end``), which no copy's length can tell.

A partition dir's name is the node's (``georep/storage/partition_dirs.py``): the
topic %-quoted, then ``-`` and the partition number.

Listing fixes, for every segment, the byte size seen *now*: the reader never
reads past it, so segments that a live node keeps appending to are read as a
consistent prefix (docs/audit.md, "Live sites"). No Spark here: the CLI lists
first, so a bad path fails with a clear message before a JVM starts.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path

from georep.storage.partition_dirs import parse_partition_dir
from georep.storage.recovery_checkpoint import recorded_point
from georep.storage.replica_store import REPLICAS_DIR
from georep.storage.segment import LOG_SUFFIX
from topology.file import TopologyFileError, is_default, parse_topology_file, unreadable
from topology.model import Topology, default_topology

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
    # A multi-node site's copy of one segment: the node holding it, and the segment's id and end (the base offset
    # of the site's next segment, where this one was sealed; None for the newest). All None at a one-node site.
    node: str | None = None
    segment_id: int | None = None
    segment_end: int | None = None


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
    """The topology in file ``spec`` (the embedded default for None or ``"default"``); else :class:`AuditInputError`."""
    if is_default(spec):
        return default_topology()
    error: Exception
    try:
        return parse_topology_file(str(spec), Path(str(spec)).read_bytes())
    except OSError as exc:
        error = unreadable(str(spec), exc)
    except TopologyFileError as exc:
        error = exc
    raise AuditInputError(f"{error}; pass a valid --topology FILE, or omit it for the default")


def topic_matches(topic: str, patterns: tuple[str, ...]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(topic, p) for p in patterns)


def node_dirs(site_dir: Path) -> dict[str, Path]:
    """A multi-node site's node data dirs, by node (dir name), in node order; empty for a one-node site."""
    try:
        children = [c for c in site_dir.iterdir() if c.is_dir() and (c / REPLICAS_DIR).is_dir()]
    except OSError:
        return {}
    return {c.name: c for c in sorted(children, key=lambda c: node_order(c.name))}


def node_order(node: str) -> tuple[int, str]:
    """Node ids in numeric order (2 before 10), any other dir name after them."""
    return (len(node), node) if node.isdigit() else (1 << 30, node)


def _holds_copies(replicas: Path) -> bool:
    try:
        return any(seg.name.isdigit() for part in replicas.iterdir() if part.is_dir() for seg in part.iterdir())
    except OSError:
        return False


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except OSError as exc:
        raise AuditInputError(f"cannot list {directory}: {exc.strerror}; check its permissions") from None


def list_segments(site_dirs: dict[str, Path], topics: tuple[str, ...] = ()) -> list[SegmentFile]:
    """Every segment file of every matching partition of every site (each copy, at a multi-node site), sorted;
    sizes fixed now."""
    out: list[SegmentFile] = []
    for site, site_dir in sorted(site_dirs.items()):
        nodes = node_dirs(site_dir)
        if nodes:
            out.extend(_cluster_segments(site, nodes, topics))
            continue
        if _holds_copies(site_dir / REPLICAS_DIR):
            raise AuditInputError(
                f"{site_dir} is the data dir of one node of a multi-node site (it holds segment copies in "
                f"{REPLICAS_DIR}/), which holds only part of site {site}'s segments: pass the site's dir, the one "
                f"that holds a dir per node ('georep up' writes DATA_DIR/{site}/<node id>/)"
            )
        logs = site_dir / LOGS_DIR
        if not logs.is_dir():
            raise AuditInputError(
                f"{site_dir} is not a georep site data dir (it has no {LOGS_DIR}/ directory, nor node dirs with "
                f"{REPLICAS_DIR}/): pass the directory that 'georep node --data-dir' used for site {site}, or for a "
                "multi-node site the one that holds a dir per node"
            )
        for part_dir in _entries(logs):
            parsed = parse_partition_dir(part_dir.name)
            if parsed is None or not part_dir.is_dir() or not topic_matches(parsed[0], topics):
                continue
            out.extend(partition_segments(site, parsed[0], parsed[1], part_dir))
    return out


def _cluster_segments(site: str, nodes: dict[str, Path], topics: tuple[str, ...]) -> list[SegmentFile]:
    """Every copy of every segment on every node of a multi-node site, with each segment's end in the site's chain.

    A node's ``logs/`` is not read: a node of a multi-node site keeps its partitions in ``replicas/`` only.
    """
    copies: dict[tuple[str, int], list[SegmentFile]] = {}
    for node, node_dir in nodes.items():
        for part_dir in _entries(node_dir / REPLICAS_DIR):
            parsed = parse_partition_dir(part_dir.name)
            if parsed is None or not part_dir.is_dir() or not topic_matches(parsed[0], topics):
                continue
            for segment_dir in _entries(part_dir):
                if segment_dir.name.isdigit() and segment_dir.is_dir():  # not 0000000008.new/, being created
                    found = partition_segments(site, parsed[0], parsed[1], segment_dir)
                    copies.setdefault(parsed, []).extend(
                        dataclasses.replace(f, node=node, segment_id=int(segment_dir.name)) for f in found
                    )
    out: list[SegmentFile] = []
    for key in sorted(copies):
        files = sorted(copies[key], key=lambda f: (f.segment_id, node_order(f.node or ""), f.base_offset))
        bases: dict[int | None, int] = {}
        for f in files:  # every copy of a segment starts at its base; min() only so that a stray one changes nothing
            bases[f.segment_id] = min(f.base_offset, bases.get(f.segment_id, f.base_offset))
        ids = list(bases)  # in segment id order
        ends = dict(zip(ids, (bases[i] for i in ids[1:]), strict=False))
        out.extend(
            dataclasses.replace(f, log_start_offset=bases[ids[0]], segment_end=ends.get(f.segment_id)) for f in files
        )
    return out


def partition_segments(site: str, topic: str, partition: int, part_dir: Path) -> list[SegmentFile]:
    """The segment files of one ``SegmentLog`` directory (a partition log, or one node's copy of a segment)."""
    bases = sorted(int(p.stem) for p in part_dir.glob("*" + LOG_SUFFIX) if p.stem.isdigit())
    point = recorded_point(part_dir)  # the node's checkpoint of its logs, or the directory's own file
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
        out.append(SegmentFile(site, topic, partition, str(path), base, size, i == len(bases) - 1, recovery, bases[0]))
    return out


def _readable(path: Path) -> bool:
    try:
        with open(path, "rb"):
            return True
    except PermissionError:
        return False
