"""georep up / status / topology show, run as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.sites import TRIANGLE, free_ports, topology_toml

GEOREP = [sys.executable, "-m", "georep.cli"]


def triangle(path: Path) -> Path:
    path.write_text(topology_toml(dict(zip("abc", free_ports(3), strict=True)), TRIANGLE))
    return path


def start_up(topo: Path, data: Path) -> subprocess.Popen[str]:
    """``georep up`` in the background, once every site's node has written its node.json."""
    up = subprocess.Popen([*GEOREP, "up", "--topology", str(topo), "--data-dir", str(data)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all((data / s / "node.json").exists() for s in "abc"):
        time.sleep(0.1)
    return up


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GEOREP, *args], capture_output=True, text=True, timeout=timeout)


def test_up_starts_every_site_and_sigterm_stops_them_cleanly(tmp_path: Path) -> None:
    topo, data = triangle(tmp_path / "t.toml"), tmp_path / "data"
    up = start_up(topo, data)
    try:
        infos = {s: json.loads((data / s / "node.json").read_text()) for s in "abc"}
        for info in infos.values():
            os.kill(info["pid"], 0)  # each site runs as its own process
        assert len({i["pid"] for i in infos.values()}) == 3
        health = run("health", "--bootstrap", infos["b"]["listen"])
        assert health.returncode == 0 and "site=b" in health.stdout
    finally:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert "all sites stopped" in out
    for s in "abc":
        assert not (data / s / "node.json").exists()  # removed by a clean node shutdown


def test_a_second_up_on_the_same_data_dir_fails_at_once_and_leaves_the_first_running(tmp_path: Path) -> None:
    topo, data = triangle(tmp_path / "t.toml"), tmp_path / "data"
    up = start_up(topo, data)
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
        assert run("health", "--bootstrap", infos["a"]["listen"]).returncode == 0
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)
    assert up.returncode == 0


def test_bad_topology_files_get_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[sites.a]\nnodes = ["127.0.0.1:1"]\n[[links]]\nsrc = "a"\ndst = "zz"\n')
    for command in (["up"], ["status"]):
        proc = run(*command, "--topology", str(bad), "--data-dir", str(tmp_path / "d"), timeout=30) \
            if command == ["up"] else run(*command, "--topology", str(bad))  # fmt: skip
        assert proc.returncode == 2
        assert "unknown site 'zz'" in proc.stderr
        assert "Traceback" not in proc.stderr
    missing = run("status", "--topology", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "cannot read topology file" in missing.stderr


def test_a_site_with_several_nodes_is_refused_by_up_and_by_node_until_they_form_one_site(tmp_path: Path) -> None:
    topo = tmp_path / "three.toml"
    topo.write_text('[sites.a]\nnodes = ["127.0.0.1:1", "127.0.0.1:2"]\n')
    node = run("node", "--site", "a", "--topology", str(topo), "--data-dir", str(tmp_path / "n"), timeout=30)
    assert node.returncode == 2 and "lists 2 nodes" in node.stderr and "Traceback" not in node.stderr
    up = run("up", "--topology", str(topo), "--data-dir", str(tmp_path / "d"), timeout=30)
    assert up.returncode == 2 and "lists 2 nodes" in up.stderr


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
