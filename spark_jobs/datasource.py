"""The ``georep`` Spark data source: segment files of one or more sites, read in place.

::

    spark.dataSource.register(GeorepDataSource)
    df = (spark.read.format("georep")
          .option("sites", "a=/data/a,b=/data/b")     # or: .option("topology", FILE).option("dataRoot", DIR)
          .option("topics", "orders,audit/*")         # optional, fnmatch patterns
          .option("level", "records")                 # "records" (default) or "batches"
          .load())

No server is needed: each input partition is one segment file of one
(site, topic, partition), or at a multi-node site every node's copy of one
segment, listed on the driver with the size it had then, and read by
:mod:`spark_jobs.scan`, which yields ``pyarrow.RecordBatch`` es (the
``node`` and ``segment`` columns say which copy a row is from). The
option ``segments`` (JSON, from :func:`segments_option`) passes a listing made
earlier instead, so several reads see the same snapshot of live sites; option
``batchPositions`` (JSON ``{file: [byte position, ...]}``) limits a records
read to those batches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import DataType, IntegerType, LongType, StringType, StructField, StructType

from spark_jobs.layout import (
    AuditInputError,
    SegmentFile,
    list_segments,
    load_topology_for_audit,
    parse_site_dirs,
    site_dirs_from_topology,
)
from spark_jobs.progress import reported
from spark_jobs.scan import BATCH_SCHEMA, RECORD_SCHEMA, read_batches, read_records

NAME = "georep"
LEVELS = ("records", "batches")
_SPARK_TYPES: dict[pa.DataType, DataType] = {
    pa.string(): StringType(),
    pa.int32(): IntegerType(),
    pa.int64(): LongType(),
}


def spark_schema(schema: pa.Schema) -> StructType:
    return StructType([StructField(f.name, _SPARK_TYPES[f.type], True) for f in schema])


def segments_option(segments: Sequence[SegmentFile]) -> str:
    return json.dumps([dataclasses.asdict(s) for s in segments])


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    """Spark option names are case-insensitive, and reach the source lowercased: compare them so."""
    return {k.lower(): v for k, v in options.items()}


def segments_from_options(raw: Mapping[str, str]) -> list[SegmentFile]:
    """The segment files that the options name (see the module docstring)."""
    options = _lower(raw)
    topics = tuple(t.strip() for t in options.get("topics", "").split(",") if t.strip())
    if "segments" in options:
        return [SegmentFile(**s) for s in json.loads(options["segments"])]
    if "sites" in options:
        dirs = parse_site_dirs(options["sites"])
    elif "dataroot" in options:
        dirs = site_dirs_from_topology(load_topology_for_audit(options.get("topology")), Path(options["dataroot"]))
    else:
        raise AuditInputError("the georep data source needs option 'sites' (a=DIR,b=DIR) or 'dataRoot' [+ 'topology']")
    return list_segments(dirs, topics)


class SegmentPartition(InputPartition):
    """One segment file, or every copy of one segment of a multi-node site: read together, since each is small
    next to what an input partition costs, and the replica checks compare them anyway."""

    def __init__(self, segments: list[SegmentFile]) -> None:
        super().__init__([s.path for s in segments])
        self.segments = segments


def input_partitions(segments: Sequence[SegmentFile]) -> list[SegmentPartition]:
    groups: dict[tuple[str, str, int, int | str], list[SegmentFile]] = {}
    for s in segments:
        one = (s.site, s.topic, s.partition, s.path if s.segment_id is None else s.segment_id)
        groups.setdefault(one, []).append(s)
    return [SegmentPartition(g) for g in groups.values()]


class GeorepDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def _level(self) -> str:
        level = _lower(self.options).get("level", "records")
        if level not in LEVELS:
            raise AuditInputError(f"option level={level!r}: use one of {', '.join(LEVELS)}")
        return level

    def schema(self) -> StructType:
        return spark_schema(RECORD_SCHEMA if self._level() == "records" else BATCH_SCHEMA)

    def reader(self, schema: StructType) -> DataSourceReader:
        return GeorepReader(_lower(self.options), self._level())


class GeorepReader(DataSourceReader):
    def __init__(self, options: dict[str, str], level: str) -> None:
        self.options = options
        self.level = level
        wanted = json.loads(options["batchpositions"]) if "batchpositions" in options else None
        self.positions = None if wanted is None else {f: frozenset(p) for f, p in wanted.items()}

    def partitions(self) -> Sequence[InputPartition]:
        segments = segments_from_options(self.options)
        if self.positions is not None:
            segments = [s for s in segments if s.path in self.positions]
        return input_partitions(segments)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        for segment in partition.segments:
            if self.level == "records":
                positions = None if self.positions is None else self.positions[segment.path]
                yield from reported(read_records(segment, positions), self.options, segment.site)
            else:
                yield from reported(read_batches(segment), self.options, segment.site)


def register(spark: SparkSession) -> None:
    spark.dataSource.register(GeorepDataSource)
