"""Issue 20, item 9: a data dir is its owner's only: every directory 0700, every file 0600 (docs/operations.md,
"The data dir").

``topics.json`` holds users' SCRAM salts, stored keys and server keys; it was 0644 in a 0755 data dir.
"""

from __future__ import annotations

import asyncio
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from georep.server.process import NodeProcess
from georep.storage.private import tighten
from tests.support.cluster_site import site_toml
from tests.support.ports import free_ports
from tests.support.sites import produce, wait_until

GEOREP = [sys.executable, "-m", "georep.cli"]


def open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` (``root`` included) that is not exactly 0700 (directories) or 0600 (files)."""
    found = []
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) != want:
            found.append(f"{path.relative_to(root)} {oct(stat.S_IMODE(st.st_mode))}")
    return found


def test_tighten_takes_away_the_group_and_others_and_says_what(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "logs" / "t-0").mkdir(parents=True)
    for path in (root, root / "logs", root / "logs" / "t-0"):
        path.chmod(0o755)
    (root / "topics.json").write_text("{}")
    (root / "topics.json").chmod(0o644)
    (root / "node.json").write_text("{}")
    (root / "node.json").chmod(0o600)
    (root / "link").symlink_to("/etc/hostname")
    changed = tighten(root)
    assert sorted(changed.directories) == [".", "logs", "logs/t-0"] and changed.files == ["topics.json"]
    text = changed.describe(root)
    assert f"data dir {root} was open to other users" in text and "3 directories and 1 file(s)" in text
    assert "and 1 more" in text and "0700" in text
    assert open_to_others(root) == []
    assert not tighten(root)  # nothing left to change


@pytest.mark.slow
def test_a_node_keeps_its_data_dir_private_and_tightens_an_open_one(tmp_path: Path) -> None:
    data = tmp_path / "a"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "notes.txt").write_text("left by an older version")
    (data / "notes.txt").chmod(0o644)
    node = NodeProcess(
        site="a",
        data_dir=data,
        listen=f"127.0.0.1:{free_ports(1)[0]}",
        extra_args=["--insecure", "--segment-bytes-max", "4096"],
    )
    node.start()
    try:
        created = subprocess.run(
            [*GEOREP, "topic", "create", "t", "--partitions", "2", "--bootstrap", node.address, "--insecure"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stderr
        asyncio.run(produce(node.address, "t", "p", 300, value_bytes=100))
        wait_until("segments rolled", lambda: len(list(data.glob("logs/t-*/*.log"))) > 4, 30)
    finally:
        assert node.stop() == 0
    logged = (data / "node.log").read_text()
    assert f"data dir {data} was open to other users" in logged and "notes.txt" in logged
    assert (data / "topics.json").exists()
    assert open_to_others(data) == []


@pytest.mark.slow
def test_georep_up_keeps_a_multi_node_sites_data_dirs_private(tmp_path: Path) -> None:
    g, r = free_ports(3), free_ports(3)
    topo, data = tmp_path / "site.toml", tmp_path / "data"
    topo.write_text(site_toml("a", g, r))
    up = subprocess.Popen(
        [*GEOREP, "up", "--topology", str(topo), "--data-dir", str(data), "--", "--segment-bytes-max", "4096"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until("every node serves", lambda: all((data / "a" / n / "node.json").exists() for n in "123"), 60)
        certs = ("--data-dir", str(data))
        created = subprocess.run(
            [*GEOREP, "topic", "create", "t", "--partitions", "1", "--bootstrap", f"127.0.0.1:{g[0]}", *certs],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stderr
        lines = "".join(f"record {i:04d} {'x' * 100}\n" for i in range(200))
        produced = subprocess.run(
            [*GEOREP, "produce", "t", "--acks", "all", "--bootstrap", f"127.0.0.1:{g[1]}", *certs],
            input=lines,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert produced.returncode == 0, produced.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        _out, err = up.communicate(timeout=90)
    assert up.returncode == 0, err
    assert list(data.glob("a/*/raft/*")), "the Raft journal is under the data dirs"
    assert list(data.glob("certs/*.key")) and list(data.glob("certs/*.crt"))
    assert open_to_others(data) == []
