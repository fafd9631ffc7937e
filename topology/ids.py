"""Ids: site ids, the short names of datacenters (ARCHITECTURE.md, vocabulary), and the ids inside one site's
segment cluster (ARCHITECTURE.md, "Inside a site").

Every id has this one home, at the bottom of the layers: the topology names sites and their nodes, and the
site's cluster numbers leader epochs and segments. ``NewType`` keeps them apart in type checking: a node id, a
leader epoch and a segment's place in its partition's chain cannot be mixed up with each other, nor with a local
offset or an origin seq.
"""

from __future__ import annotations

import re
from typing import NewType

SiteId = NewType("SiteId", str)
NodeId = NewType("NodeId", int)  # a node of one site: 1, 2, 3, ... (principal ``node:a/2``)
LeaderEpoch = NewType("LeaderEpoch", int)  # per partition; bumped by every leader change
SegmentId = NewType("SegmentId", int)  # per partition: 0, 1, 2, ... in chain order

SITE_ID_MAX_CHARS = 32
_SITE_ID = re.compile(r"[a-z][a-z0-9-]{0,31}")
NODE_ID_MAX = 4095


class InvalidSiteId(ValueError):
    """A site id does not match ``[a-z][a-z0-9-]{0,31}``."""


class InvalidNodeId(ValueError):
    """A node id outside ``1..NODE_ID_MAX``."""


# Site ids already found valid: a held report or a pulled message names the same few sites in each of thousands of
# entries, and the regex per entry was 4% of a node's samples at 10,000 partitions (issue 22). Bounded, so that
# a peer sending ever new (valid) names cannot grow it.
_VALID: dict[str, SiteId] = {}
_VALID_MAX = 4096


def site_id(text: str) -> SiteId:
    """Validate ``text`` and return it as a :data:`SiteId`."""
    known = _VALID.get(text)
    if known is not None:
        return known
    if not _SITE_ID.fullmatch(text):
        raise InvalidSiteId(
            f"invalid site id {text!r}: use 1-32 characters, a lowercase letter "
            "first, then lowercase letters, digits or '-' (for example 'us-east')"
        )
    if len(_VALID) < _VALID_MAX:
        _VALID[text] = SiteId(text)
    return SiteId(text)


def node_id(value: int) -> NodeId:
    """Validate ``value`` and return it as a :data:`NodeId`."""
    if not 1 <= value <= NODE_ID_MAX:
        raise InvalidNodeId(f"invalid node id {value}: use 1 to {NODE_ID_MAX}, for example --node-id 2")
    return NodeId(value)
