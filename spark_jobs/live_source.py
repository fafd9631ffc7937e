"""The ``georep-live`` Spark data source: batch digests read from live sites over mutual TLS.

::

    spark.dataSource.register(LiveDataSource)
    df = (spark.read.format("georep-live")
          .option("slices", slices_option(slices))       # from plan_slices(cut, starts)
          .options(**tls_options(TlsConfig(...)))        # PEM contents; or .option("insecure", "true")
          .load())

Each input partition is one :class:`Slice`: a range ``[from_offset, to_offset)`` of local offsets of one
(site, topic, partition), read from one node with the ``ScanDigests`` RPC. An executor needs nothing but the
network path to that node and the TLS material, which travels in the options as PEM text: no shared
filesystem, no file to ship. The private key's option is named ``tlsKeySecret`` so that Spark's
``spark.redaction.regex`` (default ``(?i)secret|password|token|access[.]?key``) hides it where Spark shows options.

Rows are :data:`LIVE_SCHEMA`: the file audit's ``BATCH_SCHEMA`` (one row per stored batch, with the same
columns, so the same checks run on them), where ``file`` is a coordinate of the copy,
``site/topic/partition@node-address:segment``, and ``position`` the byte position in that segment; plus
``digest_bytes``, the bytes the digest took on the wire (what the audit moved, against ``size_bytes`` stored).

A slice with ``all_replicas`` asks a multi-node site for every member's copy of the range (the replica check):
one row per copy of each batch, ``node`` naming the member.

A big range is split into slices of at most ``max_slice_offsets`` offsets, read in parallel. A batch belongs to
the slice its base offset falls in (the first slice of a range also takes the batch that holds its start), so a
batch that straddles a split is read once.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from georep.client.audit import scan_digests
from georep.client.errors import GeorepError, OffsetOutOfRange
from georep.proto import georep_pb2 as pb
from georep.security.tls import MESSAGE_OPTIONS, TlsConfig
from spark_jobs.datasource import spark_schema
from spark_jobs.layout import AuditInputError
from spark_jobs.progress import reported
from spark_jobs.scan import BATCH_SCHEMA, OK

NAME = "georep-live"
LIVE_SCHEMA = BATCH_SCHEMA.append(pa.field("digest_bytes", pa.int64()))
MAX_SLICE_OFFSETS = 1_000_000
DIGESTS_PER_MESSAGE = 4_096
CALL_TIMEOUT_S = 3_600.0  # one slice's whole stream; the node paces it (audit_digest_rate)
TLS_OPTIONS = ("tlsca", "tlscert", "tlskeysecret")
UNREADABLE_WAIT_S = 30.0
UNREADABLE_POLL_S = 0.2
DIGEST_FRAMING_BYTES = 3  # a digest's field tag and length prefix in its response message


@dataclass(frozen=True, slots=True)
class Slice:
    """One input partition: ``[from_offset, to_offset)`` of (site, topic, partition), read at ``address``.

    ``first``: the first slice of its partition's audited range (it also takes the batch holding ``from_offset``);
    ``audited_from``: where that range starts, which the rows give as ``log_start_offset`` when it is above the
    log's own (an incremental audit: the checks then look for no hole before the range; the previous cut's
    vectors check its boundary); ``all_replicas``: at a multi-node site, every member's copy of each segment, one
    row per copy (``node`` names it), for the replica check; else the copy the site serves."""

    site: str
    address: str
    topic: str
    partition: int
    from_offset: int
    to_offset: int
    first: bool = True
    audited_from: int = 0
    all_replicas: bool = False


def plan_slices(
    ranges: Sequence[tuple[str, str, str, int, int, int]],
    max_slice_offsets: int = MAX_SLICE_OFFSETS,
    all_replicas: bool = False,
) -> list[Slice]:
    """Slices for (site, address, topic, partition, start, end) ranges; empty ranges make none. ``all_replicas``:
    slices of every copy (see :class:`Slice`)."""
    if max_slice_offsets < 1:
        raise AuditInputError(f"max_slice_offsets {max_slice_offsets}: give a positive number of offsets")
    out = []
    for site, address, topic, partition, start, end in ranges:
        at = start
        while at < end:
            stop = min(end, at + max_slice_offsets)
            out.append(Slice(site, address, topic, partition, at, stop, at == start, start, all_replicas))
            at = stop
    return out


def pack(slices: Sequence[Slice], max_offsets: int = MAX_SLICE_OFFSETS) -> list[list[Slice]]:
    """Slices grouped into input partitions of one node each and at most ``max_offsets`` offsets (a slice
    alone may reach it): 10,000 small partitions make a few tasks, not 10,000."""
    groups: dict[tuple[str, str], list[list[Slice]]] = {}
    for s in slices:
        packs = groups.setdefault((s.site, s.address), [[]])
        held = sum(x.to_offset - x.from_offset for x in packs[-1])
        if packs[-1] and held + s.to_offset - s.from_offset > max_offsets:
            packs.append([])
        packs[-1].append(s)
    return [p for key in sorted(groups) for p in groups[key] if p]


def slices_option(slices: Sequence[Slice], max_offsets: int = MAX_SLICE_OFFSETS) -> str:
    return json.dumps([[dataclasses.astuple(s) for s in group] for group in pack(slices, max_offsets)])


def slices_from_option(text: str) -> list[list[Slice]]:
    try:
        return [[Slice(*row) for row in group] for group in json.loads(text)]
    except (ValueError, TypeError) as exc:
        raise AuditInputError(f"option slices of {NAME}: not a list of slices ({exc}); use slices_option()") from None


def tls_options(tls: TlsConfig | None) -> dict[str, str]:
    """The options that carry ``tls`` to the executors: the three PEM files' contents (read now)."""
    if tls is None:
        return {"insecure": "true"}
    ca, cert, key = tls.read()
    out = {"tlsCa": ca.decode(), "tlsCert": cert.decode(), "tlsKeySecret": key.decode()}
    if tls.server_name:
        out["tlsServerName"] = tls.server_name
    return out


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in options.items()}


def open_channel(address: str, options: Mapping[str, str]) -> grpc.Channel:
    """A blocking channel to ``address`` with the TLS of lowercased ``options`` (see :func:`tls_options`)."""
    given = [k for k in TLS_OPTIONS if options.get(k)]
    if options.get("insecure", "").lower() == "true":
        if given:
            raise AuditInputError(f"{NAME}: option insecure and the TLS options contradict each other: pass one")
        return grpc.insecure_channel(address, options=list(MESSAGE_OPTIONS))
    if len(given) < len(TLS_OPTIONS):
        raise AuditInputError(
            f"{NAME} needs options tlsCa, tlsCert and tlsKeySecret (PEM text: tls_options(TlsConfig(...))), "
            "or insecure=true for nodes started with --insecure"
        )
    creds = grpc.ssl_channel_credentials(
        root_certificates=options["tlsca"].encode(),
        private_key=options["tlskeysecret"].encode(),
        certificate_chain=options["tlscert"].encode(),
    )
    extra: list[tuple[str, Any]] = list(MESSAGE_OPTIONS)
    if options.get("tlsservername"):
        extra.append(("grpc.ssl_target_name_override", options["tlsservername"]))
    return grpc.secure_channel(address, creds, options=extra)


def _row_values(s: Slice, d: pb.BatchDigest, wire: int) -> list[Any]:
    ok = d.status == OK
    return [
        s.site,
        s.topic,
        s.partition,
        d.node or None,
        d.segment,
        f"{s.site}/{s.topic}/{s.partition}@{d.node or s.address}:{d.segment}",
        d.position,
        d.status,
        d.error or None,
        f"{d.origin_site}@{d.origin_epoch}" if ok else None,
        d.origin_site if ok else None,
        d.origin_epoch if ok else None,
        d.append_time_ms if ok else None,
        max(d.log_start_offset, s.audited_from),
        d.base_offset,
        d.base_seq if ok else None,
        d.last_seq if ok else None,
        d.records if ok else None,
        d.size_bytes,
        d.crc if ok else None,
        d.first_timestamp_ms if ok else None,
        d.max_timestamp_ms if ok else None,
        wire,
    ]


def _arrow(rows: list[list[Any]]) -> pa.RecordBatch:
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, LIVE_SCHEMA, strict=True)], schema=LIVE_SCHEMA
    )


def read_slice(s: Slice, channel: grpc.Channel) -> Iterator[pa.RecordBatch]:
    """The digests of one slice, in Arrow batches of at most ``DIGESTS_PER_MESSAGE`` rows.

    The cut's end may lie a few batches past what the node serves yet (what it appended but has not fsynced,
    or its quorum not confirmed): the node refuses such a range (OUT_OF_RANGE) before it sends anything, and the
    slice is asked again until it is readable, for at most ``UNREADABLE_WAIT_S``."""
    deadline = time.monotonic() + UNREADABLE_WAIT_S
    sent = False  # rows yielded: a retry would yield them again
    while True:
        digests = scan_digests(
            channel,
            s.topic,
            s.partition,
            s.from_offset,
            s.to_offset,
            s.all_replicas,
            max_digests=DIGESTS_PER_MESSAGE,
            timeout_s=CALL_TIMEOUT_S,
        )
        rows: list[list[Any]] = []
        try:
            for d in digests:
                if d.base_offset >= s.to_offset or (not s.first and d.base_offset < s.from_offset):
                    continue  # another slice's batch
                rows.append(_row_values(s, d, d.ByteSize() + DIGEST_FRAMING_BYTES))
                if len(rows) >= DIGESTS_PER_MESSAGE:
                    yield _arrow(rows)
                    rows, sent = [], True
        except OffsetOutOfRange as exc:
            if not sent and time.monotonic() < deadline:
                time.sleep(UNREADABLE_POLL_S)
                continue
            raise _failed(s, exc) from None
        except GeorepError as exc:
            raise _failed(s, exc) from None
        if rows:
            yield _arrow(rows)
        return


def _failed(s: Slice, exc: GeorepError) -> AuditInputError:
    every = " of every replica (the replica check of a multi-node site)" if s.all_replicas else ""
    return AuditInputError(
        f"ScanDigests{every} of {s.topic}/{s.partition} [{s.from_offset}, {s.to_offset}) at site {s.site} "
        f"({s.address}) failed: {exc}"
        + ("; to audit the site without comparing its replicas, pass --no-replica-check" if s.all_replicas else "")
    )


class SlicePartition(InputPartition):
    def __init__(self, slices: list[Slice]) -> None:
        super().__init__([dataclasses.astuple(s) for s in slices])
        self.slices = slices


class LiveDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return spark_schema(LIVE_SCHEMA)

    def reader(self, schema: StructType) -> DataSourceReader:
        return LiveReader(_lower(self.options))


class LiveReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        if "slices" not in options:
            raise AuditInputError(f"the {NAME} data source needs option slices (slices_option(plan_slices(...)))")
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        return [SlicePartition(group) for group in slices_from_option(self.options["slices"])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SlicePartition)
        with open_channel(partition.slices[0].address, self.options) as channel:
            for s in partition.slices:
                yield from reported(read_slice(s, channel), self.options, s.site)


def register(spark: SparkSession) -> None:
    spark.dataSource.register(LiveDataSource)
