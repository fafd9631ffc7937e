"""The frames of pysyncobj's Raft port (0.3.17), and the largest one a member of a georep site sends. Pure.

A frame is a 4-byte native ``int`` (the length of what follows; ``struct.pack("i", n)``) and a message: a pickle
(protocol 2) of a dict, compressed with zlib at level 3 and, on a port with a secret, sealed as a Fernet token
(URL-safe base64 of a version byte, a timestamp, an IV, the AES-CBC ciphertext and an HMAC-SHA256).

What a member sends, from ``pysyncobj/syncobj.py`` (``_Replica``'s configuration fixes the three sizes below):

* ``append_entries`` with log entries. The leader takes entries from a follower's next index until their commands
  total at least ``appendEntriesBatchSizeBytes`` (:data:`APPEND_BATCH_BYTES`), the last one included: less than
  the batch plus one command, in at most one entry per byte of the batch (a command is at least its type byte). A
  single entry of at least the batch goes alone, as pieces of the batch's size of its pickle.
* ``append_entries`` with a piece of the leader's dump, for a follower behind its log: ``logCompactionBatchSize``
  bytes (:data:`DUMP_CHUNK_BYTES`).
* ``apply_command``: a follower forwards one command to the leader. georep refuses to propose a command longer than
  :data:`COMMAND_BYTES_MAX` (``RaftMetadataStore.propose``).
* Votes, ``next_node_idx``, ``apply_command_response``, ``timeout_now``: a few integers. Before authentication: the
  random key of the connection (sealed), or on a port without a secret the member's address or a utility command
  (``status``, ``add``): a few hundred bytes.

Pickle's protocol 2 writes a ``bytes`` object as the call that rebuilds it from a latin-1 string: up to two bytes
per byte, plus a few dozen per object. :func:`payload_bytes_max` adds all that up; :func:`frame_bytes_max` adds
zlib's worst case and the seal. ``tests/test_raft_frames.py`` checks the bound against the largest messages pysyncobj
builds.
"""

from __future__ import annotations

from dataclasses import dataclass

FRAME_HEADER_BYTES = 4
APPEND_BATCH_BYTES = 16 << 10  # pysyncobj's appendEntriesBatchSizeBytes (its default: 64 KiB)
DUMP_CHUNK_BYTES = 64 << 10  # pysyncobj's logCompactionBatchSize (its default)
COMMAND_BYTES_MAX = 256 << 10  # the largest encoded command a georep node proposes
PICKLED_BYTES_PER_BYTE = 2  # protocol 2 writes bytes as latin-1 text in UTF-8
PICKLED_ENTRY_OVERHEAD = 64  # a log entry's tuple, index, term and the bytes' rebuild call (measured: at most 28 after
# the first entry, 75 for the first)
MESSAGE_OVERHEAD = 1024  # a message's dict: its keys, terms, indexes, flags
# Before authentication a connection carries one small message (its random key, or a member's address or a utility
# command on a port without a secret); the sealed key is about 250 bytes.
FRAME_BYTES_BEFORE_AUTH = 4096


@dataclass(frozen=True, slots=True)
class FrameBounds:
    """What a connection of the Raft port accepts: the frame length before and after authentication, and the size
    of the message once decompressed."""

    before_auth: int
    after_auth: int
    payload: int

    @classmethod
    def for_port(
        cls,
        sealed: bool,
        append_batch_bytes: int = APPEND_BATCH_BYTES,
        dump_chunk_bytes: int = DUMP_CHUNK_BYTES,
        command_bytes_max: int = COMMAND_BYTES_MAX,
        before_auth: int = FRAME_BYTES_BEFORE_AUTH,
    ) -> FrameBounds:
        payload = payload_bytes_max(append_batch_bytes, dump_chunk_bytes, command_bytes_max)
        return cls(before_auth, frame_bytes_max(payload, sealed), payload)


def payload_bytes_max(append_batch_bytes: int, dump_chunk_bytes: int, command_bytes_max: int) -> int:
    """The largest pickled message a member sends (see the module docstring)."""
    batch_commands = append_batch_bytes - 1 + command_bytes_max
    batch_entries = append_batch_bytes + 1
    entries = PICKLED_BYTES_PER_BYTE * batch_commands + PICKLED_ENTRY_OVERHEAD * batch_entries
    piece = PICKLED_BYTES_PER_BYTE * max(append_batch_bytes, dump_chunk_bytes) + PICKLED_ENTRY_OVERHEAD
    command = PICKLED_BYTES_PER_BYTE * command_bytes_max + PICKLED_ENTRY_OVERHEAD
    return MESSAGE_OVERHEAD + max(entries, piece, command)


def zlib_bytes_max(n: int) -> int:
    """zlib's output for ``n`` bytes of input, at most (deflate's stored blocks, with room to spare)."""
    return n + (n >> 3) + (n >> 6) + 64


def fernet_bytes(n: int) -> int:
    """The length of a Fernet token sealing ``n`` bytes: base64 of version, timestamp, IV, padded ciphertext, HMAC."""
    raw = 1 + 8 + 16 + 16 * (n // 16 + 1) + 32
    return 4 * -(-raw // 3)


def frame_bytes_max(payload_bytes: int, sealed: bool) -> int:
    """The longest frame (after its header) that carries a message of at most ``payload_bytes`` pickled bytes."""
    compressed = zlib_bytes_max(payload_bytes)
    return fernet_bytes(compressed) if sealed else compressed


def frame_length_fault(length: int, limit: int) -> str | None:
    """Why a frame header announcing ``length`` bytes must close its connection, or None if it may be read."""
    if length < 0:
        return f"a frame header announcing {length} bytes"
    if length > limit:
        return f"a frame of {length} bytes, over the {limit} this connection accepts"
    return None
