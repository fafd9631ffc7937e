"""Issue 26, the deploy kit: ``deploy/systemd/georep-node@.service`` and its environment file, and
``deploy/three-by-three.toml`` (three datacenters of three nodes) brought up as written, its ports moved to
127.0.0.1."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from georep.cli import node as node_cli
from georep.cli.topology_arg import load_topology
from tests.support.cli import start_up
from tests.support.ports import free_ports
from topology.ids import SiteId

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "systemd" / "georep-node@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "node.env.example"
THREE_BY_THREE = DEPLOY / "three-by-three.toml"
GEOREP = [sys.executable, "-m", "georep.cli"]
INSTALLED = "/opt/georep/venv/bin/georep"  # where deploy/README.md installs it


def verify(unit_text: str, tmp_path: Path) -> str:
    """What ``systemd-analyze verify`` says of the unit as instance ``eu-west-2``, with ``georep`` at this venv's
    (verify refuses a unit whose command does not exist here); it exits 0 on unknown keys, so its stderr is
    what tells."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip(
            "systemd-analyze is not installed, so the unit is not checked: apt-get install -y systemd "
            "(make test does where it can)"
        )
    georep = Path(sys.executable).parent / "georep"
    assert georep.exists(), f"{georep}: install the project first (make test does)"
    assert INSTALLED in unit_text
    unit = tmp_path / "georep-node@eu-west-2.service"
    unit.write_text(unit_text.replace(INSTALLED, str(georep)))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    return f"rc={done.returncode} {done.stdout}{done.stderr}".strip()


def test_the_node_unit_template_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == "rc=0"


def test_the_unit_check_catches_a_mistyped_key(tmp_path: Path) -> None:
    """The check above can fail: a unit with a typo in a key is reported."""
    said = verify(UNIT.read_text().replace("Restart=on-failure", "Restrat=on-failure"), tmp_path)
    assert "Unknown key" in said and "Restrat" in said


def environment(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return {k: v for k, v in pairs}


def test_the_environment_file_sets_what_the_unit_reads_and_georep_node_accepts_the_command() -> None:
    env = environment(ENV_EXAMPLE.read_text())
    command = next(line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    used = set(re.findall(r"\$\{?(GEOREP_[A-Z_]+)\}?", command))
    assert used == set(env), f"the unit reads {sorted(used)}, the example sets {sorted(env)}"
    program, subcommand, *argv = shlex.split(command.removeprefix("ExecStart="))
    assert (program, subcommand) == (INSTALLED, "node")
    argv = [a.replace("%i", "eu-west-2") for a in argv]
    argv = [env[a.strip("${}")] if a.startswith("$") else a for a in argv]
    parser = argparse.ArgumentParser(prog="georep node")
    node_cli.add_arguments(parser)
    args = parser.parse_args([w for a in argv for w in a.split()])
    assert (args.site, args.node_id, str(args.data_dir)) == ("eu-west", 2, "/var/lib/georep/eu-west-2")
    # the example names node 2 of eu-west in deploy/three-by-three.toml: its Kafka address is that node's
    member = load_topology(THREE_BY_THREE).site(args.site).members
    assert args.kafka_listen in {m.kafka for m in member if m.id == args.node_id}


def test_the_three_by_three_topology_has_three_sites_of_three_nodes_each_with_raft_and_kafka() -> None:
    topology = load_topology(THREE_BY_THREE)
    assert len(topology.site_ids()) == 3
    addresses = []
    for sid in topology.site_ids():
        members = topology.site(sid).members
        assert len(members) == 3
        assert all(m.raft and m.kafka for m in members), sid
        addresses += [a for m in members for a in (m.address, m.raft, m.kafka)]
    assert len(set(addresses)) == len(addresses)


def on_localhost(text: str) -> str:
    """The topology with every HOST:PORT in it moved to a free port of 127.0.0.1."""
    found = sorted(set(re.findall(r'"(\d+\.\d+\.\d+\.\d+:\d+)"', text)))
    moved = dict(zip(found, (f"127.0.0.1:{p}" for p in free_ports(len(found))), strict=True))
    return re.sub(r'"(\d+\.\d+\.\d+\.\d+:\d+)"', lambda m: f'"{moved[m.group(1)]}"', text)


def georep(*args: str, timeout: float = 90, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GEOREP, *args], capture_output=True, text=True, timeout=timeout, input=input_text)


@pytest.mark.slow  # nine nodes under georep up (about 30 s on 2 cores)
def test_the_three_by_three_topology_comes_up_and_a_record_written_in_one_datacenter_is_read_in_the_others(
    tmp_path: Path,
) -> None:
    topo, data = tmp_path / "three-by-three.toml", tmp_path / "data"
    topo.write_text(on_localhost(THREE_BY_THREE.read_text()))
    topology = load_topology(topo)
    node_dirs = [data / s / str(m.id) for s in topology.site_ids() for m in topology.site(s).members]
    up = start_up(topo, data, node_dirs, timeout_s=120)
    try:
        assert len({json.loads((d / "node.json").read_text())["pid"] for d in node_dirs}) == 9
        certs = ("--data-dir", str(data))
        us, eu, ap = (topology.site(SiteId(s)).members for s in ("us-east", "eu-west", "ap-south"))
        made = georep("topic", "create", "orders", "--partitions", "3", "--bootstrap", us[0].address, *certs)
        assert made.returncode == 0, made.stderr
        sent = georep(
            "produce", "orders", "--acks", "all", "--bootstrap", us[1].address, *certs, input_text="one\ntwo\n"
        )
        assert sent.returncode == 0, sent.stderr
        for reader in (eu[2], ap[2]):
            read = georep(
                "consume", "orders", "--from-beginning", "--max", "2", "--timeout", "60",
                "--bootstrap", reader.address, *certs,
            )  # fmt: skip
            assert read.returncode == 0, read.stderr
            assert sorted(read.stdout.split()) == ["one", "two"]
    finally:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=120)
    assert up.returncode == 0, err
    assert "all sites stopped" in out
