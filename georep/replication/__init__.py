"""Replication over links, sans I/O (docs/design.md, "Replication"): the link
states and routing (``links``), the destination's pull session (``session``),
the source's cursor (``source``) and the apply of a chunk (``sink``). The node
(``georep/server/replicator.py``) and the simulator drive the same objects."""
