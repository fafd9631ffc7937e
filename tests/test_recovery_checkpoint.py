"""The node's recovery-point checkpoint (one file for every partition): what start-up trusts of it, and what not.

Each hostile test damages the checkpoint in one way and checks what a user would see: every acknowledged batch
served, the log's vector no more than what it holds, and a new, readable checkpoint. A checkpoint trusted blindly
fails each of them (see the report of the change that added it for the planted bugs each one caught).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path

from georep.server.broker import Broker
from georep.storage.api import LogConfig
from georep.storage.checked_json import canonical, dumps_checked, dumps_checked_canonical, loads_checked
from georep.storage.metadata_file import load_or_create_identity
from georep.storage.recovery_checkpoint import FILE_NAME, RecoveryCheckpoint
from georep.storage.recovery_point import FILE_NAME as PARTITION_FILE
from georep.storage.recovery_point import RecoveryPoint
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from spark_jobs.layout import partition_segments
from tests.support.node_api import batch
from tests.support.segments import A, B, Writer, log_files, read_all

CONFIG = LogConfig(segment_bytes_max=1 << 20)
SMALL = LogConfig(segment_bytes_max=600)  # two batches of 2 records a segment


def open_with(checkpoint: RecoveryCheckpoint, directory: Path, config: LogConfig = CONFIG) -> SegmentLog:
    return SegmentLog.open(directory, config, 0, points=checkpoint)


def written(
    logs: Path, name: str, batches: int, origin: Origin = A, config: LogConfig = CONFIG
) -> tuple[Writer, SegmentLog]:
    """A partition ``name`` in ``logs`` with ``batches`` batches of 2 records, closed cleanly and checkpointed."""
    checkpoint = RecoveryCheckpoint.load(logs)
    log = open_with(checkpoint, logs / name, config)
    w = Writer(log)
    for _ in range(batches):
        w.append(origin, 2, value_bytes=50)
    log.close()
    assert checkpoint.save()
    return w, log


def entries(logs: Path) -> dict[str, dict[str, object]]:
    doc = loads_checked((logs / FILE_NAME).read_bytes())
    partitions = doc["partitions"]
    assert isinstance(partitions, dict)
    return partitions


def rewrite(logs: Path, partitions: dict[str, dict[str, object]]) -> None:
    """A checkpoint that is well-formed and checksummed, with the entries given (what a wrong one looks like)."""
    (logs / FILE_NAME).write_bytes(dumps_checked({"format": 1, "partitions": partitions}))


def batch_bytes(w: Writer, count: int) -> int:
    return sum(s.header.size_bytes for s in w.stored[:count])


def reopened(logs: Path, name: str, config: LogConfig = CONFIG) -> tuple[RecoveryCheckpoint, SegmentLog]:
    checkpoint = RecoveryCheckpoint.load(logs)
    return checkpoint, open_with(checkpoint, logs / name, config)


def test_a_clean_close_writes_one_checkpoint_and_the_next_open_trusts_it(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 6, config=SMALL)
    written(tmp_path, "t-1", 3, config=SMALL)
    assert not list(tmp_path.glob(f"*/{PARTITION_FILE}"))  # no per-partition file
    assert set(entries(tmp_path)) == {"t-0", "t-1"}
    _checkpoint, log = reopened(tmp_path, "t-0", SMALL)
    try:
        assert log.recovery.segments_trusted == len(log_files(tmp_path / "t-0")) - 1  # every sealed one
        assert log.log_end_offset == 12
    finally:
        log.close()


def test_a_torn_checkpoint_means_validating_every_partition_and_writing_it_anew(tmp_path: Path) -> None:
    _w, _ = written(tmp_path, "t-0", 6)
    path = tmp_path / FILE_NAME
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # torn
    with open(log_files(tmp_path / "t-0")[0], "ab") as f:
        f.write(b"\x00" * 7)  # and a torn tail after the last batch
    checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert not checkpoint.readable
        assert log.recovery.segments_validated == 1
        assert log.recovery.damage is not None  # the 7 bytes were cut
        assert len(read_all(log)) == 6
        checkpoint.started(["t-0"])
        assert checkpoint.save()
        assert entries(tmp_path)["t-0"]["recovery_point"] == 12
    finally:
        log.close()


def test_a_flipped_digit_in_the_checkpoint_is_caught_by_its_checksum(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 3, config=SMALL)  # the vector below the active segment: A's first 4 seqs
    path = tmp_path / FILE_NAME
    text = path.read_text()
    assert json.loads(text)["partitions"]["t-0"]["vector"] == {str(A): 4}
    path.write_text(text.replace(f'"{A}":4', f'"{A}":9'))  # still JSON, still a number: only the CRC knows
    checkpoint, log = reopened(tmp_path, "t-0", SMALL)
    try:
        assert not checkpoint.readable
        assert log.vector() == {A: OriginSeq(6)}  # what the log holds, not what the file said
    finally:
        log.close()


def test_an_entry_for_another_directory_of_the_same_name_is_not_used(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 8, config=SMALL)  # its entry: A's first 12 seqs below offset 12, point 16
    old = entries(tmp_path)["t-0"]
    # The partition made anew under its name (the checkpoint not rewritten), 20 offsets: the old claims fit inside
    # it. Made before the old one goes, so that the file system cannot give it the old one's inode number again.
    written(tmp_path / "elsewhere", "t-0", 10, origin=B)
    shutil.rmtree(tmp_path / "t-0")
    (tmp_path / "elsewhere" / "t-0").rename(tmp_path / "t-0")
    rewrite(tmp_path, {"t-0": old})  # checksummed, well-formed, and about the directory that was removed
    _checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert log.vector() == {B: OriginSeq(20)}  # nothing of the old partition's A records is claimed
        assert len(read_all(log)) == 10
    finally:
        log.close()


def test_an_entry_copied_from_another_partition_is_not_used(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 8, config=SMALL)
    written(tmp_path, "t-1", 10, origin=B)
    both = entries(tmp_path)
    rewrite(tmp_path, {"t-0": both["t-0"], "t-1": both["t-0"]})  # t-1's entry says what t-0 holds
    _checkpoint, log = reopened(tmp_path, "t-1")
    try:
        assert log.vector() == {B: OriginSeq(20)}
    finally:
        log.close()


def test_an_entry_naming_a_partition_that_does_not_exist_is_dropped(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 2)
    rewrite(tmp_path, {**entries(tmp_path), "gone-0": entries(tmp_path)["t-0"]})
    checkpoint, log = reopened(tmp_path, "t-0")
    log.close()
    checkpoint.started(["t-0"])
    assert checkpoint.save()
    assert set(entries(tmp_path)) == {"t-0"}


def test_a_point_beyond_what_the_segment_holds_is_not_trusted(tmp_path: Path) -> None:
    w, _ = written(tmp_path, "t-0", 10)  # checkpoint: recovery point 20
    segment = log_files(tmp_path / "t-0")[0]
    os.truncate(segment, batch_bytes(w, 6))  # the .log holds 6 batches; its origin index still names 10
    _checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert log.log_end_offset == 12  # cut where the data ends, not 4 batches quarantined that never were
        assert log.damaged_batches() == []
        assert log.vector() == {A: OriginSeq(12)}
        assert len(read_all(log)) == 6
    finally:
        log.close()


def test_a_point_beyond_the_log_and_its_index_is_not_trusted(tmp_path: Path) -> None:
    w, _ = written(tmp_path, "t-0", 10)
    directory = tmp_path / "t-0"
    os.truncate(log_files(directory)[0], batch_bytes(w, 6) + 5)  # 6 batches and a torn 7th
    for index in directory.glob("*index"):
        index.unlink()  # nothing names what lay between: a point trusted blindly refuses the log
    _checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert log.log_end_offset == 12
        assert len(read_all(log)) == 6
    finally:
        log.close()


def test_a_vector_offset_beyond_the_log_end_is_not_trusted(tmp_path: Path) -> None:
    written(tmp_path, "t-0", 3)
    entry = entries(tmp_path)["t-0"]
    rewrite(tmp_path, {"t-0": {**entry, "recovery_point": 4, "vector_offset": 400, "vector": {str(A): 300}}})
    _checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert log.vector() == {A: OriginSeq(6)}
        assert log.log_end_offset == 6
    finally:
        log.close()


def test_a_missing_checkpoint_means_validating_and_writing_it_anew(tmp_path: Path) -> None:
    w, _ = written(tmp_path, "t-0", 5)
    (tmp_path / FILE_NAME).unlink()
    os.truncate(log_files(tmp_path / "t-0")[0], batch_bytes(w, 4) + 3)  # a torn 5th batch: never acknowledged
    checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert checkpoint.readable  # missing is not damaged, but holds nothing
        assert log.log_end_offset == 8
        assert len(read_all(log)) == 4
        checkpoint.started(["t-0"])
        assert checkpoint.save()
        assert entries(tmp_path)["t-0"]["recovery_point"] == 8
    finally:
        log.close()


def test_a_checkpoint_older_than_a_retention_run_keeps_the_vector_of_what_was_deleted(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes_max=300, retention_bytes=0)  # a segment per batch; retention keeps the last
    checkpoint = RecoveryCheckpoint.load(tmp_path)
    log = open_with(checkpoint, tmp_path / "t-0", config)
    w = Writer(log)
    w.append(B, 2, value_bytes=50)
    log.close()
    assert checkpoint.save()  # the checkpoint: B's batch, below the vector offset 2
    checkpoint = RecoveryCheckpoint.load(tmp_path)
    log = open_with(checkpoint, tmp_path / "t-0", config)
    w.log = log
    for _ in range(4):
        w.append(A, 2, value_bytes=50)
    log.flush()
    assert log.enforce_retention(now_ms=10**12) > 0  # deletes B's segment and A's first ones; no checkpoint saved
    assert log.vector() == {A: OriginSeq(8), B: OriginSeq(2)}
    log.abandon()  # kill -9: the file on disk is the old one
    checkpoint, log = reopened(tmp_path, "t-0")
    try:
        assert log.vector()[A] == OriginSeq(8)  # A's deleted batches lay above the old entry's vector offset
        assert log.vector() == {A: OriginSeq(8), B: OriginSeq(2)}
    finally:
        log.close()


def test_a_data_dir_with_the_old_per_partition_files_starts_from_them_once(tmp_path: Path) -> None:
    log = SegmentLog.open(tmp_path / "t-0", SMALL, 0)  # an older build: the partition's own file
    w = Writer(log)
    for _ in range(4):
        w.append(A, 2, value_bytes=50)
    log.close()
    assert (tmp_path / "t-0" / PARTITION_FILE).exists()
    checkpoint, log = reopened(tmp_path, "t-0", SMALL)
    try:
        assert log.recovery.segments_trusted == 1  # its old file's point was trusted, as the older build did
        checkpoint.started(["t-0"])
    finally:
        log.close()
    assert checkpoint.save()
    assert not (tmp_path / "t-0" / PARTITION_FILE).exists()  # removed once the checkpoint holds its point
    assert entries(tmp_path)["t-0"]["recovery_point"] == 8
    checkpoint, log = reopened(tmp_path, "t-0", SMALL)
    try:
        assert log.recovery.segments_trusted == 1
        assert log.vector() == {A: OriginSeq(8)}
    finally:
        log.close()


# -- a node's broker ---------------------------------------------------------------------------------------------

PARTITIONS = 40


def broker_on(data_dir: Path, **kwargs: object) -> Broker:
    return Broker(data_dir, load_or_create_identity(data_dir, "a", 1), **kwargs)  # type: ignore[arg-type]


def fill(broker: Broker, records: int) -> dict[int, int]:
    """One batch of ``records`` records to each partition of topic ``t``; each one's log end."""
    ends: dict[int, int] = {}
    for i in range(PARTITIONS):
        broker.append("t", i, batch(records))
        p = broker.partition("t", i)
        p.log.flush()
        ends[i] = p.log.log_end_offset
    return ends


def test_a_clean_stop_writes_one_checkpoint_file_not_one_file_per_partition(tmp_path: Path) -> None:
    broker = broker_on(tmp_path)
    broker.create_topic("t", PARTITIONS, {})
    ends = fill(broker, 3)
    broker.close()
    logs = tmp_path / "logs"
    assert not list(logs.glob(f"*/{PARTITION_FILE}"))
    assert {f"t-{i}" for i in range(PARTITIONS)} <= set(entries(logs))
    assert all(entries(logs)[f"t-{i}"]["recovery_point"] == ends[i] for i in range(PARTITIONS))
    broker = broker_on(tmp_path)
    try:
        assert {i: broker.partition("t", i).log.log_end_offset for i in range(PARTITIONS)} == ends
    finally:
        broker.close()


def test_what_was_written_after_the_last_checkpoint_survives_a_crash(tmp_path: Path) -> None:
    broker = broker_on(tmp_path)
    broker.create_topic("t", PARTITIONS, {})
    fill(broker, 2)
    broker.enforce_retention()  # the periodic run: the checkpoint is written
    before = entries(tmp_path / "logs")
    ends = fill(broker, 5)  # acknowledged (fsynced) after it: the file still says less
    for p in broker.partitions.values():
        assert isinstance(p.log, SegmentLog)
        p.log.abandon()  # kill -9
    broker.executor.shutdown()
    broker.replica_writer.shutdown()
    assert entries(tmp_path / "logs") == before
    broker = broker_on(tmp_path)
    try:
        assert {i: broker.partition("t", i).log.log_end_offset for i in range(PARTITIONS)} == ends
    finally:
        broker.close()


def test_a_node_of_the_older_build_starts_from_its_per_partition_files_and_replaces_them(tmp_path: Path) -> None:
    broker = broker_on(tmp_path, open_log=SegmentLog.open)  # the older build: a file in each partition
    broker.create_topic("t", PARTITIONS, {})
    ends = fill(broker, 2)
    broker.close()
    logs = tmp_path / "logs"
    assert len(list(logs.glob(f"t-*/{PARTITION_FILE}"))) == PARTITIONS
    broker = broker_on(tmp_path)
    try:
        assert {i: broker.partition("t", i).log.log_end_offset for i in range(PARTITIONS)} == ends
    finally:
        broker.close()
    assert not list(logs.glob(f"*/{PARTITION_FILE}"))
    assert all(entries(logs)[f"t-{i}"]["recovery_point"] == ends[i] for i in range(PARTITIONS))


def test_a_producer_retry_after_a_restart_is_still_deduplicated(tmp_path: Path) -> None:
    """The producer table is rebuilt at its first use, not at start: from the same log, so a retry of a batch
    written before the restart is recognised."""
    broker = broker_on(tmp_path)
    broker.create_topic("t", 2, {})
    _, first = broker.append("t", 1, batch(3, pid=7, seq=0))
    broker.append("t", 0, batch(1))
    broker.close()
    broker = broker_on(tmp_path)
    try:
        p, again = broker.append("t", 1, batch(3, pid=7, seq=0))  # the client never saw the first ack
        assert again.duplicate and again.result.base_offset == first.result.base_offset
        assert p.log.log_end_offset == 3
    finally:
        broker.close()


def test_the_audit_reads_the_recovery_points_from_the_checkpoint(tmp_path: Path) -> None:
    """The audit's file mode tells a torn tail from damage by the recovery point: it finds the point in the
    node's checkpoint (a partition with none counts as all above it, and its damage as torn tails)."""
    logs = tmp_path / "logs"
    written(logs, "t-0", 3)
    written(logs, "t-1", 2)
    (segment,) = partition_segments("a", "t", 0, logs / "t-0")
    assert segment.recovery_point == 6
    assert partition_segments("a", "t", 1, logs / "t-1")[0].recovery_point == 4
    log = SegmentLog.open(tmp_path / "own" / "t-0", CONFIG, 0)  # a log with its own file (a segment copy)
    Writer(log).append(A, 2)
    log.close()
    assert partition_segments("a", "t", 0, tmp_path / "own" / "t-0")[0].recovery_point == 2


def test_each_save_writes_what_serialising_the_whole_document_gives(tmp_path: Path) -> None:
    """The checkpoint serialises each entry once and joins them (4 s of ``json.dumps`` a save at 100,000
    partitions otherwise): through seeded writes, forgets and saves, each file read back is every entry as it is
    now, and its bytes are the canonical document with its checksum. A cached text kept after its entry changed
    (or after it was forgotten) fails the comparison."""
    names = [f"t{i}-0" for i in range(12)]
    for seed in range(20):
        rng, logs = random.Random(seed), tmp_path / str(seed)
        for name in names:
            (logs / name).mkdir(parents=True)
        checkpoint, model = RecoveryCheckpoint.load(logs), {}
        for _ in range(40):
            name = rng.choice(names)
            if rng.random() < 0.2:
                checkpoint.forget([name])
                model.pop(name, None)
            else:
                point = RecoveryPoint(
                    LocalOffset(rng.randrange(100)), LocalOffset(0), {A: OriginSeq(rng.randrange(5)), B: OriginSeq(1)}
                )
                checkpoint.write(logs / name, point)
                model[name] = point
            if rng.random() < 0.3 and checkpoint.save(force=True):
                data = (logs / FILE_NAME).read_bytes()
                doc = loads_checked(data)
                assert data == dumps_checked_canonical(canonical(doc)), f"seed {seed}"
                assert set(entries(logs)) == set(model), f"seed {seed}"
                for name, point in model.items():
                    got = entries(logs)[name]
                    assert got["recovery_point"] == point.recovery_point, f"seed {seed}: {name}"
                    assert got["vector"] == {str(o): s for o, s in point.vector.items()}, f"seed {seed}: {name}"


def test_saves_from_two_threads_at_once_leave_a_readable_file_of_the_last_points(tmp_path: Path) -> None:
    """A retention run writes the checkpoint in a thread that a stop does not wait for before its own save: two
    writers of the one temporary file mixed their bytes (a checkpoint the next start could not read) or one found
    the other's file renamed away. Saves are one at a time. Planted: without ``_saving`` this fails."""
    logs = tmp_path / "logs"
    names = [f"t{i}-0" for i in range(200)]
    for name in names:
        (logs / name).mkdir(parents=True)
    checkpoint = RecoveryCheckpoint.load(logs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def saver(k: int) -> None:
        try:
            for round_ in range(40):
                barrier.wait()
                for name in names[k::2]:  # each thread moves its half's points, then both save at once
                    point = RecoveryPoint(LocalOffset(round_ * 10 + k), LocalOffset(0), {A: OriginSeq(round_)})
                    checkpoint.write(logs / name, point)
                barrier.wait()
                checkpoint.save(force=True)
        except BaseException as exc:  # reported below, with the file's state
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=saver, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    got = entries(logs)
    assert {n: got[n]["recovery_point"] for n in names} == {n: 390 + i % 2 for i, n in enumerate(names)}
