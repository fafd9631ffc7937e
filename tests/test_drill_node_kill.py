"""``georep drill --mode node-kill`` end to end on a real three-node site: it kills the node leading partition 0,
keeps every ``acks=all`` promise, and its report matches an independent count of what the site holds."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from georep.server.process import NODE_INFO
from offsets.vector import VectorOffset
from tests.support.cluster_site import ClusterSite, read_partition

PARTITIONS = 2


def drill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", "drill", "--mode", "node-kill", *args],
        capture_output=True,
        text=True,
        timeout=90,
    )


def running_pid(site: ClusterSite, node: int) -> int:
    return int(json.loads((site.nodes[node].data_dir / NODE_INFO).read_text())["pid"])


@pytest.mark.slow
def test_node_kill_keeps_acks_all_and_its_report_matches_what_the_site_holds(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
    report_path = tmp_path / "report.json"
    try:
        site.start()
        started = {n: node.pid for n, node in site.nodes.items()}
        proc = drill(
            "--topology",
            str(site.topology),
            "--data-dir",
            str(tmp_path),
            "--site",
            "a",
            "--report",
            str(report_path),
            "--partitions",
            str(PARTITIONS),
            "--warmup",
            "2",
            "--after",
            "2",
            "--rate",
            "100",
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "every promise kept" in proc.stdout
        doc = json.loads(report_path.read_text())
        victim = doc["victim_node"]
        topic = doc["topic"]
        # The drill killed the node it names (its pid) and restarted it: a new process serves there now.
        assert doc["victim_pid"] == started[victim] and not site.nodes[victim].alive()
        restarted = running_pid(site, victim)
        assert restarted != started[victim]
        held = {p: read_partition(site.address(site.wait_leader(topic, p)), topic, p) for p in range(PARTITIONS)}
    finally:
        for n, node in site.nodes.items():  # the node the drill restarted is not one of the site's processes
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = running_pid(site, n)
                if node.proc is None or pid != node.proc.pid:
                    os.kill(pid, signal.SIGKILL)
        site.close()

    # It killed the leader of partition 0, and every partition it led moved to another node.
    assert 0 in doc["victim_partitions"]
    assert set(doc["new_leaders"]) == {str(p) for p in doc["victim_partitions"]}
    assert victim not in doc["new_leaders"].values()
    assert 0 < doc["rto_ms"] <= doc["rto_ms_all"] < 30_000 and 0 < doc["rto_read_ms"] < 30_000

    # Independent count: the site holds each record once, each origin's sequence without a gap ...
    records = [r for p in range(PARTITIONS) for r in held[p]]
    values = Counter(v.decode() for _o, _s, v in records)
    assert all(n == 1 for n in values.values())
    for p in range(PARTITIONS):
        seqs: dict[str, list[int]] = {}
        for origin, seq, _v in held[p]:
            seqs.setdefault(origin, []).append(seq)
        assert all(s == list(range(len(s))) for s in seqs.values())
        # ... which is the vector the report gives ...
        assert VectorOffset.parse(doc["partitions_final"][str(p)]) == VectorOffset.parse(
            ",".join(f"{o}:{len(s)}" for o, s in seqs.items())
        )
    # ... and what the report counts: records in the topic, all delivered to its consumer once, with no gap.
    assert doc["records_in_topic"] == len(records) == doc["delivered_unique"] == doc["delivered"]
    assert doc["duplicates_total"] == doc["gaps"] == doc["misread"] == doc["never_delivered"] == 0
    per_level = Counter(value.split("|")[1] for value in values)
    assert set(doc["acks"]) == {"all", "leader"}
    for level, figures in doc["acks"].items():
        # acks=all lost nothing, now or for good; acks=leader lost at most what the report says it lost.
        assert figures["acked"] - figures["lost_after_rejoin"] <= per_level[level] <= figures["sent"]
        assert figures["acked"] > 0 and figures["acked_at_victim"] == figures["acked"]
    assert doc["acks"]["all"]["rpo_lost"] == doc["acks"]["all"]["lost_after_rejoin"] == 0
    assert doc["records_acked"] == sum(f["acked"] for f in doc["acks"].values())
    assert doc["rejoined"] and doc["ok"] and not doc["promises_broken"]


def test_node_kill_refuses_a_one_node_site_and_an_unknown_node(tmp_path: Path) -> None:
    topology = tmp_path / "t.toml"
    topology.write_text(
        '[sites.a]\nnodes = ["127.0.0.1:1"]\n'
        '[sites.b]\nnodes = [{ id = 1, address = "127.0.0.1:2", raft = "127.0.0.1:3" }, '
        '{ id = 2, address = "127.0.0.1:4", raft = "127.0.0.1:5" }]\n'
    )
    one = drill("--topology", str(topology), "--site", "a")
    assert one.returncode == 2 and "site a has one node" in one.stderr and "--site b" in one.stderr
    unknown = drill("--topology", str(topology), "--site", "b", "--node", "7")
    assert unknown.returncode == 2 and "site b has no node 7" in unknown.stderr
    down = drill("--topology", str(topology))  # the first site of several nodes, which is not running
    assert down.returncode == 2 and "does not answer" in down.stderr
