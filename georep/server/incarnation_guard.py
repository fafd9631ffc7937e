"""Delete's data path on the wire: every pulled partition is of one incarnation of its topic (docs/design.md,
"Topic changes across sites", "The data path checks the incarnation").

A topic's incarnation counts the deletes of its name it has outlived. ``PullWant.incarnation`` is the one dst holds
live; src serves a want only if it holds the same one live, and stamps ``ReplicaChunk.incarnation`` with it. dst
applies a chunk only into its live partition of the same incarnation, and otherwise drops it, counts it and logs:
so no record of a deleted incarnation is ever stored in a partition of a later one, whatever a late (a site down
during the delete) or lying peer sends. Both fields are absent (0) from a node before incarnations, which is right
for every topic never deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from georep.metadata.store import MetadataStore, UnknownTopic
from georep.proto import georep_pb2 as pb

log = logging.getLogger(__name__)


def live_incarnation(metadata: MetadataStore, topic: str) -> int | None:
    """The incarnation of ``topic`` live at this site, or None (unknown here, or deleted)."""
    try:
        return metadata.get(topic).incarnation
    except UnknownTopic:
        return None


def servable_wants(
    metadata: MetadataStore, wants: Iterable[pb.PullWant], dst: str
) -> tuple[list[pb.PullWant], dict[str, int]]:
    """The wants src serves, and the incarnation of each of their topics (what its chunks carry): those of the
    incarnation src holds live, or of a topic src does not know (which fail as they did before). A want left out
    gets no chunk, and is logged; the topic sync brings the two sites to the same entry, then dst asks for the
    incarnation both hold."""
    served: list[pb.PullWant] = []
    incarnations: dict[str, int] = {}
    for want in wants:
        live = live_incarnation(metadata, want.topic)
        if live is not None and live != want.incarnation:
            log.info(
                "site %s wants %s-%d of incarnation %d; this site holds incarnation %d live: not served until the "
                "topic sync brings the sites to one entry",
                dst or "?",
                want.topic,
                want.partition,
                want.incarnation,
                live,
            )
            continue
        served.append(want)
        incarnations[want.topic] = want.incarnation
    return served, incarnations


class ChunkGuard:
    """dst's check of each pulled chunk, for one inbound link: what the stream asked for, and the drops."""

    def __init__(self, metadata: MetadataStore, src: str) -> None:
        self.metadata = metadata
        self.src = src
        self.asked: dict[str, int] = {}  # topic -> the incarnation the open stream's wants carry
        self.dropped_chunks = 0  # georep_replication_incarnation_dropped_chunks
        self._logged: set[tuple[str, int]] = set()  # (topic, incarnation) already logged: one line each

    def want_incarnation(self, topic: str) -> int:
        """The incarnation a want of ``topic`` carries (the live one; 0 for a topic unknown here, which no want
        names), remembered for the chunks that answer it."""
        incarnation = live_incarnation(self.metadata, topic) or 0
        self.asked[topic] = incarnation
        return incarnation

    def admit(self, chunks: Iterable[pb.ReplicaChunk]) -> list[pb.ReplicaChunk]:
        """The chunks that may be applied: of the incarnation asked for, which is still the live one."""
        kept = []
        for c in chunks:
            live = live_incarnation(self.metadata, c.topic)
            if live is not None and c.incarnation == live and self.asked.get(c.topic) == live:
                kept.append(c)
                continue
            self.dropped_chunks += 1
            if (c.topic, c.incarnation) not in self._logged:
                self._logged.add((c.topic, c.incarnation))
                log.warning(
                    "site %s sent a chunk of topic %r incarnation %d; this site holds %s live: dropped (counted in "
                    "georep_replication_incarnation_dropped_chunks; the topic sync brings the sites to one entry)",
                    self.src,
                    c.topic,
                    c.incarnation,
                    "no incarnation" if live is None else f"incarnation {live}",
                )
        return kept

    def still_live(self, topic: str) -> bool:
        """Whether the incarnation asked for is still the live one: checked again just before an apply, since the
        topic may have been deleted (and re-created) while the chunk waited."""
        return live_incarnation(self.metadata, topic) == self.asked.get(topic)
