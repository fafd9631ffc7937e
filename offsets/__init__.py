"""Coordinates and vector offsets: the positions that mean the same at every site. Pure."""
