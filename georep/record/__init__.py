"""Pure codecs for record batches (no sockets, no files, no clocks)."""
