"""The ``--topology`` argument of the commands: a TOML file, read here and parsed by ``topology/file.py``, or
``default`` (or no argument) for the embedded topology."""

from __future__ import annotations

from pathlib import Path

from topology.file import is_default, parse_topology_file, unreadable
from topology.model import Topology, default_topology


def load_topology(spec: Path | str | None) -> Topology:
    """The topology in file ``spec``; the embedded default (sites a, b, c) for None or ``"default"``. Raises
    :class:`~topology.file.TopologyFileError`."""
    if is_default(spec):
        return default_topology()
    path = Path(str(spec))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise unreadable(str(path), exc) from None
    return parse_topology_file(str(path), data)
