"""The repair loop follows damage, not the partition count: it walks the node's partitions for quarantined batches
only after some log's quarantine list changed (issue 22: a node with 10,000 idle partitions walked them all every
0.5 s), and it still sees every batch quarantined since."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.record.batch import RecordInput, encode_batch
from georep.server.broker import Broker
from georep.server.replicator import Replicator
from georep.storage import api as storage_api
from georep.storage.api import BatchDamaged
from georep.storage.metadata_file import load_or_create_identity
from georep.storage.segment_log import SegmentLog
from topology.model import default_topology

PARTITIONS = 12
VICTIM = ("t", 5)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    # Which logs anywhere in the process hold a quarantined batch: other tests' damage is not this node's (the
    # registry is the process's, as a node's is).
    others = set(storage_api.quarantined)
    storage_api.quarantined.clear()
    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic("t", PARTITIONS, {})
    b.append(*VICTIM, encode_batch([RecordInput(None, b"v" * 200, (), 1_000)]))
    b.partition(*VICTIM).log.flush()
    yield b
    b.close()
    storage_api.quarantined.clear()
    storage_api.quarantined.update(others)


def count_walks(broker: Broker) -> list[tuple[str, int]]:
    """Every partition log's damaged_batches() call, by partition, from now on."""
    calls: list[tuple[str, int]] = []
    for key, p in broker.partitions.items():
        plain = p.log.damaged_batches

        def counted(key: tuple[str, int] = key, plain=plain):  # type: ignore[no-untyped-def]
            calls.append(key)
            return plain()

        p.log.damaged_batches = counted  # type: ignore[method-assign]
    return calls


def test_the_repair_loop_walks_the_partitions_again_only_after_a_quarantine_changed(broker: Broker) -> None:
    replicator = Replicator(broker, default_topology(), "a", stall_ms=2_000)
    calls = count_walks(broker)
    assert replicator.damaged() == {}
    assert calls == []  # no log anywhere holds a quarantined batch: nothing to walk
    for _ in range(5):
        assert replicator.damaged() == {}
    assert calls == []  # nothing was quarantined since: idle partitions cost nothing

    log = broker.partition(*VICTIM).log
    assert isinstance(log, SegmentLog)
    segment = next(log.directory.glob("*.log"))
    data = bytearray(segment.read_bytes())
    data[-10] ^= 0x40  # a byte of the record's value: its CRC no longer matches
    segment.write_bytes(bytes(data))
    with pytest.raises(BatchDamaged):
        log.read(log.log_start_offset, 1 << 20)  # the read quarantines it

    damaged = replicator.damaged()
    assert list(damaged) == [VICTIM] and damaged[VICTIM][0].base_offset == 0  # seen at once, and asked for
    assert len(calls) == PARTITIONS  # a quarantine changed: the partitions are walked, once
    calls.clear()
    assert replicator.damaged() == damaged and calls == []
