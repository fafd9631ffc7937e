"""Ids inside one site's segment cluster (ARCHITECTURE.md, "Inside a site").

``NewType`` keeps the integers apart in type checking: a node id, a leader
epoch and a segment's place in its partition's chain cannot be mixed up with
each other, nor with a local offset or an origin seq.
"""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", int)  # a node of one site: 1, 2, 3, ... (principal ``node:a/2``)
LeaderEpoch = NewType("LeaderEpoch", int)  # per partition; bumped by every leader change
SegmentId = NewType("SegmentId", int)  # per partition: 0, 1, 2, ... in chain order

NODE_ID_MAX = 4095


class InvalidNodeId(ValueError):
    """A node id outside ``1..NODE_ID_MAX``."""


def node_id(value: int) -> NodeId:
    """Validate ``value`` and return it as a :data:`NodeId`."""
    if not 1 <= value <= NODE_ID_MAX:
        raise InvalidNodeId(f"invalid node id {value}: use 1 to {NODE_ID_MAX}, for example --node-id 2")
    return NodeId(value)
