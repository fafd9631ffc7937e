"""georep up / status / topology show, run as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from georep.cli.up import stop_all
from tests.support.cli import start_up
from tests.support.cluster_site import site_toml
from tests.support.ports import free_ports
from tests.support.sites import TRIANGLE, topology_toml

GEOREP = [sys.executable, "-m", "georep.cli"]


def triangle(path: Path) -> Path:
    path.write_text(topology_toml(dict(zip("abc", free_ports(3), strict=True)), TRIANGLE))
    return path


def run(*args: str, timeout: float = 60, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GEOREP, *args], capture_output=True, text=True, timeout=timeout, input=input_text)


@pytest.mark.slow  # georep up of three sites (6 s)
def test_up_starts_every_site_and_sigterm_stops_them_cleanly(tmp_path: Path) -> None:
    topo, data = triangle(tmp_path / "t.toml"), tmp_path / "data"
    up = start_up(topo, data, [data / s for s in "abc"])
    try:
        infos = {s: json.loads((data / s / "node.json").read_text()) for s in "abc"}
        for info in infos.values():
            os.kill(info["pid"], 0)  # each site runs as its own process
        assert len({i["pid"] for i in infos.values()}) == 3
        health = run("health", "--bootstrap", infos["b"]["listen"], "--data-dir", str(data))  # its certs: mTLS
        assert health.returncode == 0 and "site=b" in health.stdout
        plain = run("health", "--bootstrap", infos["b"]["listen"], "--insecure")
        assert plain.returncode == 1 and "requires TLS" in plain.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert "all sites stopped" in out
    for s in "abc":
        assert not (data / s / "node.json").exists()  # removed by a clean node shutdown


@pytest.mark.slow  # two georep up runs of three sites each (8 s)
def test_a_second_up_on_the_same_data_dir_fails_at_once_and_leaves_the_first_running(tmp_path: Path) -> None:
    topo, data = triangle(tmp_path / "t.toml"), tmp_path / "data"
    up = start_up(topo, data, [data / s for s in "abc"])
    try:
        infos = {s: json.loads((data / s / "node.json").read_text()) for s in "abc"}
        second = run("up", "--topology", str(topo), "--data-dir", str(data), timeout=60)
        assert second.returncode == 1
        assert f"in use by another georep node (pid {infos['a']['pid']}, serving on {infos['a']['listen']})" in (
            second.stderr
        )
        for s, info in infos.items():  # the first up's nodes run on, untouched
            os.kill(info["pid"], 0)
            assert json.loads((data / s / "node.json").read_text())["pid"] == info["pid"]
        assert run("health", "--bootstrap", infos["a"]["listen"], "--data-dir", str(data)).returncode == 0
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)
    assert up.returncode == 0


def test_bad_topology_files_get_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[sites.a]\nnodes = ["127.0.0.1:1"]\n[[links]]\nsrc = "a"\ndst = "zz"\n')
    for command in (["up"], ["status"]):
        proc = (
            run(*command, "--topology", str(bad), "--data-dir", str(tmp_path / "d"), timeout=30)
            if command == ["up"]
            else run(*command, "--topology", str(bad))
        )
        assert proc.returncode == 2
        assert "unknown site 'zz'" in proc.stderr
        assert "Traceback" not in proc.stderr
    missing = run("status", "--topology", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "cannot read topology file" in missing.stderr


@pytest.mark.slow  # georep up of a multi-node site (5 s)
def test_a_multi_node_site_that_cannot_run_is_refused_with_what_to_do(tmp_path: Path) -> None:
    no_raft = tmp_path / "no-raft.toml"
    no_raft.write_text('[sites.a]\nnodes = ["127.0.0.1:1", "127.0.0.1:2"]\n')
    node = run("node", "--site", "a", "--topology", str(no_raft), "--data-dir", str(tmp_path / "n"), timeout=30)
    assert node.returncode == 2 and "raft" in node.stderr and "Traceback" not in node.stderr
    up = run("up", "--topology", str(no_raft), "--data-dir", str(tmp_path / "d"), timeout=30)
    assert up.returncode == 2 and "raft" in up.stderr and "Traceback" not in up.stderr

    g, r = free_ports(2), free_ports(2)
    alone = tmp_path / "alone.toml"
    alone.write_text(site_toml("a", g, r))
    node = run("node", "--site", "a", "--topology", str(alone), "--data-dir", str(tmp_path / "o"), timeout=30)
    assert node.returncode == 2 and "--node-id" in node.stderr
    node = run(
        "node", "--site", "a", "--node-id", "7", "--topology", str(alone), "--data-dir", str(tmp_path / "o"), timeout=30
    )
    assert node.returncode == 2 and "no node 7" in node.stderr


@pytest.mark.slow
def test_up_runs_a_site_of_three_nodes_that_takes_writes_and_reads(tmp_path: Path) -> None:
    g, r = free_ports(3), free_ports(3)
    topo, data = tmp_path / "site.toml", tmp_path / "data"
    topo.write_text(site_toml("a", g, r))
    up = start_up(topo, data, [data / "a" / n for n in "123"])
    try:
        pids = {json.loads((data / "a" / n / "node.json").read_text())["pid"] for n in "123"}
        assert len(pids) == 3, "one process per node"
        bootstrap = f"127.0.0.1:{g[0]}"
        certs = ("--data-dir", str(data))  # the node:a/<n> and client:admin certificates 'up' made there
        assert run("topic", "create", "t", "--partitions", "2", "--bootstrap", bootstrap, *certs).returncode == 0
        produced = run(
            "produce", "t", "--acks", "all", "--bootstrap", f"127.0.0.1:{g[1]}", *certs, input_text="one\ntwo\nthree\n"
        )
        assert produced.returncode == 0, produced.stderr
        consumed = run(
            "consume",
            "t",
            "--from-beginning",
            "--max",
            "3",
            "--timeout",
            "20",
            "--bootstrap",
            f"127.0.0.1:{g[2]}",
            *certs,
        )
        assert consumed.returncode == 0, consumed.stderr
        assert sorted(consumed.stdout.split()) == ["one", "three", "two"]
    finally:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert "all sites stopped" in out
    assert not any((data / "a" / n / "node.json").exists() for n in "123")
    lines = out.splitlines()  # each node is listed as it serves, between these two lines
    rows = [i for i, line in enumerate(lines) if line.startswith("a ")]
    assert len(rows) == 3
    assert lines.index("starting 3 node(s); each is listed once it serves") < rows[0]
    assert rows[-1] < lines.index("all sites up; Ctrl-C stops them")


def test_status_reports_unreachable_sites(tmp_path: Path) -> None:
    topo = triangle(tmp_path / "t.toml")
    proc = run("status", "--topology", str(topo))
    assert proc.returncode == 1
    assert proc.stdout.count("unreachable") == 3


def test_topology_show_writes_a_picture(tmp_path: Path) -> None:
    topo = triangle(tmp_path / "t.toml")
    picture = tmp_path / "t.svg"
    proc = run("topology", "show", str(topo), "--output", str(picture))
    assert proc.returncode == 0, proc.stderr
    assert "a -> b" in proc.stdout
    assert "<svg" in picture.read_text()


class Recorded:
    """A NodeProcess's stop calls, recorded in ``events``."""

    def __init__(self, name: str, events: list[tuple[str, str]]) -> None:
        self.name, self.events = name, events
        self.proc = self

    def alive(self) -> bool:
        return True

    def terminate(self) -> None:
        self.events.append(("SIGTERM", self.name))

    def stop(self) -> None:
        self.events.append(("wait", self.name))


def test_up_sends_sigterm_to_every_node_before_it_waits_for_any() -> None:
    """Stopped one at a time, the nodes of three sites of three took 31 s (each waited for the calls its running
    peers held); together, 0.4 s. Planted: stop() in turn, as before, fails here."""
    events: list[tuple[str, str]] = []
    stop_all([Recorded(n, events) for n in "123"])  # type: ignore[list-item]
    assert events == [("SIGTERM", "1"), ("SIGTERM", "2"), ("SIGTERM", "3"), ("wait", "1"), ("wait", "2"), ("wait", "3")]
