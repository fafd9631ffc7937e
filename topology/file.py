"""A topology as a command names it: the path of a TOML file, or ``default`` for the embedded one (sites a, b, c).

Pure: the caller reads the file (``georep/cli/topology_arg.py`` for the commands, ``spark_jobs/layout.py`` for
the audit) and hands its bytes here, or the error it met reading them; both come back as one
:class:`TopologyFileError` whose message names the file.
"""

from __future__ import annotations

from topology.model import InvalidTopology, Topology, parse_topology

DEFAULT = "default"


class TopologyFileError(Exception):
    """A topology file that cannot be read or used; the message names the file and what is wrong."""


def is_default(spec: object) -> bool:
    """Whether ``spec`` names the embedded default topology (None or ``"default"``), not a file."""
    return spec is None or str(spec) == DEFAULT


def parse_topology_file(path: str, data: bytes) -> Topology:
    """The topology in the file at ``path``, whose bytes are ``data``; raises :class:`TopologyFileError`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TopologyFileError(f"topology file {path} is not UTF-8 text") from None
    try:
        return parse_topology(text)
    except InvalidTopology as exc:
        raise TopologyFileError(f"{path}: {exc}") from None


def unreadable(path: str, exc: OSError) -> TopologyFileError:
    """What to say of a topology file that could not be read."""
    return TopologyFileError(f"cannot read topology file {path}: {exc.strerror or exc}")
