"""Loading a topology for the commands: a TOML file, or the embedded default."""

from __future__ import annotations

from pathlib import Path

from topology.model import InvalidTopology, Topology, default_topology, parse_topology

DEFAULT = "default"


class TopologyFileError(Exception):
    pass


def load_topology(spec: Path | str | None) -> Topology:
    """The topology in file ``spec``; the embedded default (sites a, b, c) for None or ``"default"``."""
    if spec is None or str(spec) == DEFAULT:
        return default_topology()
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyFileError(f"cannot read topology file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TopologyFileError(f"topology file {path} is not UTF-8 text") from None
    try:
        return parse_topology(text)
    except InvalidTopology as exc:
        raise TopologyFileError(f"{path}: {exc}") from None
