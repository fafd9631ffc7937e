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
from tests.support.cli import georep, ok
from tests.support.sites import Sites, converged, wait_until

RECORDS = 20_000
SEGMENT = ["--segment-bytes-max", "65536"]

pytestmark = pytest.mark.slow


def produce(address: str, topic: str = "t") -> None:
    b = ("--bootstrap", address)
    lines = b"".join(b"%d\n" % i for i in range(RECORDS))
    ok(georep("topic", "create", topic, "--partitions", "1", *b))
    assert f"produced {RECORDS} records" in georep("produce", topic, "--batch-size", "4096", *b,
                                                   stdin=lines).stderr.decode()  # fmt: skip


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
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")], extra_args=SEGMENT)
    sites.start()
    produce(sites.address("a"))
    wait_until("b holds every record", lambda: converged(sites, ["a", "b"], "t", RECORDS), 60)
    b = sites.nodes["b"]
    b.stop()
    flip_mid_second_segment(b.data_dir)
    offsets_before = sorted(p.name for p in (b.data_dir / "logs" / "t-0").glob("*.log"))
    b.start()
    # nobody has read it yet: the background scrubber (or a's pull) finds it, and b fetches a's copy by its
    # coordinate
    wait_until("b found and repaired the batch", lambda: metric(b, "georep_corrupt_batches_total") == 1
               and metric(b, "georep_repaired_batches_total") == 1, 30)  # fmt: skip
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


def test_deleted_index_files_are_rebuilt_and_a_missing_middle_segment_is_refused(start_node) -> None:  # type: ignore[no-untyped-def]
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
    sorted(partition.glob("*.log"))[1].unlink()
    refused = subprocess.run(node.command(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "are missing" in refused.stderr and "let replication rebuild the partition" in refused.stderr
    assert len(list(partition.glob("*.log"))) >= 2  # nothing was cut away
