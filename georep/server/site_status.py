"""The answer to ``SiteStatus``: a summary per topic and per link, and per-partition rows only on request.

A site with 10,000 partitions answers with one ``TopicSummary`` per topic (lag totals, partitions behind,
damaged batches, a digest of the partitions' vectors) and each inbound link's lag totals, all computed from what
the logs and the replicator hold now. The per-partition rows (``SiteStatusRequest.partitions``) come filtered by
topic and paged, so no answer has to carry every partition. Two sites whose digests of a topic are equal hold the
same vectors for each of its partitions: ``georep status`` compares digests and asks for rows only where they differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from georep.proto import georep_pb2 as pb
from georep.proto.convert import damaged_to_proto, vector_to_proto
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.filters import is_internal

if TYPE_CHECKING:
    from georep.server.broker import Broker
    from georep.server.replicator import Replicator
    from georep.storage.api import PartitionLog

DIGEST_BYTES = 16


@dataclass(slots=True)
class _Topic:
    summary: pb.TopicSummary
    digest: hashlib.blake2b = field(default_factory=lambda: hashlib.blake2b(digest_size=DIGEST_BYTES))


def vector_digest_entry(index: int, vector: Mapping[Origin, int]) -> bytes:
    """One partition's part of its topic's ``vector_digest`` (the partitions are hashed in index order)."""
    return f"{index}:{','.join(f'{o}={s}' for o, s in sorted(vector.items(), key=lambda e: str(e[0])))};".encode()


def answer(broker: Broker, replicator: Replicator | None, req: pb.SiteStatusRequest) -> pb.SiteStatusResponse:
    identity = broker.identity
    out = pb.SiteStatusResponse(site=identity.site, epoch=identity.epoch)
    topics: dict[str, _Topic] = {}
    links = _LinkLags()
    after = (req.after_topic, req.after_partition) if req.after_topic else None
    for key, p in sorted(broker.partitions.items()):
        topic, index = key
        if (req.topic and topic != req.topic) or (after is not None and key <= after):
            continue
        full = req.page_size > 0 and len(out.partitions) >= req.page_size
        if after is not None and full:  # a later page carries rows only: the summary came with the first
            out.more_partitions = True
            break
        log = p.log
        vector = log.vector()
        damaged = log.damaged_batches()
        lag = replicator.links.lag_records(key) if replicator is not None else {}
        if after is None:
            _summarize(topics, links, replicator, key, log, vector, len(damaged), lag)
        if not req.partitions:
            continue
        if full:
            out.more_partitions = True
            continue
        row = pb.PartitionStatus(
            topic=topic,
            partition=index,
            vector=vector_to_proto(VectorOffset(vector)),
            log_end_offset=log.log_end_offset,
            damaged=damaged_to_proto(damaged),
        )
        if replicator is not None:
            _add_lags(row, replicator, log, vector, lag)
        out.partitions.append(row)
    if replicator is not None:
        for (topic, _index, origin), ms in replicator.lag_ms.items():
            if topic in topics:
                topics[topic].summary.lag_ms = max(topics[topic].summary.lag_ms, ms)
                links.add_ms(replicator, topic, origin, ms)
    for t in topics.values():
        t.summary.vector_digest = t.digest.digest()
        out.topics.append(t.summary)
    if replicator is not None and after is None:
        _add_links(out, replicator, links)
    return out


def _summarize(
    topics: dict[str, _Topic],
    links: _LinkLags,
    replicator: Replicator | None,
    key: tuple[str, int],
    log: PartitionLog,
    vector: Mapping[Origin, int],
    damaged: int,
    lag: Mapping[Origin, int],
) -> None:
    topic, index = key
    t = topics.get(topic)
    if t is None:
        t = topics[topic] = _Topic(pb.TopicSummary(topic=topic))
    s = t.summary
    s.partitions += 1
    s.log_end_offset += log.log_end_offset
    s.damaged_batches += damaged
    s.partitions_damaged += 1 if damaged else 0
    t.digest.update(vector_digest_entry(index, vector))
    behind = sum(lag.values())
    if behind and replicator is not None:
        s.lag_records += behind
        s.lag_bytes += round(behind * replicator.bytes_per_record(topic, index))
        s.partitions_behind += 1
        links.add(replicator, topic, lag)


def _add_lags(
    row: pb.PartitionStatus,
    replicator: Replicator,
    log: PartitionLog,
    vector: Mapping[Origin, int],
    lag: Mapping[Origin, int],
) -> None:
    topic, index = row.topic, row.partition
    records = log.log_end_offset - log.log_start_offset
    per_record = log.size_bytes / records if records > 0 else 0.0
    for origin in sorted(set(vector) | set(lag)):
        upstream = "" if origin == replicator.broker.origin else replicator.links.upstream_for(topic, origin.site)
        row.lags.append(
            pb.OriginLag(
                origin=str(origin),
                upstream=upstream or "",
                lag_records=lag.get(origin, 0),
                lag_ms=replicator.lag_ms.get((topic, index, origin), 0),
                lag_bytes=round(lag.get(origin, 0) * per_record),
            )
        )


class _LinkLags:
    """Lag totals per upstream, each (topic, origin)'s upstream routed once per answer, not once per partition."""

    def __init__(self) -> None:
        self.records: dict[str, int] = {}
        self.ms: dict[str, int] = {}
        self.behind: dict[str, int] = {}
        self._routes: dict[tuple[str, Origin], str] = {}

    def upstream(self, replicator: Replicator, topic: str, origin: Origin) -> str:
        found = self._routes.get((topic, origin))
        if found is None:
            found = self._routes[(topic, origin)] = replicator.links.upstream_for(topic, origin.site) or ""
        return found

    def add(self, replicator: Replicator, topic: str, lag: Mapping[Origin, int]) -> None:
        counted: set[str] = set()
        for origin, n in lag.items():
            if n <= 0 or origin == replicator.broker.origin:
                continue
            src = self.upstream(replicator, topic, origin)
            self.records[src] = self.records.get(src, 0) + n
            if src not in counted:
                counted.add(src)
                self.behind[src] = self.behind.get(src, 0) + 1

    def add_ms(self, replicator: Replicator, topic: str, origin: Origin, ms: int) -> None:
        src = self.upstream(replicator, topic, origin)
        self.ms[src] = max(self.ms.get(src, 0), ms)


def _add_links(out: pb.SiteStatusResponse, r: Replicator, lags: _LinkLags) -> None:
    for src, puller in sorted(r.pullers.items()):
        st = puller.stats
        out.links.append(
            pb.LinkStatus(
                src=src,
                dst=r.site,
                state=r.link_state(src),
                applied_batches=st.applied_batches,
                applied_bytes=st.applied_bytes,
                skipped_batches=st.skipped_batches,
                last_error=st.last_error or r.links.links[src].last_error,
                lag_records=lags.records.get(src, 0),
                lag_ms=lags.ms.get(src, 0),
                partitions_behind=lags.behind.get(src, 0),
                streams_opened=st.streams_opened,
                reopens=st.reopens,
                **_interests(r, src),
            )
        )
    for (topic, _src), message in sorted(r.conflicts.items()):
        out.conflicts.append(pb.TopicConflict(topic=topic, message=message))
    changes = r.topic_changes
    out.config_conflicts.extend(pb.TopicConflict(topic=c.topic, message=c.describe()) for c in changes.conflicts)
    out.config_conflicts_total = changes.conflicts_total


def _interests(r: Replicator, src: str) -> dict[str, Any]:
    """A link in mode "interest": what this site asks ``src`` for, and how many topics its stream pulls now."""
    if src not in r.interest_links.upstreams:
        return {}
    streaming = r.pullers[src].session.streaming  # type: ignore[index]
    topics = {topic for topic, _partition in streaming if not is_internal(topic)}  # those go always
    return {"interests": r.interest_links.describe(src), "interest_topics": len(topics)}
