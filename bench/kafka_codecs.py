"""What storing a Kafka batch in its producer's codec costs at the gateway, and what it saves on disk and the WAN
(issue 23, "Compression"), on one core, no I/O.

Run from the repository root::

    .venv/bin/python bench/kafka_codecs.py            # a few seconds
    .venv/bin/python bench/kafka_codecs.py --quick    # smoke run

For each of Kafka's codecs it builds one Kafka v2 batch of ``--records`` JSON-like records of about
``--value-bytes`` each, compressed as a Kafka producer compresses it, and prints:

* ``kafka B``: the batch a Kafka client sends; ``stored B``: the georep batch the gateway now stores (the same
  codec); ``plain B``: the georep batch it stored before (uncompressed), and the ratio plain/stored;
* ``convert us``: ``kafka_to_georep`` (decompress bounded, walk, re-encode, compress in the same codec);
  ``compress us``: the part of it that is the compression (what storing compressed adds over the old path);
  ``validate us``: ``validate_batch`` of the stored batch (the origin append's check, which decompresses again).

Best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where bench/kafka.py would hide the kafka package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cramjam
import crc32c
import lz4.frame
import zstandard
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import encode_varint

from georep.kafka.records import kafka_to_georep
from georep.record.batch import HEADER_BYTES, parse_header
from georep.record.compression import Compression, compress, decompress
from georep.record.validate import validate_batch

LIMIT = 8 << 20
TS = 1_700_000_000_000
XERIAL_HEAD = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)


def xerial(data: bytes) -> bytes:
    out = [XERIAL_HEAD]
    for at in range(0, len(data), 32 << 10):
        block = bytes(cramjam.snappy.compress_raw(data[at : at + (32 << 10)]))
        out += [struct.pack(">i", len(block)), block]
    return b"".join(out)


KAFKA: dict[str, tuple[int, Callable[[bytes], bytes]]] = {
    "none": (0, lambda data: data),
    "gzip": (1, gzip.compress),
    "snappy": (2, lambda data: bytes(cramjam.snappy.compress_raw(data))),
    "snappy-xerial": (2, xerial),
    "lz4": (3, lambda data: bytes(lz4.frame.compress(data))),
    "zstd": (4, zstandard.ZstdCompressor(level=3).compress),
}


def kafka_batch(codec: str, records: int, value_bytes: int) -> bytes:
    attributes, squeeze = KAFKA[codec]
    section = bytearray()
    for i in range(records):
        value = (b'{"user": %d, "page": "/catalog/shoes", "agent": "Mozilla/5.0"} ' % i) * (value_bytes // 64 + 1)
        body = bytearray(b"\0")
        for field in (i, i):  # timestamp delta, offset delta
            encode_varint(field, body.append)
        encode_varint(-1, body.append)  # no key
        encode_varint(value_bytes, body.append)
        body += value[:value_bytes]
        body += b"\0"  # no headers
        encode_varint(len(body), section.append)
        section += body
    data = squeeze(bytes(section))
    head = bytearray(DefaultRecordBatch.HEADER_STRUCT.size)
    DefaultRecordBatch.HEADER_STRUCT.pack_into(
        head,
        0,
        0,
        len(head) - 12 + len(data),
        0,
        2,
        0,
        attributes,
        records - 1,
        TS,
        TS + records - 1,
        -1,
        -1,
        -1,
        records,
    )
    struct.pack_into(">I", head, 17, crc32c.crc32c(data, crc32c.crc32c(head[21:])))
    return bytes(head) + data


def best_us(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--value-bytes", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    print(f"{args.records} records of {args.value_bytes} B, best of {repeats}")
    print(
        f"{'codec':14} {'kafka B':>9} {'stored B':>9} {'plain B':>9} {'ratio':>6} {'convert us':>11} "
        f"{'compress us':>12} {'validate us':>12}"
    )
    for codec in KAFKA:
        raw = kafka_batch(codec, args.records, args.value_bytes)
        stored = kafka_to_georep(raw, LIMIT)
        header = parse_header(stored)
        plain_section = decompress(header.compression, memoryview(stored)[HEADER_BYTES:], LIMIT)
        plain = len(plain_section) + HEADER_BYTES
        section = bytes(plain_section)
        convert = best_us(partial(kafka_to_georep, raw, LIMIT), repeats)
        squeeze = best_us(partial(compress, Compression(header.compression), section), repeats)
        check = best_us(partial(validate_batch, stored, LIMIT), repeats)
        print(
            f"{codec:14} {len(raw):9} {len(stored):9} {plain:9} {plain / len(stored):6.1f} {convert:11.0f} "
            f"{squeeze if header.compression else 0:12.0f} {check:12.0f}"
        )


if __name__ == "__main__":
    main()
