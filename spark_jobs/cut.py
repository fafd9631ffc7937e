"""The live audit's cut: every site's vector and local end offset per partition, taken at one moment.

The cut is step 1 of ``georep audit --live`` (docs/audit.md, "The live audit"). The driver asks every node of
every site at once for ``SiteStatus`` with its partition rows (paged, :data:`PAGE_SIZE` rows an answer: at 10,000
partitions ten small answers per node, and no record read). Each row gives the partition's vector (what the site
holds, per origin) and its log end offset, read together on the node, so they describe the same log. The cut then
fixes, for each site and partition, the range of local offsets the audit reads, ``[start, end)``: from 0 (or the
previous cut's end, for ``--since``) to the end the cut saw. Records appended after the cut are not audited, so
the sites are compared as of the cut, however long the digests take to read.

A multi-node site's nodes each answer for the partitions they serve (lead); the row with the furthest end stands
for the site, and its node is the one the digests are read from.

The cut is stored in ``report.json`` (``cut``), so a later ``--since`` run starts where it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from spark_jobs.layout import AuditInputError, topic_matches
from topology.model import Topology

PAGE_SIZE = 1_000
TIMEOUT_S = 30.0
CUT_FORMAT = 1

PartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class PartitionCut:
    """One partition at one site as of the cut: the exclusive end of its log and its vector."""

    end_offset: int
    vector: Mapping[str, int]  # origin ("site@epoch") -> next origin seq held
    address: str  # the node that answered for it, where its digests are read


@dataclass(frozen=True, slots=True)
class SiteCut:
    site: str
    epoch: int
    partitions: Mapping[PartitionKey, PartitionCut]


@dataclass(frozen=True, slots=True)
class Cut:
    taken_at_ms: int
    sites: Mapping[str, SiteCut]
    took_ms: int = 0
    topics: tuple[str, ...] = field(default=())  # the --topics patterns it was taken for (empty: every topic)

    def to_json(self) -> dict[str, Any]:
        """As stored in report.json: per site, per topic, per partition ``[end_offset, {origin: next seq}]``."""
        sites: dict[str, Any] = {}
        for name, s in sorted(self.sites.items()):
            topics: dict[str, dict[str, Any]] = {}
            for (topic, partition), p in sorted(s.partitions.items()):
                topics.setdefault(topic, {})[str(partition)] = [p.end_offset, dict(sorted(p.vector.items())), p.address]
            sites[name] = {"epoch": s.epoch, "topics": topics}
        return {
            "format": CUT_FORMAT,
            "taken_at_ms": self.taken_at_ms,
            "took_ms": self.took_ms,
            "topics": list(self.topics),
            "sites": sites,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Cut:
        """Raises AuditInputError for a document that is not a cut of this format."""
        try:
            if doc["format"] != CUT_FORMAT:
                raise AuditInputError(f"the report's cut has format {doc['format']}, this georep reads {CUT_FORMAT}")
            sites = {}
            for name, s in doc["sites"].items():
                parts = {
                    (topic, int(p)): PartitionCut(int(v[0]), {str(o): int(n) for o, n in v[1].items()}, str(v[2]))
                    for topic, ps in s["topics"].items()
                    for p, v in ps.items()
                }
                sites[str(name)] = SiteCut(str(name), int(s["epoch"]), parts)
            return cls(int(doc["taken_at_ms"]), sites, int(doc.get("took_ms", 0)), tuple(doc.get("topics", ())))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise AuditInputError(f"the report's cut is malformed ({type(exc).__name__}: {exc})") from None


async def _node_rows(address: str, tls: TlsConfig | None) -> tuple[int, list[pb.PartitionStatus]]:
    """The site epoch and every partition row one node serves, page after page."""
    async with client_channel(address, tls) as channel:
        stub = pbg.NodeStub(channel)
        req = pb.SiteStatusRequest(partitions=True, page_size=PAGE_SIZE)
        answer = await stub.SiteStatus(req, timeout=TIMEOUT_S)
        epoch, rows = answer.epoch, list(answer.partitions)
        while answer.more_partitions and answer.partitions:
            req.after_topic, req.after_partition = rows[-1].topic, rows[-1].partition
            answer = await stub.SiteStatus(req, timeout=TIMEOUT_S)
            rows.extend(answer.partitions)
        return epoch, rows


def _vector(v: pb.VectorOffset) -> dict[str, int]:
    return {f"{e.site}@{e.epoch}": e.next_seq for e in v.entries}


async def _site_cut(site: str, addresses: Iterable[str], tls: TlsConfig | None, topics: tuple[str, ...]) -> SiteCut:
    answers = await asyncio.gather(*(_node_rows(a, tls) for a in addresses), return_exceptions=True)
    parts: dict[PartitionKey, PartitionCut] = {}
    epoch = 0
    problems = []
    for address, answer in zip(addresses, answers, strict=True):
        if isinstance(answer, BaseException):
            what = f"{answer.code().name} {answer.details()}" if isinstance(answer, grpc.aio.AioRpcError) else answer
            problems.append(f"{address}: {what}")
            continue
        epoch = max(epoch, answer[0])
        for row in answer[1]:
            if not topic_matches(row.topic, topics):
                continue
            key = (row.topic, row.partition)
            if key not in parts or row.log_end_offset > parts[key].end_offset:
                parts[key] = PartitionCut(row.log_end_offset, _vector(row.vector), address)
    if len(problems) == len(answers):
        raise AuditInputError(
            f"site {site} did not answer ({'; '.join(problems)}): start it, or check the topology's addresses "
            "and the TLS flags (--tls-dir, --principal)"
        )
    return SiteCut(site, epoch, parts)


async def take_cut(topology: Topology, tls: TlsConfig | None, topics: tuple[str, ...] = ()) -> Cut:
    """Every site's partitions at once. Raises AuditInputError when a site does not answer at all."""
    started = time.monotonic()
    taken_at_ms = int(time.time() * 1000)
    sites = topology.site_ids()
    cuts = await asyncio.gather(
        *(_site_cut(s, list(topology.site(s).nodes), tls, topics) for s in sites), return_exceptions=True
    )
    errors = [c for c in cuts if isinstance(c, BaseException)]
    if errors:
        if all(isinstance(e, AuditInputError) for e in errors):
            raise AuditInputError("; ".join(str(e) for e in errors))
        raise errors[0]
    took_ms = round((time.monotonic() - started) * 1000)
    return Cut(taken_at_ms, {c.site: c for c in cuts if isinstance(c, SiteCut)}, took_ms, topics)


def start_offsets(cut: Cut, since: Cut | None) -> dict[tuple[str, str, int], int]:
    """Where each (site, topic, partition) of ``cut`` is read from: 0, or the end ``since`` saw when that cut is of
    the same site incarnation (epoch) and its end is not past the log's end now (else the log was cut back or
    rebuilt, and is read whole)."""
    out: dict[tuple[str, str, int], int] = {}
    for site, s in cut.sites.items():
        before = since.sites.get(site) if since is not None else None
        for key, p in s.partitions.items():
            start = 0
            if before is not None and before.epoch == s.epoch and key in before.partitions:
                end_then = before.partitions[key].end_offset
                start = end_then if end_then <= p.end_offset else 0
            out[(site, *key)] = start
    return out
