"""Replication over links (docs/design.md, "Replication"): the source side of a
``Replicate`` stream, the sink that applies chunks, and the node's pullers."""
