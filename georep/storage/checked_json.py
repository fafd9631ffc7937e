"""Small JSON state files that carry their own CRC-32C, so a flipped digit is caught rather than believed.

A JSON parser catches most damage to a text file, but not a digit changed into another digit: a recovery
point's vector that says ``"a@1": 700`` instead of ``300`` parses fine and lies. So each such file is a JSON object
with a ``"crc32c"`` member: the CRC-32C of the object without that member, serialised canonically (sorted keys,
no spaces, ASCII). The file itself stays indented and readable.

Files written before the checksum existed have no ``"crc32c"`` member; :func:`loads_checked` accepts them only
when their ``"format"`` is one the caller names as older than the checksum.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import crc32c

CHECKSUM_KEY = "crc32c"


class DamagedStateFile(ValueError):
    """A state file whose bytes are not the JSON object its checksum vouches for."""


def canonical(value: Any) -> str:
    """``value`` serialised as the checksum reads it: sorted keys, no spaces, ASCII."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _checksum(doc: dict[str, Any]) -> int:
    return int(crc32c.crc32c(canonical(doc).encode("ascii")))


def dumps_checked(doc: dict[str, Any]) -> bytes:
    """``doc`` as indented JSON with its checksum member added."""
    if CHECKSUM_KEY in doc:
        raise ValueError(f"a checked document may not carry its own {CHECKSUM_KEY!r} member")
    return (json.dumps({**doc, CHECKSUM_KEY: _checksum(doc)}, sort_keys=True, indent=1) + "\n").encode("ascii")


def dumps_checked_canonical(text: str) -> bytes:
    """A document given as its canonical text (what :func:`canonical` gives for it) with its checksum member
    added, on one line: what :func:`dumps_checked` writes, without indenting, and without serialising it again.

    For a large document that a caller assembles from members it serialised once (the recovery-point checkpoint
    of 100,000 partitions: 4 s to serialise whole, on a node's event loop). Its first member must sort after
    ``"crc32c"``, so that the checksum member goes first and the text stays canonical."""
    first = text[2 : text.find('"', 2)] if text.startswith('{"') else ""
    if first <= CHECKSUM_KEY:
        raise ValueError(f"a canonical document whose first member sorts after {CHECKSUM_KEY!r} is expected")
    checksum = int(crc32c.crc32c(text.encode("ascii")))
    return f'{{"{CHECKSUM_KEY}":{checksum},{text[1:]}\n'.encode("ascii")


def loads_checked(
    data: bytes, *, unchecked_formats: tuple[int, ...] = (), format_key: str = "format"
) -> dict[str, Any]:
    """The object in ``data`` without its checksum member; raises :class:`DamagedStateFile` when they disagree.

    ``unchecked_formats``: the values of ``format_key`` of files written before the checksum, accepted without one.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedStateFile(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DamagedStateFile(f"not a JSON object but a {type(doc).__name__}")
    stored = doc.pop(CHECKSUM_KEY, None)
    if stored is None:
        if doc.get(format_key) in unchecked_formats:
            return doc
        raise DamagedStateFile(f"no {CHECKSUM_KEY!r} member")
    if stored != _checksum(doc):
        raise DamagedStateFile(f"checksum {stored!r} does not match the contents ({_checksum(doc)})")
    return doc


def read_checked(path: Path, *, unchecked_formats: tuple[int, ...] = ()) -> dict[str, Any] | None:
    """The checked object in the file at ``path``, or ``None`` when there is no such file; raises
    :class:`DamagedStateFile` when there is one and its bytes are not what its checksum vouches for."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return loads_checked(data, unchecked_formats=unchecked_formats)
