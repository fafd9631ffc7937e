"""The audit's checks: DataFrame in, DataFrame of issues out. No I/O, no SparkSession.

Input is the batch-level view of the ``georep`` data source (one row per
batch, ``spark_jobs.scan.BATCH_SCHEMA``). Checking at batch granularity is
exact, not a sample: every site copies the origin's batches verbatim
(ARCHITECTURE.md, "Verbatim records"), so the same coordinates sit in batches
with the same seq range and the same CRC-32C at every site, and that CRC
covers every byte of every record. A copy whose CRC differs is drilled down
record by record (:func:`first_record_differences`) to name the coordinate.

The checks between sites take each site's own partition log: at a
multi-node site, which holds a copy of each segment per ensemble member,
that is one copy of each segment (:mod:`spark_jobs.replicas`, which also
compares the copies: ``replica_divergence``).

Every check returns rows of ``ISSUE_SCHEMA``; ``kind`` is one of ``KINDS``.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, IntegerType, LongType, StringType, StructField, StructType

MISSING = "missing"
IN_FLIGHT = "in_flight"
DUPLICATE = "duplicate"
ORDER = "order"
MISMATCH = "mismatch"
CORRUPT = "corrupt"
TORN_TAIL = "torn_tail"
UNEXPECTED = "unexpected"
REPLICA_DIVERGENCE = "replica_divergence"  # inside a multi-node site: spark_jobs/replicas.py
# kind -> whether it is a divergence (exit code 1)
KINDS = {
    MISSING: True,
    DUPLICATE: True,
    ORDER: True,
    MISMATCH: True,
    CORRUPT: True,
    REPLICA_DIVERGENCE: True,
    IN_FLIGHT: False,
    TORN_TAIL: False,
    UNEXPECTED: False,
}

ISSUE_SCHEMA = StructType(
    [
        StructField("kind", StringType()),
        StructField("divergence", BooleanType()),
        StructField("site", StringType()),
        StructField("reference_site", StringType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("origin", StringType()),
        StructField("first_seq", LongType()),
        StructField("last_seq", LongType()),
        StructField("records", LongType()),
        StructField("offset", LongType()),
        StructField("file", StringType()),
        StructField("position", LongType()),
        StructField("detail", StringType()),
        # A multi-node site's copies (null elsewhere): the node whose copy, the node whose copy it was compared with
        # (replica_divergence), and the segment.
        StructField("node", StringType()),
        StructField("reference_node", StringType()),
        StructField("segment", LongType()),
    ]
)

STREAM = ["topic", "partition", "origin"]
SITE_STREAM = ["site", *STREAM]
BATCH_KEY = [*STREAM, "base_seq", "last_seq"]


def as_issues(df: DataFrame, kind: str | Column, **cols: Column | str | int | None) -> DataFrame:
    """Project ``df`` onto ``ISSUE_SCHEMA``; ``cols`` gives each column (missing ones are null).

    Every call through the JVM gateway costs about a millisecond while plans are built on the driver, so what is
    not a ``Column`` already becomes one SQL expression per column (one call), and a fixed kind's ``divergence``
    is a constant rather than a test of every kind."""
    out = []
    for field in ISSUE_SCHEMA.fields:
        sql_type = field.dataType.simpleString()
        given: Column | str | int | bool | None
        if field.name == "kind":
            given = kind if isinstance(kind, Column) else f"'{kind}'"
        elif field.name == "divergence":
            given = (
                F.coalesce(*[F.when(kind == k, F.lit(d)) for k, d in KINDS.items()])
                if isinstance(kind, Column)
                else KINDS[kind]
            )
        else:
            given = cols.get(field.name)
            given = f"`{given}`" if isinstance(given, str) else given
        if isinstance(given, Column):
            out.append(given.cast(field.dataType).alias(field.name))
        else:
            sql = "NULL" if given is None else str(given).lower() if isinstance(given, bool) else str(given)
            out.append(F.expr(f"CAST({sql} AS {sql_type}) AS {field.name}"))
    return df.select(*out)


def ok_batches(batches: DataFrame) -> DataFrame:
    return batches.where(F.col("status") == "ok")


def damaged_batches(batches: DataFrame) -> DataFrame:
    """``corrupt`` and ``torn_tail`` batches, named by site, file and byte position."""
    bad = batches.where(F.col("status") != "ok")
    return as_issues(
        bad,
        F.when(F.col("status") == "torn_tail", F.lit(TORN_TAIL)).otherwise(F.lit(CORRUPT)),
        site="site",
        topic="topic",
        partition="partition",
        offset="base_offset",
        file="file",
        position="position",
        detail="error",
        node="node",
        segment="segment",
    )


def sequence_issues(batches: DataFrame) -> DataFrame:
    """I2 duplicates, I3 order and holes (I1 prefix) within each site's log, per origin.

    In origin-seq order, a batch starting at or below the highest seq before it
    holds duplicates; one starting above it + 1 leaves a hole. In log order, a
    batch starting at or below the highest seq already in the log, that is not
    a duplicate, is out of order. A log whose oldest segments retention deleted
    (``log_start_offset`` > 0) is not checked for a hole before its first batch.
    """
    by_seq = (
        Window.partitionBy(*SITE_STREAM).orderBy("base_seq", "base_offset").rowsBetween(Window.unboundedPreceding, -1)
    )
    by_offset = Window.partitionBy(*SITE_STREAM).orderBy("base_offset").rowsBetween(Window.unboundedPreceding, -1)
    df = (
        ok_batches(batches)
        .withColumn("seq_before", F.max("last_seq").over(by_seq))
        .withColumn("log_before", F.max("last_seq").over(by_offset))
        .withColumn("dup", F.col("base_seq") <= F.col("seq_before"))
        .withColumn("expect", F.coalesce(F.col("seq_before"), F.when(F.col("log_start_offset") == 0, F.lit(-1))) + 1)
    )
    common = {
        "site": "site",
        "topic": "topic",
        "partition": "partition",
        "origin": "origin",
        "offset": "base_offset",
        "file": "file",
        "position": "position",
        "node": "node",
        "segment": "segment",
    }
    dups = df.where("dup")
    dup_last = F.least(F.col("last_seq"), F.col("seq_before"))
    order = df.where(~F.col("dup") & (F.col("base_seq") <= F.col("log_before")))
    return (
        as_issues(
            dups,
            DUPLICATE,
            **common,
            first_seq="base_seq",
            last_seq=dup_last,
            records=dup_last - F.col("base_seq") + 1,
            detail=F.format_string("seqs %d..%d held again at offset %d", "base_seq", dup_last, "base_offset"),
        )
        .unionByName(_hole_issues(df, F.col("base_seq"), F.col("base_offset"), "", **common))
        .unionByName(
            as_issues(
                order,
                ORDER,
                **common,
                first_seq="base_seq",
                last_seq="last_seq",
                records="records",
                detail=F.format_string(
                    "seq %d at offset %d comes after seq %d in the log", "base_seq", "base_offset", "log_before"
                ),
            )
        )
    )


def site_streams(batches: DataFrame) -> DataFrame:
    """Per (site, topic, partition, origin): the highest seq held, and how many records and batches."""
    return (
        ok_batches(batches)
        .groupBy(*SITE_STREAM, "origin_site")
        .agg(F.max("last_seq").alias("held_max"), F.sum("records").alias("records"), F.count("*").alias("batches"))
    )


def _holding(streams: DataFrame, held_before: DataFrame | None) -> DataFrame:
    """Per site stream, the highest seq it holds: of the batches read, or before them (``held_before``)."""
    holding = streams.select(*SITE_STREAM, "origin_site", "held_max")
    if held_before is None:
        return holding
    return (
        holding.unionByName(held_before.select(*SITE_STREAM, "origin_site", "held_max"))
        .groupBy(*SITE_STREAM, "origin_site")
        .agg(F.max("held_max").alias("held_max"))
    )


def reach_issues(
    batches: DataFrame, expected: DataFrame, as_of_ms: int, held_before: DataFrame | None = None
) -> DataFrame:
    """I4: sites that the topology says should hold an origin's records but lack the newest ones.

    ``expected``: (topic, origin_site, site) rows, the expected reach. For each
    stream, the sites that should hold it are compared with the furthest copy
    (``reference_site``, the origin itself when it is furthest). A site behind
    by a tail whose first missing batch was appended at its origin at or after
    ``as_of_ms`` is ``in_flight``; an older tail is ``missing``. Holes in the
    middle of a log are :func:`sequence_issues`. Sites holding records that
    the reach excludes are ``unexpected``.

    ``held_before``: (site, topic, partition, origin, origin_site, held_max) rows of what each site held before
    the batches given (an incremental audit reads only what came after its previous cut): a site holds the
    higher of the two.
    """
    streams = site_streams(batches)
    holding = _holding(streams, held_before)
    furthest = holding.groupBy(*STREAM, "origin_site").agg(
        F.max("held_max").alias("known_max"),
        # the furthest; among equals the origin, then the lowest site id
        F.min_by("site", F.struct(-F.col("held_max"), F.col("site") != F.col("origin_site"), "site")).alias(
            "reference_site"
        ),
    )
    targets = furthest.join(expected, ["topic", "origin_site"])
    held = holding.select(*SITE_STREAM, "held_max")
    behind = (
        targets.join(held, SITE_STREAM, "left")
        .withColumn("held_max", F.coalesce("held_max", F.lit(-1)))
        .where(F.col("held_max") < F.col("known_max"))
        .withColumn("first_missing", F.col("held_max") + 1)
    )
    ok = ok_batches(batches)
    first_batch = ok.groupBy(*STREAM, "base_seq").agg(
        F.coalesce(
            F.min(F.when(F.col("site") == F.col("origin_site"), F.col("append_time_ms"))), F.min("append_time_ms")
        ).alias("appended_ms")
    )
    gaps = behind.join(first_batch.withColumnRenamed("base_seq", "first_missing"), [*STREAM, "first_missing"], "left")
    recent = F.coalesce(F.col("appended_ms") >= F.lit(as_of_ms), F.lit(False))
    tail = as_issues(
        gaps,
        F.when(recent, F.lit(IN_FLIGHT)).otherwise(F.lit(MISSING)),
        site="site",
        reference_site="reference_site",
        topic="topic",
        partition="partition",
        origin="origin",
        first_seq="first_missing",
        last_seq="known_max",
        records=F.col("known_max") - F.col("first_missing") + 1,
        detail=F.format_string(
            "behind %s: lacks seqs %d..%d; the first was appended at its origin at %s ms",
            "reference_site",
            "first_missing",
            "known_max",
            F.coalesce(F.col("appended_ms").cast("string"), F.lit("an unknown time")),
        ),
    )
    extra = streams.join(expected, ["topic", "origin_site", "site"], "left_anti")
    unexpected = as_issues(
        extra,
        UNEXPECTED,
        site="site",
        topic="topic",
        partition="partition",
        origin="origin",
        first_seq=F.lit(0),
        last_seq="held_max",
        records="records",
        detail=F.lit("the topology's links and filters do not lead this origin's records of this topic here"),
    )
    return tail.unionByName(unexpected)


def _hole_issues(df: DataFrame, base_seq: Column, base_offset: Column, after: str, **cols: Column | str) -> DataFrame:
    """``missing`` for each row of ``df`` whose batch (at ``base_seq``, ``base_offset``) starts above its column
    ``expect``: seqs ``expect..base_seq - 1`` are absent; ``after`` follows "hole" in the detail."""
    return as_issues(
        df.where(base_seq > F.col("expect")),
        MISSING,
        **cols,
        first_seq="expect",
        last_seq=base_seq - 1,
        records=base_seq - F.col("expect"),
        detail=F.format_string(
            f"hole{after}: seqs %d..%d absent, the log goes on at seq %d (offset %d)",
            F.col("expect"),
            base_seq - 1,
            base_seq,
            base_offset,
        ),
    )


def boundary_issues(batches: DataFrame, held_before: DataFrame) -> DataFrame:
    """An incremental audit's seam: each site's first batch of an origin after its previous cut must go on from
    what the site held then (``held_before``'s ``held_max``, as :func:`reach_issues` takes it). Starting above
    leaves a hole (``missing``); starting at or below holds seqs again (``duplicate``). ``batches``: only the
    batches read past each site's previous cut."""
    first = (
        ok_batches(batches)
        .groupBy(*SITE_STREAM)
        .agg(F.min_by(F.struct("base_seq", "last_seq", "base_offset", "file", "position"), "base_offset").alias("b"))
        .join(held_before.select(*SITE_STREAM, "held_max"), SITE_STREAM)
        .withColumn("expect", F.col("held_max") + 1)
    )
    common = {"site": "site", "topic": "topic", "partition": "partition", "origin": "origin"}
    where = {"offset": F.col("b.base_offset"), "file": F.col("b.file"), "position": F.col("b.position")}
    hole = _hole_issues(
        first, F.col("b.base_seq"), F.col("b.base_offset"), " after the previous cut", **common, **where
    )
    again = F.least(F.col("b.last_seq"), F.col("held_max"))
    dup = as_issues(
        first.where(F.col("b.base_seq") < F.col("expect")),
        DUPLICATE,
        **common,
        **where,
        first_seq=F.col("b.base_seq"),
        last_seq=again,
        records=again - F.col("b.base_seq") + 1,
        detail=F.format_string(
            "seqs %d..%d held again at offset %d, after the previous cut", "b.base_seq", again, "b.base_offset"
        ),
    )
    return hole.unionByName(dup)


def batch_mismatches(batches: DataFrame) -> DataFrame:
    """I1: copies of one batch (same stream and seq range) whose bytes differ, and re-cut batches.

    The reference copy is the origin site's, else the most common CRC (ties:
    lowest CRC). Every other copy is a ``mismatch`` at its site, first_seq at
    the batch's first seq until :func:`first_record_differences` narrows it.
    A batch whose seq range the origin holds cut differently is a mismatch too:
    its bytes cannot be the origin's.
    """
    ok = ok_batches(batches)
    crcs = ok.groupBy(*BATCH_KEY, "crc").agg(
        F.count("*").alias("copies"), F.max(F.col("site") == F.col("origin_site")).alias("at_origin")
    )
    rank = Window.partitionBy(*BATCH_KEY).orderBy(F.desc("at_origin"), F.desc("copies"), "crc")
    keyed = crcs.withColumn("n_crcs", F.count("*").over(Window.partitionBy(*BATCH_KEY)))
    ref = keyed.where(F.col("n_crcs") > 1).withColumn("r", F.row_number().over(rank)).where("r = 1")
    ref_site = (
        ok.join(ref.select(*BATCH_KEY, "crc"), [*BATCH_KEY, "crc"])
        .groupBy(*BATCH_KEY)
        .agg(
            F.min_by("site", F.struct(F.col("site") != F.col("origin_site"), "site")).alias("reference_site"),
            F.first("crc").alias("ref_crc"),
        )
    )
    differ = ok.join(ref_site, BATCH_KEY).where(F.col("crc") != F.col("ref_crc"))
    copies = as_issues(
        differ,
        MISMATCH,
        site="site",
        reference_site="reference_site",
        topic="topic",
        partition="partition",
        origin="origin",
        first_seq="base_seq",
        last_seq="last_seq",
        records="records",
        offset="base_offset",
        file="file",
        position="position",
        node="node",
        segment="segment",
        detail=F.format_string("batch CRC 0x%08x, 0x%08x at %s", "crc", "ref_crc", "reference_site"),
    )
    at_origin = ok.where(F.col("site") == F.col("origin_site"))
    origin_held = site_streams(at_origin).select(*STREAM, "held_max")
    recut = (
        ok.where(F.col("site") != F.col("origin_site"))
        .join(at_origin.select(*BATCH_KEY), BATCH_KEY, "left_anti")
        .join(origin_held, STREAM)
        .where(F.col("base_seq") <= F.col("held_max"))
    )
    cut = as_issues(
        recut,
        MISMATCH,
        site="site",
        reference_site="origin_site",
        topic="topic",
        partition="partition",
        origin="origin",
        first_seq="base_seq",
        last_seq="last_seq",
        records="records",
        offset="base_offset",
        file="file",
        position="position",
        node="node",
        segment="segment",
        detail=F.format_string(
            "batch of seqs %d..%d: the origin %s cut these seqs into other batches",
            "base_seq",
            "last_seq",
            "origin_site",
        ),
    )
    return copies.unionByName(cut)


def first_record_differences(mismatches: DataFrame, records: DataFrame) -> DataFrame:
    """Narrow batch ``mismatch`` issues to the first record that differs from the reference copy.

    ``records``: the record-level view of the mismatching batches and of the
    reference's batches over the same seqs. A mismatch whose records all agree
    (a header field differs, or the batch is cut differently) keeps its batch
    range, and its detail says so.
    """
    ok = records.where(F.col("status") == "ok").select(
        "site", *STREAM, "origin_seq", "record_hash", F.col("offset").alias("record_offset")
    )
    mine = ok
    theirs = ok.select(
        F.col("site").alias("reference_site"), *STREAM, "origin_seq", F.col("record_hash").alias("ref_hash")
    )
    issues = mismatches
    joined = (
        issues.join(mine, [*SITE_STREAM])
        .where(F.col("origin_seq").between(F.col("first_seq"), F.col("last_seq")))
        .join(theirs, ["reference_site", *STREAM, "origin_seq"])
        .where(F.col("record_hash") != F.col("ref_hash"))
        .groupBy("site", "reference_site", *STREAM, "first_seq")
        .agg(
            F.min_by(F.struct("origin_seq", "record_offset", "record_hash", "ref_hash"), "origin_seq").alias("d"),
            F.max("origin_seq").alias("last_differing"),
            F.count("*").alias("differing"),
        )
    )
    narrowed = (
        issues.join(joined, ["site", "reference_site", *STREAM, "first_seq"], "left")
        .withColumn("first_seq", F.coalesce(F.col("d.origin_seq"), F.col("first_seq")))
        .withColumn("last_seq", F.coalesce(F.col("last_differing"), F.col("last_seq")))
        .withColumn("offset", F.coalesce(F.col("d.record_offset"), F.col("offset")))
        .withColumn("records", F.coalesce(F.col("differing"), F.col("records")))
        .withColumn(
            "detail",
            F.when(
                F.col("d").isNotNull(),
                F.format_string(
                    "record differs (hash 0x%08x, 0x%08x at %s); %d record(s) of the batch differ",
                    "d.record_hash",
                    "d.ref_hash",
                    "reference_site",
                    "differing",
                ),
            ).otherwise(F.concat(F.col("detail"), F.lit("; the records themselves are identical"))),
        )
    )
    return narrowed.select(*ISSUE_SCHEMA.fieldNames())


def summary_by_kind(issues: DataFrame) -> DataFrame:
    """Per (reference site, site, origin, kind): issues, records, and the first coordinate."""
    return issues.groupBy("reference_site", "site", "origin", "kind").agg(
        F.min(F.struct("topic", "partition", "first_seq")).alias("first"),
        F.max("divergence").alias("divergence"),
        F.sum("records").alias("records"),
        F.count("*").alias("issues"),
    )
