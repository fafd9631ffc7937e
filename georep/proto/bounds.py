"""Bounds on every repeated field of every request, checked as a request is parsed (shell side).

gRPC's message size limit bounds a request's bytes, but not what a handler
does with it: a 60 MiB request of empty entries is millions of loop turns,
dictionary entries and log lines. Every repeated (and map) field of every
request message is therefore bounded, whether the table below names it or
not (:data:`REPEATED_DEFAULT_MAX`). A request over a bound is refused whole
with ``InvalidRequest`` naming the field, its count and the bound; nothing
of it is applied.
"""

from __future__ import annotations

from functools import cache

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from georep.broker.errors import InvalidRequest
from georep.metadata.topics import PARTITIONS_MAX

REPEATED_DEFAULT_MAX = 1_000

# message.field -> the most entries a correct client sends, with room to spare
REPEATED_MAX: dict[str, int] = {
    "VectorOffset.entries": 10_000,  # one per origin: sites x their epochs
    "PullWant.origin_sites": 1_000,  # sites
    "ReplicateRequest.wants": 1_000_000,  # partitions a link carries
    "ReportHeldRequest.entries": 1_000_000,  # sites x partitions
    "TopicPartitions.partitions": PARTITIONS_MAX,
    "GroupHeartbeatRequest.topics": 10_000,
    "CommitOffsetsRequest.commits": 100_000,
    "FetchCommittedRequest.partitions": 10_000,  # topics
    "CreateTopicRequest.config": 64,  # unknown keys are refused anyway
    "ProduceRequest.batches": 1_000,  # one multi-batch request (georep/server/produce_stream.py)
}


@cache
def _has_repeated(descriptor: Descriptor) -> bool:
    """Whether a message of this type can hold a repeated field, at any depth (recursion-safe)."""
    seen: set[str] = set()
    todo = [descriptor]
    while todo:
        d = todo.pop()
        if d.full_name in seen:
            continue
        seen.add(d.full_name)
        for f in d.fields:
            if f.is_repeated:
                return True
            if f.message_type is not None:
                todo.append(f.message_type)
    return False


def check_bounds(message: Message) -> None:
    """Raise ``InvalidRequest`` if any repeated field of ``message``, at any depth, has too many entries."""
    descriptor = message.DESCRIPTOR
    if not _has_repeated(descriptor):
        return
    for field, value in message.ListFields():
        if field.is_repeated:
            limit = REPEATED_MAX.get(f"{descriptor.name}.{field.name}", REPEATED_DEFAULT_MAX)
            if len(value) > limit:
                raise InvalidRequest(
                    f"{descriptor.name}.{field.name} has {len(value)} entries; at most {limit} are accepted: "
                    "split the request"
                )
            item_type = field.message_type
            if item_type is not None and not item_type.GetOptions().map_entry and _has_repeated(item_type):
                for item in value:
                    check_bounds(item)
        elif field.message_type is not None:
            check_bounds(value)
