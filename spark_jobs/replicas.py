"""Inside a multi-node site: every copy of a segment compared, and the copy that stands for the site.

A multi-node site (docs/cluster.md) stores each segment of a partition on the
1..RF nodes of its ensemble, each copy a ``SegmentLog`` that starts at the
segment's base offset (``georep/storage/replica_store.py``). One leader
writes a segment and streams the same batches to every member, which stores
them byte for byte, local prefix included; recovery and repair copy whole
batches from a member. So every copy of a segment is a byte prefix of one
writer's stream, and copies differ only in how far they go: a member that
missed the end of a stream, an open segment's copies at different lengths, a
member not told of a seal that keeps a tail the seal cut (never acknowledged
nor read). Two copies neither of which is a byte prefix of the other are a
``replica_divergence``, whatever the cross-site checks find.

**Batch level.** A batch is identified by its base offset, its CRC-32C
(which covers everything but the 24-byte local prefix), its size (the
prefix's ``batch_length``) and its append time (the rest of the prefix): the
same bytes. Copies start at the same offset and are contiguous, so two
copies are prefixes of one another exactly when every base offset that both
hold has the same batch in both; the first one that does not is where they
part, and it is reported (:func:`replica_issues`). Spark finds the pairs of
copies that part and sums up each copy (:func:`divergent_pairs`,
:func:`copy_stats`): a few rows per segment, which the driver collects, so
that the choices below are plain Python over them, and the site's log is one
filter of the batches (:func:`site_log`).

**The site's partition log** for the cross-site checks (I1-I4) is its
segments in id order, each taken from one copy, its *reference*, and only
below the base offset of the site's next segment (``segment_end``, from the
listing): that is where the segment was sealed, and a longer copy's tail past
it is what the seal cut, whose seqs the next segment assigns again. The
reference is the copy that the most other copies agree with (are prefixes
of, or extend), then the longest (its whole, valid batches), then the one
with the fewest damaged batches, then the lowest node id. Without divergence
every copy agrees with every other, so it is the longest copy, and it holds
every batch that any member ever confirmed.

Why the longest and not the end that most copies reach: the site's readers
and the other sites were served up to the last add confirmed, the end that
``min_insync_replicas`` members hold, and that setting is a node's flag, not
on disk. The end a majority of copies reach can be below it (min-insync 1 of
3, or 2 of 4), which would hide records the site had served; the longest copy
is never below it. What the longest copy may add is the newest segment's
unconfirmed tail: the other sites lack it until the site confirms and serves
it, which the cross-site checks report as ``in_flight`` (``missing`` only
when judged as of a time after it was written). Agreement comes first so
that when copies do diverge, one damaged or stray copy never decides what the
site holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.checks import ISSUE_SCHEMA, KINDS, REPLICA_DIVERGENCE, ok_batches
from spark_jobs.layout import SegmentFile, node_order

SEGMENT = ["site", "topic", "partition", "segment"]
VERSION = ["crc", "size_bytes", "append_time_ms"]  # with the base offset: a batch's every byte
_SIDE = [*VERSION, "origin", "base_seq", "last_seq", "records", "file", "position"]
KEEP_SCHEMA = "file string, segment_end long"

SegmentKey = tuple[str, str, int, int]  # site, topic, partition, segment id


@dataclass(frozen=True, slots=True)
class CopyStats:
    """One node's copy of one segment, summed up: how far its whole, valid batches go, and how many are damaged."""

    key: SegmentKey
    node: str
    end: int  # the offset after its last valid batch; -1 for none
    damaged: int


@dataclass(frozen=True, slots=True)
class Side:
    """One copy's batch where two copies part."""

    crc: int
    size_bytes: int
    append_time_ms: int
    origin: str
    base_seq: int
    last_seq: int
    records: int
    file: str
    position: int


@dataclass(frozen=True, slots=True)
class Parting:
    """Two copies of one segment (``node_a`` before ``node_b``) that are not byte prefixes of one another: the first
    base offset both hold with different batches, and each one's batch there."""

    key: SegmentKey
    node_a: str
    node_b: str
    base_offset: int
    a: Side
    b: Side


def any_copies(segments: Sequence[SegmentFile]) -> bool:
    """Whether the listing has a multi-node site (the replica checks and the site's log have work to do)."""
    return any(s.node is not None for s in segments)


def copies_of(batches: DataFrame) -> DataFrame:
    return batches.where(F.col("node").isNotNull())


# -- Spark: a few rows per segment, for the driver --------------------------------------------------------------


def copy_stats(batches: DataFrame) -> list[CopyStats]:
    """Every copy that holds a batch, summed up (one row per copy)."""
    ok = F.col("status") == "ok"
    rows = (
        copies_of(batches)
        .groupBy(*SEGMENT, "node")
        .agg(
            F.max(F.when(ok, F.col("base_offset") + F.col("records"))).alias("end"),
            F.count(F.when(~ok, F.lit(1))).alias("damaged"),
        )
        .collect()
    )
    return [
        CopyStats((r.site, r.topic, r.partition, r.segment), r.node, -1 if r.end is None else r.end, r.damaged)
        for r in rows
    ]


def divergent_pairs(batches: DataFrame) -> list[Parting]:
    """Every pair of copies of one segment that part, and where (the first base offset where their batches differ).

    Only the base offsets whose copies disagree (the smallest and largest version there differ) are paired up, so
    copies that agree cost one aggregation over their batches.
    """
    ok = ok_batches(copies_of(batches))
    version = F.struct(*VERSION)
    disagree = (
        ok.groupBy(*SEGMENT, "base_offset")
        .agg(F.min(version).alias("lo"), F.max(version).alias("hi"))
        .where(F.col("lo") != F.col("hi"))
        .select(*SEGMENT, "base_offset")
    )
    held = ok.join(disagree, [*SEGMENT, "base_offset"], "left_semi")

    def side(name: str) -> DataFrame:
        return held.select(*SEGMENT, "base_offset", F.col("node").alias(f"node_{name}"), F.struct(*_SIDE).alias(name))

    differs = F.lit(False)
    for c in VERSION:
        differs = differs | (F.col(f"a.{c}") != F.col(f"b.{c}"))
    rows = (
        side("a")
        .join(side("b"), [*SEGMENT, "base_offset"])
        .where((F.col("node_a") != F.col("node_b")) & differs)
        .groupBy(*SEGMENT, "node_a", "node_b")
        .agg(F.min_by(F.struct("base_offset", "a", "b"), "base_offset").alias("first"))
        .collect()
    )
    out = []
    for r in rows:  # each pair came both ways: keep it once, in node order
        if node_order(r.node_a) < node_order(r.node_b):
            first = r.first
            out.append(
                Parting(
                    (r.site, r.topic, r.partition, r.segment),
                    r.node_a,
                    r.node_b,
                    first.base_offset,
                    Side(**first.a.asDict()),
                    Side(**first.b.asDict()),
                )
            )
    return sorted(out, key=lambda p: (p.key, node_order(p.node_a), node_order(p.node_b)))


def check_copies(spark: Any, batches: DataFrame) -> tuple[dict[SegmentKey, str], DataFrame]:
    """Every segment's reference copy (:func:`choose_references`) and the ``replica_divergence`` issues of the copies
    in ``batches`` (rows of ``ISSUE_SCHEMA``): what both the file audit, over segment files, and the live audit, over
    every member's digests (``ScanDigests`` with ``all_replicas``), check inside a multi-node site."""
    partings = divergent_pairs(batches)
    references = choose_references(copy_stats(batches), partings)
    return references, spark.createDataFrame(replica_issues(partings, references), ISSUE_SCHEMA)


def site_log(batches: DataFrame, keep: DataFrame) -> DataFrame:
    """The batches of each site's own partition log: a one-node site's as they are; of a multi-node site's copies,
    only those of the files in ``keep`` (the reference copies, rows of ``KEEP_SCHEMA``), below their segment's
    end."""
    kept = F.col("segment_end").isNull() | (F.col("base_offset") < F.col("segment_end"))
    return (
        batches.join(F.broadcast(keep.withColumn("reference", F.lit(True))), "file", "left")
        .where(F.col("node").isNull() | (F.col("reference") & kept))
        .drop("segment_end", "reference")
    )


# -- the driver: plain Python over those rows -------------------------------------------------------------------


def choose_references(copies: Iterable[CopyStats], partings: Iterable[Parting]) -> dict[SegmentKey, str]:
    """The copy that stands for the site, per segment (module docstring): the node holding it."""
    disagree: dict[tuple[SegmentKey, str], int] = {}
    for p in partings:
        for node in (p.node_a, p.node_b):
            disagree[(p.key, node)] = disagree.get((p.key, node), 0) + 1
    best: dict[SegmentKey, tuple[tuple[int, int, int, tuple[int, str]], str]] = {}
    for c in copies:
        # Within a segment every copy has as many others, so agreeing with the most is disagreeing with the fewest.
        rank = (disagree.get((c.key, c.node), 0), -c.end, c.damaged, node_order(c.node))
        if c.key not in best or rank < best[c.key][0]:
            best[c.key] = (rank, c.node)
    return {key: node for key, (_rank, node) in sorted(best.items())}


def keep_rows(segments: Sequence[SegmentFile], references: dict[SegmentKey, str]) -> list[tuple[str, int | None]]:
    """(file, segment end) of every reference copy's file: rows of ``KEEP_SCHEMA`` for :func:`site_log`."""
    return [
        (s.path, s.segment_end)
        for s in segments
        if s.node is not None
        and s.segment_id is not None
        and references.get((s.site, s.topic, s.partition, s.segment_id)) == s.node
    ]


def replica_issues(partings: Sequence[Parting], references: dict[SegmentKey, str]) -> list[dict[str, Any]]:
    """``replica_divergence`` issues, as rows of ``ISSUE_SCHEMA``: each copy that parts from its segment's reference
    copy, named with the reference's node; and two copies that part from each other while both agree with the
    reference (they go on past it in two ways), named with the earlier node. One issue per pair, at the first batch
    that differs."""
    against = [p for p in partings if references.get(p.key) in (p.node_a, p.node_b)]
    parted = {(p.key, p.node_b if p.node_a == references[p.key] else p.node_a) for p in against}
    out = []
    for p in partings:
        ref = references.get(p.key)
        if ref in (p.node_a, p.node_b):
            node, other = (p.node_b, p.node_a) if p.node_a == ref else (p.node_a, p.node_b)
        elif (p.key, p.node_a) in parted or (p.key, p.node_b) in parted:
            continue  # told against the reference already
        else:
            node, other = p.node_b, p.node_a
        mine, theirs = (p.a, p.b) if node == p.node_a else (p.b, p.a)
        site, topic, partition, segment = p.key
        detail = (
            f"segment {segment}: node {node}'s copy and node {other}'s are not prefixes of one another from "
            f"offset {p.base_offset}: here {_batch(mine)}; there {_batch(theirs)}"
        )
        row = {
            "kind": REPLICA_DIVERGENCE,
            "divergence": KINDS[REPLICA_DIVERGENCE],
            "site": site,
            "reference_site": None,
            "topic": topic,
            "partition": partition,
            "origin": mine.origin,
            "first_seq": mine.base_seq,
            "last_seq": mine.last_seq,
            "records": mine.records,
            "offset": p.base_offset,
            "file": mine.file,
            "position": mine.position,
            "detail": detail,
            "node": node,
            "reference_node": other,
            "segment": segment,
        }
        out.append({name: row[name] for name in ISSUE_SCHEMA.fieldNames()})
    return out


def _batch(side: Side) -> str:
    return (
        f"batch CRC 0x{side.crc:08x}, {side.size_bytes} bytes, appended at {side.append_time_ms} ms "
        f"({side.origin} seqs {side.base_seq}..{side.last_seq})"
    )
