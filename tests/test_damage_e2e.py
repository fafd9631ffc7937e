"""A flipped byte in a sealed segment, with real node processes: reported, never skipped silently, and repaired
from a peer's copy (issue 10's reproduction: 20,000 records, 64 KiB segments, 4 KiB batches)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from georep.server.process import NodeProcess
from georep.storage.index_format import FILE_HEADER, ORIGIN_ENTRY_BYTES
from tests.support.cli import georep, ok
from tests.support.sites import Sites, converged, wait_until

RECORDS = 20_000
SEGMENT = ["--segment-bytes-max", "65536"]

pytestmark = pytest.mark.slow


def produce(address: str, topic: str = "t") -> None:
    b = ("--bootstrap", address)
    lines = b"".join(b"%d\n" % i for i in range(RECORDS))
    ok(georep("topic", "create", topic, "--partitions", "1", *b))
    assert (
        f"produced {RECORDS} records"
        in georep("produce", topic, "--batch-size", "4096", *b, stdin=lines).stderr.decode()
    )


def flip_mid_second_segment(data_dir: Path, topic: str = "t") -> None:
    logs = sorted((data_dir / "logs" / f"{topic}-0").glob("*.log"))
    assert len(logs) >= 3, logs
    data = bytearray(logs[1].read_bytes())
    data[len(data) // 2 + 100] ^= 0x10  # inside some batch's records
    logs[1].write_bytes(bytes(data))


def metric(node: NodeProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def consume(address: str, *extra: str) -> tuple[int, list[bytes], str]:
    result = georep("consume", "t", "--from-beginning", "--timeout", "3", "--bootstrap", address, *extra, timeout=60)
    return result.returncode, result.stdout.splitlines(), result.stderr.decode()


def test_alone_a_site_reports_the_damage_and_skips_only_when_asked(start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node(extra_args=[*SEGMENT, "--scrub-bytes-per-s", "0"])  # no background scrubber
    produce(node.address)
    node.stop()
    flip_mid_second_segment(node.data_dir)
    node.start()
    scrub = georep("scrub", "--now", "--bootstrap", node.address)
    assert scrub.returncode == 3 and "1 damaged batch(es) found; 1 quarantined now" in scrub.stdout.decode()
    code, lines, err = consume(node.address)
    assert code == 1, err
    assert "are damaged at site a" in err and "quarantined" in err and "--skip-corrupt" in err
    assert lines == [b"%d" % i for i in range(len(lines))]  # everything before the damage, then the error
    code, lines, err = consume(node.address, "--skip-corrupt")
    assert code == 0, err
    skipped = RECORDS - len(lines)
    assert 0 < skipped < 500 and "skipped 1 damaged range(s)" in err and "skipped damaged records of t/0" in err
    assert metric(node, "georep_quarantined_batches{") == 1 and metric(node, "georep_corrupt_batches_total") == 1
    # the quarantine survives a restart, and the node says so when it starts
    node.stop()
    node.start()
    assert "stay quarantined" in (node.data_dir / "node.log").read_text()
    assert consume(node.address)[0] == 1


def test_a_peers_copy_repairs_the_damage_in_place(make_sites: Callable[..., Sites]) -> None:
    # The scrubber checks every partition once per --scrub-interval-ms: 2 s here, so it finds the damage within it.
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")], extra_args=[*SEGMENT, "--scrub-interval-ms", "2000"])
    sites.start()
    produce(sites.address("a"))
    wait_until("b holds every record", lambda: converged(sites, ["a", "b"], "t", RECORDS), 60)
    b = sites.nodes["b"]
    b.stop()
    flip_mid_second_segment(b.data_dir)
    offsets_before = sorted(p.name for p in (b.data_dir / "logs" / "t-0").glob("*.log"))
    b.start()
    # nobody has read it yet: the background scrubber (or a's pull) finds it within its interval, and b fetches
    # a's copy by its coordinate
    wait_until(
        "b found and repaired the batch",
        lambda: metric(b, "georep_corrupt_batches_total") == 1 and metric(b, "georep_repaired_batches_total") == 1,
        30,
    )
    assert metric(b, "georep_quarantined_batches{") == 0
    scrub = georep("scrub", "--now", "--bootstrap", b.address)
    assert scrub.returncode == 0 and "0 damaged batch(es) found; 0 quarantined now" in scrub.stdout.decode()
    code, lines, err = consume(b.address)
    assert code == 0, err
    assert lines == [b"%d" % i for i in range(RECORDS)]  # all 20,000, in order
    assert sorted(p.name for p in (b.data_dir / "logs" / "t-0").glob("*.log")) == offsets_before  # in place
    assert not (b.data_dir / "logs" / "t-0" / "damaged.json").exists()
    log = (b.data_dir / "node.log").read_text()
    assert "quarantined offsets" in log and "with site a's copy" in log
    assert json.loads((b.data_dir / "node.json").read_text())["pid"] == b.pid


def test_deleted_index_files_are_rebuilt_and_a_lost_segment_is_quarantined_or_refused(start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node(extra_args=SEGMENT)
    produce(node.address)
    node.stop()
    partition = node.data_dir / "logs" / "t-0"
    for index in [*partition.glob("*.index"), *partition.glob("*.oindex")]:
        index.unlink()
    node.start()
    code, lines, err = consume(node.address)
    assert code == 0 and lines == [b"%d" % i for i in range(RECORDS)], err
    node.stop()
    # A .log lost with its origin index surviving: every batch it held is quarantined by coordinate, not cut.
    lost = sorted(partition.glob("*.log"))[1]
    lost.unlink()
    node.start()
    code, lines, err = consume(node.address)
    assert code == 1 and "quarantined" in err and lines == [b"%d" % i for i in range(len(lines))]
    node.stop()
    # Lost with its origin index: nothing names what it held, so the node refuses to start and says what to do.
    lost.with_suffix(".oindex").unlink()
    lost.write_bytes(b"")
    lost.unlink()
    refused = subprocess.run(node.command(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "are missing, and so is their origin index" in refused.stderr and "new epoch" in refused.stderr
    assert len(list(partition.glob("*.log"))) >= 2  # nothing was cut away


TORN = ["--segment-bytes-max", "4096"]


def two_sites_with_300_records(make_sites: Callable[..., Sites]) -> Sites:
    """Issue 20's setup: x <-> y, topic t (4 KiB segments), 300 records produced at x in 200-byte batches."""
    sites = make_sites(["x", "y"], [("x", "y"), ("y", "x")], extra_args=TORN)
    sites.start()
    b = ("--bootstrap", sites.address("x"))
    ok(georep("topic", "create", "t", "--partitions", "1", *b))
    lines = b"".join(b"%d\n" % i for i in range(300))
    assert "produced 300 records" in georep("produce", "t", "--batch-size", "200", *b, stdin=lines).stderr.decode()
    wait_until("y holds every record", lambda: converged(sites, ["x", "y"], "t", 300), 60)
    return sites


def every_record_once_at(sites: Sites, site: str) -> None:
    code, lines, err = consume(sites.address(site))
    assert code == 0, err
    assert lines == [b"%d" % i for i in range(300)], f"site {site} holds {len(lines)} of 300 records"


def test_a_torn_sealed_segment_at_a_replica_is_repaired_by_coordinate_never_cut(
    make_sites: Callable[..., Sites],
) -> None:
    """Issue 20, item 1: y cut the log at the damage, deleted the good segments after it and kept its vector, so
    it held 114 of 300 records for good while status said converged."""
    sites = two_sites_with_300_records(make_sites)
    y = sites.nodes["y"]
    y.stop()
    second = sorted((y.data_dir / "logs" / "t-0").glob("*.log"))[1]
    with open(second, "r+b") as f:
        f.truncate(second.stat().st_size - 100)
    segments = sorted(p.name for p in second.parent.glob("*.log"))
    y.start()
    wait_until(
        "y repaired the torn tail from x's copy",
        lambda: metric(y, "georep_repaired_batches_total") >= 1 and metric(y, "georep_quarantined_batches{") == 0,
        30,
    )
    every_record_once_at(sites, "y")
    assert sorted(p.name for p in second.parent.glob("*.log")) == segments  # nothing deleted
    log = (y.data_dir / "node.log").read_text()
    assert "quarantined" in log and "with site x's copy" in log and "deleting segment" not in log
    scrub = georep("scrub", "--now", "--bootstrap", sites.address("y"))
    assert scrub.returncode == 0 and "0 damaged batch(es) found; 0 quarantined now" in scrub.stdout.decode()
    status = georep("status", "--topology", str(sites.topology))
    assert "converged partitions: 1/1" in status.stdout.decode(), status.stdout.decode()


def test_a_lying_origin_index_is_rebuilt_from_the_batches_never_used_to_overwrite_one(
    make_sites: Callable[..., Sites],
) -> None:
    """Issue 20, item 2: y's .oindex said seq 55 where the CRC-valid batch said 53; scrub quarantined the good
    batch and wrote x's seqs 55..56 over it: values 54 and 55 lost, 56 and 57 held twice."""
    sites = two_sites_with_300_records(make_sites)
    y = sites.nodes["y"]
    y.stop()
    oindex = sorted((y.data_dir / "logs" / "t-0").glob("*.oindex"))[1]
    raw = bytearray(oindex.read_bytes())
    at = FILE_HEADER.size + 2 * ORIGIN_ENTRY_BYTES + 36  # entry 2's base_origin_seq
    seq = int.from_bytes(raw[at : at + 8], "big")
    raw[at : at + 8] = (seq + 2).to_bytes(8, "big")
    oindex.write_bytes(bytes(raw))
    y.start()
    scrub = georep("scrub", "--now", "--bootstrap", sites.address("y"))
    assert scrub.returncode == 0 and "0 damaged batch(es) found; 0 quarantined now" in scrub.stdout.decode()
    every_record_once_at(sites, "y")
    assert metric(y, "georep_repaired_batches_total") == 0  # nothing was written over a batch
    assert georep("scrub", "--now", "--bootstrap", sites.address("y")).returncode == 0


def test_status_never_says_converged_while_a_site_does_not_answer(make_sites: Callable[..., Sites]) -> None:
    """Issue 20, item 7: with site y failing to answer, 'georep status' printed 'site y: unreachable' and still
    'converged'."""
    sites = two_sites_with_300_records(make_sites)
    status = georep("status", "--topology", str(sites.topology))
    assert status.returncode == 0 and "converged partitions: 1/1" in status.stdout.decode()  # the user topic only
    sites.nodes["y"].stop()
    status = georep("status", "--topology", str(sites.topology))
    out = status.stdout.decode()
    assert status.returncode == 1 and "site y: unreachable" in out
    assert "converged partitions" not in out and "convergence unknown: site(s) y did not answer" in out
