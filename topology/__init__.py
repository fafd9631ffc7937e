"""Site ids and (from issue 3 on) the topology graph. Pure: no I/O."""
