"""Replication's compression on the wire (``georep/replication/wire.py``) on 1 KiB JSON-like records produced
uncompressed, against the reference of the same records compressed by their producer (zstd batches, sent as
stored), in one run:

    .venv/bin/python bench/wire_compression.py --records 20000

For each: the bytes a link moves for the records, and the CPU time of the source's packing and the destination's
unpacking per MB of batches (in this process, on one core). Chunks are cut as a source cuts them: whole batches up
to 1 MiB (``STREAM_MAX_BYTES``). bench/README.md, "wire_compression".
"""

from __future__ import annotations

import argparse
import json
import random
import time

from georep.record.batch import RecordInput, encode_batch
from georep.record.compression import Compression
from georep.replication import wire
from georep.security.tls import MESSAGE_BYTES_MAX
from georep.server.replicator import STREAM_MAX_BYTES

BATCH_RECORDS = 60  # about 64 KiB of 1 KiB records, as a Kafka producer's default batch.size fills


def order(rng: random.Random, i: int) -> bytes:
    """A JSON order of about 1 KiB, its fields drawn as a shop's are: ids, names, SKUs, prices."""
    items = [
        {"sku": f"SKU-{rng.randrange(100000):05d}", "qty": rng.randrange(1, 5), "price_cents": rng.randrange(100, 9999)}
        for _ in range(rng.randrange(12, 17))
    ]
    doc = {
        "order_id": f"ord-{i:09d}",
        "customer_id": f"cus-{rng.randrange(10**7):07d}",
        "status": rng.choice(["NEW", "PAID", "SHIPPED", "DELIVERED"]),
        "created_at": f"2026-11-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z",
        "items": items,
        "shipping": {"city": rng.choice(["Lyon", "Osaka", "Austin", "Pune"]), "zip": f"{rng.randrange(10**5):05d}"},
    }
    return json.dumps(doc).encode()


def batches(records: int, compression: Compression) -> list[bytes]:
    rng = random.Random(1)
    values = [order(rng, i) for i in range(records)]
    return [
        encode_batch(
            [RecordInput(None, v, (), 1_700_000_000_000) for v in values[i : i + BATCH_RECORDS]],
            compression=compression,
        )
        for i in range(0, records, BATCH_RECORDS)
    ]


def chunks(stored: list[bytes]) -> list[bytes]:
    out, current = [], b""
    for batch in stored:
        if current and len(current) + len(batch) > STREAM_MAX_BYTES:
            out.append(current)
            current = b""
        current += batch
    return [*out, current] if current else out


def measure(records: int) -> dict[str, float]:
    plain = chunks(batches(records, Compression.NONE))
    stored = sum(len(c) for c in plain)
    start = time.process_time()
    packed = [wire.pack(c) for c in plain]
    pack_s = time.process_time() - start
    start = time.process_time()
    for batches_, batches_zstd in packed:
        wire.unpack(batches_, batches_zstd, MESSAGE_BYTES_MAX)
    unpack_s = time.process_time() - start
    reference = sum(len(b) for b in batches(records, Compression.ZSTD))
    return {
        "stored": stored,
        "wire": sum(len(a) + len(b) for a, b in packed),
        "reference": reference,
        "pack_ms_per_mb": pack_s * 1000 / (stored / 1e6),
        "unpack_ms_per_mb": unpack_s * 1000 / (stored / 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    args = parser.parse_args()
    m = measure(args.records)
    print(f"{args.records:,} JSON-like records of about 1 KiB, batches of {BATCH_RECORDS}, chunks up to 1 MiB")
    print("| what crosses the link | bytes | vs uncompressed |")
    print("| --- | ---: | ---: |")
    print(f"| batches as stored (produced uncompressed), before | {m['stored']:,.0f} | 1.00 |")
    print(f"| the same, zstd on the wire | {m['wire']:,.0f} | {m['wire'] / m['stored']:.2f} |")
    ref = m["reference"]
    print(f"| reference: batches the producer compressed (zstd), as stored | {ref:,.0f} | {ref / m['stored']:.2f} |")
    print(f"wire / reference: {m['wire'] / ref:.2f}")
    print(f"CPU per MB of batches: pack {m['pack_ms_per_mb']:.1f} ms, unpack {m['unpack_ms_per_mb']:.1f} ms")


if __name__ == "__main__":
    main()
